"""What a run shows and writes: a rich progress bar, one line of metrics per
step, `metrics.jsonl` in the run directory, and optionally TensorBoard / W&B."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, \
    TimeRemainingColumn

from areno.rundir.completions import FILE as COMPLETIONS_FILE
from areno.metrics import WAIT_PHASES

# The per-step line: the key figures in at most LINE_LIMIT characters (README:
# "one line per step"); every metric, phase times included, goes to metrics.jsonl.
LINE_LIMIT = 120
# time/<phase> keys `areno plot` draws; the asynchronous loop's waits are metrics.WAIT_PHASES.
PHASES: tuple[str, ...] = ("rollout", "decode", "reward", "materialize", "train", "weight_sync",
                           *WAIT_PHASES)
# (metric key, console label, format) of the update's figures; shown only for a
# step that took an optimizer step (else they are all 0 and say nothing).
TRAIN_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("train/kl", "kl", "{:.3g}"),
    ("train/clip_frac", "clip", "{:.3f}"),
    ("train/grad_norm", "gnorm", "{:.3g}"),
    ("train/lr", "lr", "{:.1e}"),
)


def limit_note(total: int, max_steps: int, epochs: int, num_prompts: int, batch_size: int) -> str:
    """'' or why the run has fewer steps than --max-steps asked for (the epochs
    end first), for the run's first line and its interrupt line."""
    if not max_steps or total >= max_steps:
        return ""
    return (f"--epochs {epochs} over {num_prompts} prompts at {batch_size} per step ends "
            f"before --max-steps {max_steps}")


def _fmt(fmt: str, v: Any) -> str:
    if isinstance(v, float) and not math.isfinite(v):
        return "nan"
    return fmt.format(v)


def format_step_line(step: int, total: int, m: dict[str, float], show_kl: bool = True) -> str:
    """One line of at most LINE_LIMIT characters (for realistic values): reward,
    accuracy, length, the update's KL / clip / grad norm / LR (when it made one;
    KL only with show_kl, i.e. a reference model), step time and throughput, and
    the failed rewards whenever there are any."""
    g = m.get
    parts = [f"step {step}/{total}",
             f"reward {_fmt('{:.3f}', g('reward/mean', 0.0))}±{_fmt('{:.3f}', g('reward/std', 0.0))}"
             + reward_failures(m), f"acc {_fmt('{:.2f}', g('reward/accuracy', 0.0))}"]
    mean_len = g("response/len_mean", 0.0)
    parts.append(f"len {_fmt('{:.0f}' if mean_len >= 100 else '{:.1f}', mean_len)}"
                 f"/{_fmt('{:.0f}', g('response/len_max', 0.0))}")
    if g("train/lr", 0.0) > 0:  # lr is > 0 in every optimizer step, 0 when none ran
        parts += [f"{label} {_fmt(fmt, m[key])}" for key, label, fmt in TRAIN_COLUMNS
                  if key in m and (show_kl or key != "train/kl")]
    else:
        parts.append(_no_update(m))
    # Least telling last: dropped, in this order, while the line is too long.
    extra = []
    if "time/step" in m:
        extra.append(f"{_fmt('{:.2f}' if m['time/step'] < 10 else '{:.0f}', m['time/step'])}s")
    if "time/wait_batch" in m:  # split placement: the side that waited for the other
        ranks, engines = m["time/wait_batch"], g("time/wait_weights", 0.0)
        extra.append(f"{'ranks' if ranks >= engines else 'engines'} idle "
                     f"{_fmt('{:.2f}', max(ranks, engines))}s")
    if "perf/tokens_per_s" in m:
        extra.append(f"{_fmt('{:.0f}', m['perf/tokens_per_s'])} tok/s")
    line = " ".join(parts + extra)
    while extra and len(line) > LINE_LIMIT:
        extra.pop()
        line = " ".join(parts + extra)
    return line


def _no_update(m: dict[str, float]) -> str:
    """"no update", and why when dynamic sampling kept no group."""
    if m.get("sampling/groups_kept") == 0 and "sampling/rounds" in m:
        n = int(m["sampling/rounds"])
        return f"no update: no informative group in {n} round{'s' * (n != 1)}"  # equal rewards in each
    return "no update"


SAMPLE_EVERY = 10  # a completion on the terminal at steps 1, 11, 21, ... (--log-completions)


