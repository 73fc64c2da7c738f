"""lm_head backward in bf16 against fp32:
`python scripts/bench_lm_head.py --help`, or `PYTHONPATH=scripts python -m arenobench.lm_head`.
The code is scripts/arenobench/lm_head.py; areno must be importable (installed, or PYTHONPATH=.)."""

from arenobench.lm_head import main

if __name__ == "__main__":
    main()
