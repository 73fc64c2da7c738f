"""OpenAI clients for agent runs, one connection pool per worker process.

Making an `openai.OpenAI` costs ~50 ms of CPU (its httpx client, its
settings); an agent that makes one per run spends more time there than the
engine spends generating its turns. `task.client()` instead copies one cached
client per worker with the run's own base URL and key (`with_options`: the
copy shares the connection pool, ~20 us), so connections are kept alive
across runs. `max_retries=0`: a retry would re-send a turn the gateway has
already queued (a 409) instead of failing the run under --on-reward-error.
"""

from __future__ import annotations

import asyncio
from typing import Any

_sync: Any = None
_async: dict[int, tuple[Any, Any]] = {}  # id(event loop) -> (loop, client): an httpx pool is per loop


def sync_client(base_url: str, api_key: str) -> Any:
    """An `openai.OpenAI` for this run, over the worker's shared pool."""
    global _sync
    if _sync is None:
        from openai import OpenAI
        _sync = OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    return _sync.with_options(base_url=base_url, api_key=api_key)


def async_client(base_url: str, api_key: str) -> Any:
    """An `openai.AsyncOpenAI` for this run, over the pool of the running event
    loop (each worker runs its async runs on one loop: rewards/concurrent.py)."""
    loop = asyncio.get_running_loop()
    held = _async.get(id(loop))
    if held is None or held[0] is not loop:
        from openai import AsyncOpenAI
        held = _async[id(loop)] = (loop, AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0))
    return held[1].with_options(base_url=base_url, api_key=api_key)
