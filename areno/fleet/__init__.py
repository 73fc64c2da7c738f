"""The engines beside the ranks, on the peer's side: building an engine inside a
rank or an engine process and generating into the controller's shared memory
(engine_host.py), and how the trainer's weights or LoRA adapter reach it with
the exact check (weight_sync.py, adapter_sync.py). Below backend/: a rank hosts
an engine; the engine processes and the loop's view of the engines
(backend/engine_proc.py, backend/rank_engines.py) are built on the ranks'
processes and sit in backend/."""
