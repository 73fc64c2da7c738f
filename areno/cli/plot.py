"""`areno plot RUN_DIR`: a PNG of the run's metrics.jsonl (matplotlib).

Six panels: reward, response length, held-out eval (when the run has eval
records), KL, clip fraction, seconds per phase. KL and clip fraction get a
panel each: on one axis the larger hides the other. The phase panel is scaled
to the steady steps: the first step's warm-up (compilation, cache allocation)
would otherwise flatten everything after it, so it is drawn off scale and its
value written in the panel.
"""

from __future__ import annotations

from pathlib import Path

from areno.errors import UserError
from areno.rundir.reporting import PHASES, read_metrics

FIGSIZE = (15, 8)
DPI = 100
HEADROOM = 1.15  # y-limit of the phase panel over the steady steps' maximum


def _series(records: list[dict], key: str) -> tuple[list[float], list[float]]:
    pts = [(r["step"], r[key]) for r in records if key in r and "step" in r]
    return [p[0] for p in pts], [p[1] for p in pts]


def plot_run(run_dir: str | Path, out: str | Path | None = None):
    """Write <run_dir>/metrics.png (or `out`); returns (path, figure)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise UserError(f"areno plot: no metrics.jsonl in {run_dir}")
    every = read_metrics(path)
    records = [r for r in every if "reward/mean" in r]
    if not records:
        raise UserError(f"areno plot: {path} has no training steps yet")
    evals = [r for r in every if "eval/pass@1" in r]
    fig, axes = plt.subplots(2, 3, figsize=FIGSIZE, dpi=DPI)
    ax = axes[0, 0]
    ax.plot(*_series(records, "reward/mean"), label="reward")
    if any("reward/accuracy" in r for r in records):
        ax.plot(*_series(records, "reward/accuracy"), label="accuracy")
    if evals:
        ax.plot(*_series(evals, "eval/pass@1"), "o--", label="eval pass@1")
    ax.set_title("reward")
    ax = axes[0, 1]
    ax.plot(*_series(records, "response/len_mean"), label="mean")
    ax.plot(*_series(records, "response/len_max"), label="max")
    ax.set_title("response length (tokens)")
    _eval_panel(axes[0, 2], evals)
    _one(axes[1, 0], records, "train/kl", "KL")
    _one(axes[1, 1], records, "train/clip_frac", "clip fraction")
    _phase_panel(axes[1, 2], records)
    for a in axes.flat:
        if a.get_lines():
            a.set_xlabel("step")
            a.grid(alpha=0.3)
            a.legend()
    fig.tight_layout()
    out = Path(out) if out else run_dir / "metrics.png"
    fig.savefig(out)
    plt.close(fig)
    return out, fig


def _one(ax, records: list[dict], key: str, title: str) -> None:
    ax.plot(*_series(records, key), label=title.lower())
    ax.set_title(title)


def _eval_panel(ax, evals: list[dict]) -> None:
    """Every eval/* score (pass@1, reward@1, mean@k, pass@k); hidden without evals."""
    keys = sorted({k for r in evals for k in r if k.startswith("eval/") and k != "eval/prompts"})
    if not keys:
        ax.axis("off")
        return
    for key in keys:
        ax.plot(*_series(evals, key), "o-", label=key.split("/", 1)[1])
    ax.set_title("eval (held-out)")


def _phase_panel(ax, records: list[dict]) -> None:
    keys = [f"time/{p}" for p in PHASES if any(f"time/{p}" in r for r in records)]
    for key in keys:
        ax.plot(*_series(records, key), label=key.split("/", 1)[1])
    ax.set_title("seconds per phase")
    steady = [r.get(k, 0.0) for r in records[1:] for k in keys]
    first = max((records[0].get(k, 0.0) for k in keys), default=0.0)
    if steady and max(steady) > 0:
        top = HEADROOM * max(steady)
        ax.set_ylim(0, top)
        if first > top:
            ax.text(0.02, 0.95, f"step {records[0]['step']}: {first:.2f} s (off scale)",
                    transform=ax.transAxes, va="top", fontsize=8)
