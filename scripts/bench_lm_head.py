"""lm_head backward in bf16 against fp32:
`python scripts/bench_lm_head.py --help`, or `python -m areno.bench.lm_head`.
The code is areno/bench/lm_head.py; areno must be importable (installed, or PYTHONPATH=.)."""

from areno.bench.lm_head import main

if __name__ == "__main__":
    main()
