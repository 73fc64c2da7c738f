"""Long chain-of-thought host path benchmark (synthetic engine, the real loop):
`python scripts/bench_longcot.py --help`, or `PYTHONPATH=scripts python -m arenobench.longcot.cli`.
The code is scripts/arenobench/longcot/; areno must be importable (installed, or PYTHONPATH=.)."""

import sys

from arenobench.longcot.cli import main

if __name__ == "__main__":
    sys.exit(main())
