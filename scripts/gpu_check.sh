#!/usr/bin/env bash
# GPU check on one NVIDIA GPU (torch + transformers; no vLLM, datasets or
# math-verify; no network), in one device call: every step runs under
# `timeout --kill-after`, and the limits below add up to at most 450 s.
# Everything lands in $OUT (or ./gpu_check_out):
#   steps.jsonl        one line per step: name, exit code, seconds, its limit
#   gpu_check.txt/.json  attention kernels (packed == padded) and the transformers
#                      engine's peak memory at 1024 new tokens (scripts/gpu_check.py)
#   cli.txt, cli_*.json  the real CLI on the default path (`areno train`, default
#                      strategy, one GPU, bf16, transformers engine): the demo, with an
#                      eval at its end; the demo in split placement on the one GPU (a rank
#                      and an engine process sharing device 0: ARENO_ENGINE_GPUS=0), K = 0,
#                      and K = 1 saved at its end, then resumed for 2 more steps (its
#                      rollouts in flight come back from the checkpoint); the multi-turn
#                      environment examples/guess; then the Qwen3-0.6B-shaped model, full
#                      fine-tuning with the trainer's old log-probs (the bf16 default), with
#                      --grad-checkpointing and the sampler's (recompute_logprobs: false: step
#                      1's K = 0 ratio figures against the default's, docs/PERFORMANCE.md;
#                      its peak memory against the run without) and LoRA r=8 (issue 19);
#                      phases, peak memory per train phase, the run's own weight-sync verdict
#   lm_head.txt/.json  lm_head backward in bf16 vs fp32 (scripts/bench_lm_head.py)
#   gpu_check_table.md   one table of every step (scripts/gpu_check_cli.py table)
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
# its exit code and seconds appended to steps.jsonl and one line on the script's stderr
# (fd 3: a step's own output may be redirected into its log).
exec 3>&2
# GPU limits: 20+70+30+30+30+25+30+50+50+40+20 (+5 each) = 450 s.
step() {
  local name=$1 limit=$(($2 * SCALE)); shift 2
  local t0=$SECONDS rc=0
  timeout --signal=TERM --kill-after=$KILL_AFTER "$limit" "$@" || rc=$?
  printf '{"step": "%s", "rc": %d, "seconds": %d, "limit_s": %d}\n' \
    "$name" "$rc" $((SECONDS - t0)) "$limit" >>"$OUTDIR/steps.jsonl"
  printf 'step %-18s %s  %3d s of %d s\n' "$name" "$([[ $rc == 0 ]] && echo ok || echo "FAIL rc $rc")" \
    $((SECONDS - t0)) "$limit" >&3
  [[ $rc == 0 ]] || status=1
  return $rc
}

if [[ $SMOKE == 1 ]]; then
  DEV=(--device cpu --dtype bfloat16); DEMO_STEPS=3; SPLIT_STEPS=3; BIG_STEPS=2; ENV_STEPS=2
  BIG=(--max-new-tokens 16 --batch-size 2 --n-samples 2); LMHEAD=(--smoke)
  # The GPU machine has no vLLM, datasets or math-verify: the smoke run proves the CLI path needs none.
  export PYTHONPATH="$PWD/scripts/gpu_check_blocked${PYTHONPATH:+:$PYTHONPATH}"
else
  DEV=(--device cuda --dtype bfloat16); DEMO_STEPS=20; SPLIT_STEPS=8; BIG_STEPS=2; ENV_STEPS=6
  # 512 new tokens (the engine step measures 1024): three runs of this shape fit the 450 s
  BIG=(--max-new-tokens 512 --batch-size 4 --n-samples 4); LMHEAD=(--device cuda --repeats 3)
fi
: >"$OUTDIR/steps.jsonl"

# 0. the Qwen3-0.6B-shaped random model (tiny on CPU), its prompts and reward plugin
step build 20 "$PY" scripts/gpu_check_cli.py build "$WORK/big" $([[ $SMOKE == 1 ]] && echo --cpu-smoke) \
  >"$OUTDIR/build.log" 2>&1 || { echo "FAIL build (see build.log)"; tail -5 "$OUTDIR/build.log"; }

# 1. attention kernels and the transformers engine's peak memory at 1024 new tokens
step engine 70 "$PY" scripts/gpu_check.py --model-dir "$WORK/big/model" --out "$OUTDIR/gpu_check.txt" \
  $([[ $SMOKE == 1 ]] && echo --cpu-smoke)