def format_sample_line(rec: dict[str, Any]) -> str:
    """One completion record as one indented line of at most LINE_LIMIT characters:
    the prompt's end and the completion's start (quoted, newlines escaped), its
    reward, advantage and finish reason."""
    reward = "none" if rec["reward"] is None else f"{rec['reward']:.2f}"
    head = f"  sample of step {rec['step']}: "
    tail = f" reward {reward} adv {rec['advantage']:+.2f} {rec['finish_reason']}"
    room = max(LINE_LIMIT - len(head) - len(tail) - len('"" -> ""'), 20)
    prompt = json.dumps(rec["prompt"], ensure_ascii=False)[1:-1]
    completion = json.dumps(rec["completion"], ensure_ascii=False)[1:-1]
    p_room = min(len(prompt), max(room // 3, room - len(completion)))
    prompt = prompt if len(prompt) <= p_room else "…" + prompt[len(prompt) - p_room + 1:]
    c_room = room - len(prompt)
    completion = completion if len(completion) <= c_room else completion[:c_room - 1] + "…"
    return f'{head}"{prompt}" -> "{completion}"{tail}'


def reward_failures(m: dict[str, float]) -> str:
    """'' when every reward was scored; else ' (3/16 failed)', or a warning when
    none was valid (--on-reward-error zero|skip would hide it in the mean)."""
    failed = int(m.get("reward/skipped", 0) + m.get("reward/zeroed", 0))
    if not failed:
        return ""
    total = int(m.get("reward/valid", 0) + m.get("reward/skipped", 0))
    if failed >= total:
        return f" (WARN: all {total} failed)"
    return f" ({failed}/{total} failed)"


class RunConsole(Console):
    """The run's console: a closed stdout (`areno train | head -3`) stops the run
    as an interrupt does (saved, resume line on stderr: signals.stdout_closed),
    where rich would exit 1 with no word and no checkpoint."""

    def on_broken_pipe(self) -> None:
        from areno.procs.signals import stdout_closed

        self.quiet = True
        stdout_closed()


class RunLogger:
    """Context manager owning the progress bar and the metric sinks."""

    def __init__(self, output_dir: Path, total_steps: int, report_to: str = "none",
                 console: Console | None = None, config: dict | None = None,
                 start_step: int = 0, completions: bool = False) -> None:
        self.output_dir = Path(output_dir)
        self.completions_path = self.output_dir / COMPLETIONS_FILE if completions else None
        self._staged: list[dict[str, Any]] = []  # the current step's, written when it is logged
        self._completions = None
        self.total = total_steps
        self.console = console or RunConsole(stderr=False)
        self.metrics_path = self.output_dir / "metrics.jsonl"
        self._file = None
        self._tb = None
        self._wandb = None
        self.report_to = report_to
        self.config = config or {}
        # No reference model (kl_coef 0): train/kl is 0 by construction, not news.
        self.show_kl = bool(self.config.get("kl_coef", 0.0))
        self.progress = Progress(
            TextColumn("[bold]areno"), BarColumn(), MofNCompleteColumn(), TextColumn("steps"),
            TimeElapsedColumn(), TimeRemainingColumn(), console=self.console, transient=False,
        )
        self._task = None
        self.start_step = start_step
        if start_step:
            truncate_metrics(self.metrics_path, start_step)
            if self.completions_path is not None:
                truncate_metrics(self.completions_path, start_step)

    def __enter__(self) -> "RunLogger":
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self._file = open(self.metrics_path, "a", buffering=1)
        if self.completions_path is not None:
            self._completions = open(self.completions_path, "a", buffering=1)

        self._open_extra_sinks()
        self.progress.start()
        self._task = self.progress.add_task("train", total=self.total, completed=self.start_step)
        return self

    def _open_extra_sinks(self) -> None:
        if self.report_to == "tensorboard":
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(self.output_dir / "tensorboard"))
            except Exception as e:  # noqa: BLE001 - optional sink
                self.console.print(f"[yellow]WARN[/] TensorBoard not available ({e}); "
                                   "logging to metrics.jsonl only")
        elif self.report_to == "wandb":
            try:
                import wandb

                self._wandb = wandb.init(project="areno", dir=str(self.output_dir),
                                         config=self.config)
            except Exception as e:  # noqa: BLE001 - optional sink
                self.console.print(f"[yellow]WARN[/] W&B not available ({e}); "
                                   "logging to metrics.jsonl only")

    def info(self, text: str) -> None:
        # soft_wrap: rich would hard-wrap at 80 columns when not on a terminal.
        self.progress.console.print(text, highlight=False, markup=False, soft_wrap=True)

    def log(self, step: int, metrics: dict[str, float], *, advance: bool = True) -> None:
        assert self._file is not None
        self._file.write(jsonl_line({"step": step, **metrics}))
        if self._tb is not None:
            for k, v in metrics.items():
                self._tb.add_scalar(k, v, step)
        if self._wandb is not None:
            self._wandb.log(metrics, step=step)
        if advance:
            self.info(format_step_line(step, self.total, metrics, self.show_kl))
            self.progress.update(self._task, completed=step)
            self._write_completions(step)

    def stage_completions(self, records: list[dict[str, Any]]) -> None:
        """The step's sampled completions (areno/rundir/completions.py), written when the
        step is logged: a step an interrupt undoes leaves none behind."""
        self._staged = records

    def _write_completions(self, step: int) -> None:
        staged, self._staged = self._staged, []
        if self._completions is None or not staged:
            return
        self._completions.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in staged))
        if (step - 1) % SAMPLE_EVERY == 0:
            self.info(format_sample_line(staged[0]))

    def __exit__(self, *exc: Any) -> None:
        self.progress.stop()
        if self._file:
            self._file.close()
        if self._completions:
            self._completions.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def jsonl_line(record: dict[str, Any]) -> str:
    """A metrics.jsonl line: JSON has no NaN or Infinity (README: "all finite
    floats"), so a non-finite value is left out of the record; the step line
    still shows it as nan. The one writer of metrics.jsonl."""
    finite = {k: v for k, v in record.items() if not (isinstance(v, float) and not math.isfinite(v))}
    return json.dumps(finite, allow_nan=False) + "\n"


def truncate_metrics(path: Path, last_step: int) -> None:
    """Drop records after `last_step` (a resumed run redoes those steps)."""
    if not path.is_file():
        return
    keep = [r for r in read_metrics(path) if r.get("step", 0) <= last_step]
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(jsonl_line(r) for r in keep))
    tmp.replace(path)


def read_metrics(path: str | Path) -> list[dict]:
    """Every record of a metrics.jsonl. A last line cut short (the trainer was
    killed mid-write) is dropped; a bad line anywhere else is a UserError."""
    from areno.errors import UserError

    text = Path(path).read_text()
    lines = text.split("\n")
    out = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except ValueError:
            if i == len(lines) - 1:  # no newline after it: an unfinished write
                break
            raise UserError(f"{path}: line {i + 1} is not a JSON object") from None
    return out
