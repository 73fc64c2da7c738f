"""Stand-in that gpu_check.sh --cpu-smoke puts first on PYTHONPATH: the GPU machine
has no datasets, so the CLI path gpu_check runs must not need it."""

raise ImportError("datasets is blocked by gpu_check.sh --cpu-smoke (the GPU machine does not have it)")
