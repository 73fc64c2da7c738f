"""`areno plot RUN_DIR`: a PNG of the run's metrics.jsonl (matplotlib)."""

from __future__ import annotations

from pathlib import Path

from areno.errors import UserError
from areno.reporting import PHASES, read_metrics

FIGSIZE = (12, 8)
DPI = 100


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
    records = [r for r in read_metrics(path) if "reward/mean" in r]
    if not records:
        raise UserError(f"areno plot: {path} has no training steps yet")
    fig, axes = plt.subplots(2, 2, figsize=FIGSIZE, dpi=DPI)
    ax = axes[0, 0]
    ax.plot(*_series(records, "reward/mean"), label="reward")
    if any("reward/accuracy" in r for r in records):
        ax.plot(*_series(records, "reward/accuracy"), label="accuracy")
    evals = [r for r in read_metrics(path) if "eval/pass@1" in r]
    if evals:
        ax.plot(*_series(evals, "eval/pass@1"), "o--", label="eval pass@1")
    ax.set_title("reward")
    ax.legend()
    ax = axes[0, 1]
    ax.plot(*_series(records, "response/len_mean"), label="mean")
    ax.plot(*_series(records, "response/len_max"), label="max")
    ax.set_title("response length (tokens)")
    ax.legend()
    ax = axes[1, 0]
    ax.plot(*_series(records, "train/kl"), label="kl")
    ax.plot(*_series(records, "train/clip_frac"), label="clip fraction")
    ax.set_title("KL / clip fraction")
    ax.legend()
    ax = axes[1, 1]
    for phase in PHASES:
        key = f"time/{phase}"
        if any(key in r for r in records):
            ax.plot(*_series(records, key), label=phase)
    ax.set_title("seconds per phase")
    ax.legend()
    for a in axes.flat:
        a.set_xlabel("step")
        a.grid(alpha=0.3)
    fig.tight_layout()
    out = Path(out) if out else run_dir / "metrics.png"
    fig.savefig(out)
    plt.close(fig)
    return out, fig
