"""RankEngines: the engines inside the ranks (fleet/engine_host.py) as the loop
sees them (fleet/engines.py's PeerEngines): `world_size // tensor_parallel_size`
groups of consecutive ranks, the first of each its leader. Each rank sleeps its
own engine while it trains (RankWorker.cmd_train); `sync_weights` has every rank
load the trained weights into its engine, on its device, checked (weight_sync.py).
Split placement's engine processes are fleet/engine_procs.py's (ProcEngines)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from areno.fleet.engines import PeerEngines

if TYPE_CHECKING:
    from areno.backend.controller import TorchBackend


class RankEngines(PeerEngines):
    """EngineView over the backend's colocated engines."""

    def __init__(self, backend: "TorchBackend", tensor_parallel_size: int = 1) -> None:
        tp = tensor_parallel_size
        groups = [list(range(g * tp, (g + 1) * tp)) for g in range(backend.world_size // tp)]
        super().__init__(backend, groups, backend.hellos, backend.vocab_size)
        self.backend = backend

    def sync_weights(self) -> dict[str, float]:
        """Each rank loads its own engine (the in-process transport), checked."""
        return self.backend.sync_weights()
