"""Dynamic sampling on the demo (issue 27, 3): reward against steps and against
generated tokens, with and without --dynamic-sampling, in one PNG. The reward is
sampling/reward_generated, every generated sample's: with dynamic sampling
reward/mean is the kept groups', which leave out the all-right ones.

    PYTHONPATH=. python scripts/bench_dynsample.py --steps 600 --out runs/dynsample

Each mode is one seeded `areno train` run of the embedded demo (16 prompts x 8
samples a step). Generated tokens per step are sampling/gen_tokens_per_kept_group
x sampling/groups_kept: every round's response tokens, the dropped groups' too.
Prints, per mode: the step and the generated tokens at which the 20-step mean
of that reward first reaches 0.9, the last 20 steps' mean, the tokens generated in all and
the mean rounds per step."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

MODES = {"off": [], "dynamic-sampling reward": ["--dynamic-sampling", "reward"]}
WINDOW = 20


def run(out: Path, steps: int, seed: int, extra: list[str]) -> list[dict]:
    if not (out / "metrics.jsonl").is_file():
        subprocess.run([sys.executable, "-m", "areno.cli", "train", "--max-steps", str(steps),
                        "--seed", str(seed), "--no-save", "--log-completions", "0",
                        "--output-dir", str(out), *extra], check=True, stdout=subprocess.DEVNULL)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "reward/mean" in r]


def rolling(x: np.ndarray, w: int = WINDOW) -> np.ndarray:
    c = np.cumsum(np.insert(x, 0, 0.0))
    n = np.minimum(np.arange(1, x.size + 1), w)
    return (c[1:] - c[np.maximum(np.arange(1, x.size + 1) - w, 0)]) / n


def summary(rows: list[dict]) -> dict[str, float]:
    reward = rolling(np.array([r["sampling/reward_generated"] for r in rows]))
    tokens = np.cumsum([r["sampling/gen_tokens_per_kept_group"] * r["sampling/groups_kept"] for r in rows])
    hit = np.flatnonzero(reward >= 0.9)
    return {"step_to_0.9": float(hit[0] + 1) if hit.size else float("nan"),
            "tokens_to_0.9": float(tokens[hit[0]]) if hit.size else float("nan"),
            "last20_reward": float(np.mean([r["sampling/reward_generated"] for r in rows[-WINDOW:]])),
            "tokens_total": float(tokens[-1]),
            "rounds_mean": float(np.mean([r["sampling/rounds"] for r in rows])),
            "bound_hits": float(sum(r["sampling/bound_hit"] for r in rows))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("runs/dynsample"))
    args = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_step, by_tokens) = plt.subplots(1, 2, figsize=(11, 4))
    for name, extra in MODES.items():
        rows = run(args.out / name.split()[0], args.steps, args.seed, extra)
        reward = rolling(np.array([r["sampling/reward_generated"] for r in rows]))
        tokens = np.cumsum([r["sampling/gen_tokens_per_kept_group"] * r["sampling/groups_kept"]
                            for r in rows])
        by_step.plot(np.arange(1, len(rows) + 1), reward, label=name)
        by_tokens.plot(tokens, reward, label=name)
        print(name, json.dumps(summary(rows)))
    for ax, xlabel in ((by_step, "step"), (by_tokens, "generated response tokens")):
        ax.set_xlabel(xlabel)
        ax.set_ylabel(f"sampling/reward_generated ({WINDOW}-step mean)")
        ax.axhline(0.9, color="grey", lw=0.5)
        ax.legend()
    fig.suptitle(f"demo, seed {args.seed}: dynamic sampling against steps and generated tokens")
    fig.tight_layout()
    png = args.out / "dynsample.png"
    fig.savefig(png, dpi=100)
    print(f"wrote {png}")


if __name__ == "__main__":
    main()
