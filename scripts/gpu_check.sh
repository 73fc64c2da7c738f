#!/usr/bin/env bash
# GPU check on one NVIDIA GPU (torch + transformers, no vLLM, no network), in
# one call of under 8 minutes. Everything lands in $OUT (or ./gpu_check_out):
#   1. gpu_check.txt/.json  the backend alone: FSDP2 over NCCL in bf16 on a
#      Qwen3-0.6B-shaped random model, step-time breakdown, peak memory;
#   2. cli.txt              the real CLI: the demo in bf16 for 100 steps with the
#      transformers engine beside the rank, then `areno train` for 3 steps on the
#      Qwen3-0.6B-shaped model (phases, weight sync, peak memory), each run's
#      metrics.jsonl summarised; the run dirs under $OUT/runs.
# Exit 0 when every part passes.
#
#   bash scripts/gpu_check.sh                 # on the GPU machine, from the repo root
#   bash scripts/gpu_check.sh --cpu-smoke     # the same steps on CPU, tiny shapes (tested in CI)
#   bash scripts/gpu_check.sh --bench-train   # issue 11 instead: scripts/bench_train.py --gpu,
#                                             # eager then --compile (about 6-9 minutes);
#                                             # $OUT/bench_train_gpu{,_compile}.{txt,json}
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-}"
if [[ -z "$PY" ]]; then
  if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
fi
SMOKE=0; [[ "${1:-}" == "--cpu-smoke" ]] && SMOKE=1
OUTDIR="${OUT:-./gpu_check_out}"; mkdir -p "$OUTDIR/runs"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export TOKENIZERS_PARALLELISM=false
export ARENO_CACHE="${ARENO_CACHE:-$(mktemp -d)}"
if [[ "${1:-}" == "--bench-train" ]]; then  # a call of its own: it needs 6-9 minutes
  for mode in "" "--compile"; do
    name="bench_train_gpu${mode:+_compile}"
    timeout --signal=TERM --kill-after=30 "${BENCH_TRAIN_TIMEOUT:-270}" \
      "$PY" scripts/bench_train.py --gpu $mode --repeats 3 --out "$OUTDIR/$name.json" \
      2>&1 | tee "$OUTDIR/$name.txt"
  done
  exit 0
fi
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
T=timeout; status=0
AR=("$PY" -m areno.cli)

if [[ $SMOKE == 1 ]]; then
  DEV=(--device cpu --dtype bfloat16); DEMO_STEPS=3; BIG_STEPS=2; BIG=(--max-new-tokens 8 --batch-size 4 --n-samples 2)
else
  DEV=(--device cuda --dtype bfloat16); DEMO_STEPS=100; BIG_STEPS=3; BIG=(--max-new-tokens 192 --batch-size 16 --n-samples 8)
fi

# 1. the backend alone (never more than 3 minutes)
$T --signal=TERM --kill-after=20 "${GPU_CHECK_TIMEOUT:-180}" "$PY" scripts/gpu_check.py \
  --out "$OUTDIR/gpu_check.txt" $([[ $SMOKE == 1 ]] && echo --cpu-smoke) || status=1

# 2. the real CLI
{
  echo "areno gpu_check: the CLI ($([[ $SMOKE == 1 ]] && echo 'CPU smoke' || echo GPU))"
  $T 150 "${AR[@]}" train "${DEV[@]}" --rollout-engine hf --max-steps $DEMO_STEPS --no-save \
      --output-dir "$OUTDIR/runs/demo" >"$OUTDIR/runs/demo.log" 2>&1 \
    && "$PY" scripts/gpu_check_cli.py summary "$OUTDIR/runs/demo" --title "demo, bf16, hf engine" \
    || { echo "FAIL demo run (see runs/demo.log)"; tail -5 "$OUTDIR/runs/demo.log"; status=1; }
  $T 120 "$PY" scripts/gpu_check_cli.py build "$WORK/big" $([[ $SMOKE == 1 ]] && echo --cpu-smoke) \
    && $T 240 "${AR[@]}" train "${DEV[@]}" --rollout-engine hf --ckpt "$WORK/big/model" \
      --dataset-path "$WORK/big/prompts.jsonl" --reward-fn-path "$WORK/big/reward.py" \
      --no-chat-template --max-steps $BIG_STEPS "${BIG[@]}" --no-save \
      --output-dir "$OUTDIR/runs/qwen3_0.6b" >"$OUTDIR/runs/qwen3_0.6b.log" 2>&1 \
    && "$PY" scripts/gpu_check_cli.py summary "$OUTDIR/runs/qwen3_0.6b" --title "Qwen3-0.6B shape, bf16, hf engine" \
    || { echo "FAIL Qwen3-0.6B-shaped run (see runs/qwen3_0.6b.log)"; tail -5 "$OUTDIR/runs/qwen3_0.6b.log"; status=1; }
  [[ $status == 0 ]] && echo "CLI: ALL PASS"
} 2>&1 | tee "$OUTDIR/cli.txt"
grep -q "CLI: ALL PASS" "$OUTDIR/cli.txt" || status=1

exit $status
