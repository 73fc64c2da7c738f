"""The engines and their sync, apart from the training backend: an engine inside
a rank (engine_host.py) or in an engine process of its own (engine_proc.py,
started and held by engine_procs.py), the loop's view of them wherever they live
(engines.py), and how the trainer's weights or LoRA adapter reach them with the
exact check (weight_sync.py, adapter_sync.py). Below backend/: a rank hosts an
engine, and the ranks publish the weights the engine processes load."""
