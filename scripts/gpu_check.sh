#!/usr/bin/env bash
# GPU check on one NVIDIA GPU (torch + transformers; no vLLM, datasets or
# math-verify; no network), in one device call: every step runs under
# `timeout --kill-after`, and the limits below add up to at most 450 s.
# Everything lands in $OUT (or ./gpu_check_out):
#   steps.jsonl        one line per step: name, exit code, seconds, its limit
#   gpu_check.txt/.json  attention kernels (packed == padded) and the transformers
#                      engine's peak memory at 1024 new tokens (scripts/gpu_check.py)
#   cli.txt, cli_*.json  the real CLI on the default path (`areno train`, default
#                      strategy, one GPU, bf16, transformers engine): the demo, then
#                      the Qwen3-0.6B-shaped model, full fine-tuning and LoRA r=8
#                      (issue 19: peak memory and step time with and without); phases,
#                      peak memory per train phase, and the run's own weight-sync check verdict
#   lm_head.txt/.json  lm_head backward in bf16 vs fp32 (scripts/bench_lm_head.py)
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
status=0
AR=("$PY" -m areno.cli)
KILL_AFTER=5
SCALE=1; [[ $SMOKE == 1 ]] && SCALE=4  # CI's shared CPUs, not the GPU budget, set the smoke's pace

# step NAME LIMIT_S CMD...: CMD under timeout (SIGTERM at LIMIT_S, SIGKILL KILL_AFTER s later),
# its exit code and seconds appended to steps.jsonl. GPU limits: 35+100+35+110+90+45 (+5 each) = 445 s.
step() {
  local name=$1 limit=$(($2 * SCALE)); shift 2
  local t0=$SECONDS rc=0
  timeout --signal=TERM --kill-after=$KILL_AFTER "$limit" "$@" || rc=$?
  printf '{"step": "%s", "rc": %d, "seconds": %d, "limit_s": %d}\n' \
    "$name" "$rc" $((SECONDS - t0)) "$limit" >>"$OUTDIR/steps.jsonl"
  [[ $rc == 0 ]] || status=1
  return $rc
}

if [[ $SMOKE == 1 ]]; then
  DEV=(--device cpu --dtype bfloat16); DEMO_STEPS=3; BIG_STEPS=2
  BIG=(--max-new-tokens 16 --batch-size 2 --n-samples 2); LMHEAD=(--smoke)
  # The GPU machine has no vLLM, datasets or math-verify: the smoke run proves the CLI path needs none.
  export PYTHONPATH="$PWD/scripts/gpu_check_blocked${PYTHONPATH:+:$PYTHONPATH}"
else
  DEV=(--device cuda --dtype bfloat16); DEMO_STEPS=20; BIG_STEPS=2
  BIG=(--max-new-tokens 1024 --batch-size 4 --n-samples 4); LMHEAD=(--device cuda --repeats 3)
fi
: >"$OUTDIR/steps.jsonl"

# 0. the Qwen3-0.6B-shaped random model (tiny on CPU), its prompts and reward plugin
step build 35 "$PY" scripts/gpu_check_cli.py build "$WORK/big" $([[ $SMOKE == 1 ]] && echo --cpu-smoke) \
  >"$OUTDIR/build.log" 2>&1 || { echo "FAIL build (see build.log)"; tail -5 "$OUTDIR/build.log"; }

# 1. attention kernels and the transformers engine's peak memory at 1024 new tokens
step engine 100 "$PY" scripts/gpu_check.py --model-dir "$WORK/big/model" --out "$OUTDIR/gpu_check.txt" \
  $([[ $SMOKE == 1 ]] && echo --cpu-smoke)

# 2. the real CLI, default strategy, transformers engine, bf16
{
  status=0  # this block's own verdict (it runs in a subshell, under tee)
  echo "areno gpu_check: the CLI ($([[ $SMOKE == 1 ]] && echo 'CPU smoke' || echo GPU))"
  step cli_demo 35 "${AR[@]}" train "${DEV[@]}" --rollout-engine hf --max-steps $DEMO_STEPS --no-save \
      --output-dir "$OUTDIR/runs/demo" >"$OUTDIR/runs/demo.log" 2>&1
  "$PY" scripts/gpu_check_cli.py summary "$OUTDIR/runs/demo" --title "demo, bf16, hf engine" \
      --log "$OUTDIR/runs/demo.log" --steps $DEMO_STEPS --json "$OUTDIR/cli_demo.json" \
    || { echo "FAIL demo run (see runs/demo.log)"; tail -5 "$OUTDIR/runs/demo.log"; status=1; }
  # qwen_run NAME LIMIT_S LORA_RANK: the Qwen3-0.6B shape, full fine-tuning (0) or LoRA
  qwen_run() {
    step "cli_$1" "$2" "${AR[@]}" train "${DEV[@]}" --rollout-engine hf --ckpt "$WORK/big/model" \
        --lora-rank "$3" --dataset-path "$WORK/big/prompts.jsonl" --reward-fn-path "$WORK/big/reward.py" \
        --no-chat-template --max-steps $BIG_STEPS "${BIG[@]}" --no-save \
        --output-dir "$OUTDIR/runs/$1" >"$OUTDIR/runs/$1.log" 2>&1
    "$PY" scripts/gpu_check_cli.py summary "$OUTDIR/runs/$1" --title "$1: Qwen3-0.6B shape, bf16, hf engine" \
        --log "$OUTDIR/runs/$1.log" --steps $BIG_STEPS --json "$OUTDIR/cli_$1.json" \
      || { echo "FAIL $1 run (see runs/$1.log)"; tail -5 "$OUTDIR/runs/$1.log"; status=1; }
  }
  qwen_run qwen3 110 0
  qwen_run qwen3_lora8 90 8  # issue 19: only the adapter trains and syncs
  [[ $status == 0 ]] && echo "CLI: ALL PASS"
} 2>&1 | tee "$OUTDIR/cli.txt"
grep -q "CLI: ALL PASS" "$OUTDIR/cli.txt" || status=1

# 3. lm_head backward, bf16 (now) vs fp32 (before issue 17 2c): scripts/bench_lm_head.py
step lm_head 45 "$PY" scripts/bench_lm_head.py "${LMHEAD[@]}" --out "$OUTDIR/lm_head.json" \
  >"$OUTDIR/lm_head.txt" 2>&1 || { echo "FAIL lm_head bench (see lm_head.txt)"; tail -5 "$OUTDIR/lm_head.txt"; }

exit $status
