"""Long chain-of-thought host path benchmark (synthetic engine, the real loop):
`python scripts/bench_longcot.py --help`, or `python -m areno.bench.longcot.cli`.
The code is areno/bench/longcot/; areno must be importable (installed, or PYTHONPATH=.)."""

import sys

from areno.bench.longcot.cli import main

if __name__ == "__main__":
    sys.exit(main())
