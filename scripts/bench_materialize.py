"""Materialize benchmark: areno's array path against a list-based reference:
`python scripts/bench_materialize.py --help`, or `python -m areno.bench.materialize`.
The code is areno/bench/materialize.py; areno must be importable (installed, or PYTHONPATH=.)."""

import sys

from areno.bench.materialize import main

if __name__ == "__main__":
    sys.exit(main())
