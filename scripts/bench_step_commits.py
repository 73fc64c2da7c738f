"""The real model's step for two commits, phase by phase, interleaved:
`python scripts/bench_step_commits.py --help`. The code is scripts/arenobench/step_commits.py;
areno must be importable (installed, or PYTHONPATH=.)."""

from arenobench.step_commits import main

if __name__ == "__main__":
    main()
