"""bench_longcot: the long chain-of-thought host path on the real loop (cli.py
says what is measured; run.py, sim.py, ranks.py, ref.py, report.py the parts)."""
