"""The benchmarks' code: shared helpers (lib.py), the list-based reference
(listref.py), and each benchmark that tests or other code import. The files
in scripts/ are their entry points (`python scripts/bench_x.py`, or
`python -m areno.bench.x`); nothing in a training run imports this package."""
