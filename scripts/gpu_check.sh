#!/usr/bin/env bash
# GPU check of the torch backend on one NVIDIA GPU: FSDP2 over NCCL, bf16, a few
# GRPO steps on a locally built, randomly initialised Qwen3-0.6B-shaped model with
# the transformers rollout engine (no vLLM, no network). Writes the step-time
# breakdown, tokens/s and peak GPU memory to $OUT/gpu_check.txt (or ./gpu_check.txt)
# plus gpu_check.json beside it. About 3-8 minutes. Exit 0 when every check passes.
#
#   bash scripts/gpu_check.sh                 # on the GPU machine, from the repo root
#   bash scripts/gpu_check.sh --cpu-smoke     # the same logic on CPU, tiny shape
#   bash scripts/gpu_check.sh --bench-train   # issue 11 instead: scripts/bench_train.py --gpu,
#                                             # eager then --compile (about 6-9 minutes);
#                                             # $OUT/bench_train_gpu{,_compile}.{txt,json}
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-}"
if [[ -z "$PY" ]]; then
  if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
fi
RESULTS="${OUT:-.}/gpu_check.txt"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export TOKENIZERS_PARALLELISM=false
export ARENO_CACHE="${ARENO_CACHE:-$(mktemp -d)}"
if [[ "${1:-}" == "--bench-train" ]]; then
  for mode in "" "--compile"; do
    name="bench_train_gpu${mode:+_compile}"
    timeout --signal=TERM --kill-after=30 "${BENCH_TRAIN_TIMEOUT:-270}" \
      "$PY" scripts/bench_train.py --gpu $mode --repeats 3 --out "${OUT:-.}/$name.json" \
      2>&1 | tee "${OUT:-.}/$name.txt"
  done
  exit 0
fi
# the whole check must never outlive its budget (the driver tears the backend down on exit)
exec timeout --signal=TERM --kill-after=30 "${GPU_CHECK_TIMEOUT:-540}" \
  "$PY" scripts/gpu_check.py --out "$RESULTS" "$@"
