#!/usr/bin/env bash
# One device call that checks and measures everything GPU-side that is waiting for a GPU:
# every `gpu` test, then the benchmarks of the open engine issues. Each part has its own time
# limit (a hung part cannot eat the whole call) and its own log; results JSON and logs land in
# $OUT (the device tool brings that folder back). Parts: gemv tests llm encoders prefill sched
# decode overlap whisper whisper_encode mega pruning pdl pdl_early b1_grid. At most 8 files come back: pick few parts per call.
#
#   run: bash bench/gpu_round.sh                 # all parts: their limits add up to 40 min, over one
#                                                # call's 28; split them over two calls
#        bash bench/gpu_round.sh gemv tests llm  # a subset, in this order
#
# The GPU machine's own torch/triton/transformers are used; the serving GPU tests also need
# websockets, soxr and mcap wheels and silero_vad.onnx under .cache/gpu-serve (carry it; see
# tests/serve/test_speech_stages_gpu.py). Set TRISTREAM_GIT_COMMIT to the commit you run
# (the device copy has no .git) so the results JSON records it.
set -u
OUT=${OUT:-/tmp/gpu_round_out}
mkdir -p "$OUT"
PY=${PY:-python3}
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(gemv tests llm encoders prefill sched)

if [ -d .cache/gpu-serve ] && ls .cache/gpu-serve/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-serve .cache/gpu-serve/*.whl \
    && export PYTHONPATH=/tmp/site-serve${PYTHONPATH:+:$PYTHONPATH}
  [ -f .cache/gpu-serve/silero_vad.onnx ] && export TRISTREAM_SILERO_ONNX=$PWD/.cache/gpu-serve/silero_vad.onnx
fi
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv > "$OUT/gpu.txt" 2>&1

step() {  # step NAME LIMIT_S CMD...: run with a limit, log to $OUT/NAME.log, say how it ended
  local name=$1 limit=$2
  shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name rc=$rc ${limit}s-limit took=$((SECONDS - t0))s" | tee -a "$OUT/summary.txt"
  tail -n 5 "$OUT/$name.log"
}

for part in "${parts[@]}"; do
  case $part in
    gemv) step gemv 240 $PY bench/gemv.py --name gemv_round ;;
    tests) step gpu_tests 480 $PY -m pytest -q -m gpu tests -p no:cacheprovider ;;
    llm) step llm 600 $PY bench/llm.py --models smollm2-135m,llama-3.2-1b,llama-3-8b --name llm_gpu_round ;;
    encoders) step encoders 420 $PY bench/encoders.py --only siglip,whisper,pruning --profile \
                --name encoders_round ;;
    prefill) step prefill_mix 240 $PY bench/prefill_mix.py --name prefill_mix_round ;;
    sched) step sched_real 420 $PY bench/sched.py --real --sessions 64 --duration 16 --warmup 3 \
             --real-schedulers ours,fifo ;;
    decode) step decode_profile 240 $PY bench/decode_profile.py --models smollm2-135m,llama-3.2-1b ;;
    overlap) step step_overlap 120 $PY bench/step_overlap.py --kernels b1_pdl --batches 1 --steps 200 \
               --name step_overlap_round ;;
    pdl) step pdl_chain 60 $PY bench/pdl_chain.py ;;
    pdl_early) step pdl_early 300 $PY bench/pdl_early.py ;;
    b1_grid) step decode_b1_grid 300 $PY bench/decode_b1_grid.py ;;
    mega) step decode_mega_cuda 120 $PY bench/decode_mega_cuda.py --model smollm2-135m ;;
    pruning) step pruning 150 $PY bench/encoders.py --only pruning --iters 40 --name encoders_pruning_round ;;
    whisper_encode) step whisper_encode 150 $PY bench/whisper_encode.py --name whisper_encode_round ;;
    whisper) for m in tiny small; do step whisper_$m 60 $PY bench/encoders.py --only whisper --whisper-quick \
               --whisper-models $m --iters 16 --profile --name encoders_whisper_round_$m; done ;;
    *) echo "unknown part $part (gemv tests llm encoders prefill sched decode overlap whisper whisper_encode mega pruning pdl pdl_early b1_grid)" | tee -a "$OUT/summary.txt" ;;
  esac
  # only this call's results (at most 8 files come back): those written since the call started
  find bench/results -maxdepth 1 -name '*.json' -newer "$OUT/gpu.txt" -exec cp {} "$OUT/" \; 2>/dev/null
done
cat "$OUT/summary.txt"