# 2. the real CLI, default strategy, transformers engine, bf16
{
  status=0  # this block's own verdict (it runs in a subshell, under tee)
  echo "areno gpu_check: the CLI ($([[ $SMOKE == 1 ]] && echo 'CPU smoke' || echo GPU))"
  # demo_run NAME LIMIT_S STEPS TITLE [FLAGS...]: the demo model and task (--no-save unless FLAGS save)
  demo_run() {
    local name=$1 limit=$2 n=$3 title=$4; shift 4
    step "cli_$name" "$limit" "${AR[@]}" train "${DEV[@]}" --rollout-engine hf --max-steps "$n" \
        "$@" --output-dir "$OUTDIR/runs/$name" >"$OUTDIR/runs/$name.log" 2>&1
    summarise "$name" "$n" "$title"
  }
  # summarise NAME STEPS TITLE: the run's figures into cli_NAME.json (runs/NAME, its log runs/NAME.log)
  summarise() {
    "$PY" scripts/gpu_check_cli.py summary "$OUTDIR/runs/$1" --title "$3" \
        --log "$OUTDIR/runs/$1.log" --steps "$2" --json "$OUTDIR/cli_$1.json" \
      || { echo "FAIL $1 run (see runs/$1.log)"; tail -5 "$OUTDIR/runs/$1.log"; status=1; }
  }
  demo_run demo 30 $DEMO_STEPS "demo, bf16, hf engine, eval at the end" --no-save \
      --eval-dataset-path "$WORK/big/demo_eval.jsonl" --eval-interval $DEMO_STEPS
  # Split placement on one GPU: rank 0 and engine process 1 share device 0 (ARENO_ENGINE_GPUS=0;
  # the engine process sees only it), weights through the shared-memory region each step.
  # The transformers engine has no memory fraction: both processes allocate as they go.
  export ARENO_ENGINE_GPUS=0
  demo_run split 30 $SPLIT_STEPS "demo, split placement on one GPU (1 rank + 1 engine process), K = 0" \
      --no-save --world-size 1 --rollout-world-size 1
  demo_run split_k1 30 $SPLIT_STEPS "demo, split placement on one GPU, K = 1 (decoupled PPO), saved" \
      --world-size 1 --rollout-world-size 1 --off-policy-steps 1
  # The saved K = 1 run resumed for 2 more steps: weights, optimizer and its rollout in flight
  # come back from the checkpoint (the same run dir: metrics.jsonl goes on from step SPLIT_STEPS + 1).
  step cli_resume 25 "${AR[@]}" train --resume latest --output-dir "$OUTDIR/runs/split_k1" \
      --max-steps $((SPLIT_STEPS + 2)) --no-save >"$OUTDIR/runs/resume.log" 2>&1
  cp -r "$OUTDIR/runs/split_k1" "$OUTDIR/runs/resume"
  summarise resume $((SPLIT_STEPS + 2)) "demo, split placement K = 1, resumed at step $SPLIT_STEPS for 2 steps"
  unset ARENO_ENGINE_GPUS
  # A multi-turn environment (two turns: the env answers the first guess), colocated, K = 0.
  demo_run env 30 $ENV_STEPS "multi-turn env examples/guess, hf engine" --no-save \
      --env-path examples/guess/env.py --max-turns 2 --reward-workers 0
  # qwen_run NAME LIMIT_S LORA_RANK [FLAGS...]: the Qwen3-0.6B shape, full fine-tuning (0) or LoRA
  qwen_run() {
    local name=$1 limit=$2 rank=$3; shift 3
    step "cli_$name" "$limit" "${AR[@]}" train "${DEV[@]}" --rollout-engine hf --ckpt "$WORK/big/model" \
        --lora-rank "$rank" --dataset-path "$WORK/big/prompts.jsonl" --reward-fn-path "$WORK/big/reward.py" \
        --no-chat-template --max-steps $BIG_STEPS "${BIG[@]}" --no-save "$@" \
        --output-dir "$OUTDIR/runs/$name" >"$OUTDIR/runs/$name.log" 2>&1
    summarise "$name" $BIG_STEPS "$name: Qwen3-0.6B shape, bf16, hf engine"
  }
  qwen_run qwen3 50 0  # old log-probs: the trainer's (the bf16 default)
  # Peak memory against qwen3's, and the sampler's old log-probs: step 1's ratio against qwen3's (the table)
  qwen_run qwen3_ckpt 50 0 --grad-checkpointing --config "$WORK/big/sampler_logprobs.yaml"
  qwen_run qwen3_lora8 40 8  # issue 19: only the adapter trains and syncs
  [[ $status == 0 ]] && echo "CLI: ALL PASS"
} 2>&1 | tee "$OUTDIR/cli.txt"
grep -q "CLI: ALL PASS" "$OUTDIR/cli.txt" || status=1

# 3. lm_head backward, bf16 (now) vs fp32 (before issue 17 2c): scripts/bench_lm_head.py
step lm_head 20 "$PY" scripts/bench_lm_head.py "${LMHEAD[@]}" --out "$OUTDIR/lm_head.json" \
  >"$OUTDIR/lm_head.txt" 2>&1 || { echo "FAIL lm_head bench (see lm_head.txt)"; tail -5 "$OUTDIR/lm_head.txt"; }

# 4. one table of every step, its run's figures and the grad-checkpointing memory ratio
"$PY" scripts/gpu_check_cli.py table "$OUTDIR" --out "$OUTDIR/gpu_check_table.md" || status=1

exit $status
