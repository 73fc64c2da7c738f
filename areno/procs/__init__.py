"""The process layer, torch-free: command pipes and reply streams (replies.py),
heartbeats, shared-memory segments, signals, stopping processes and process
titles (lifecycle.py), and claiming a device (torch imported inside the call).
The ranks (backend/) and the reward workers (rewards/) are built on it;
runtime/early.py spawns ranks before the controller has imported torch, so
nothing here imports torch at module level (tests/test_import_layers.py)."""
