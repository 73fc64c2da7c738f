"""AgentHost: what the agent driver needs around it in the process that drives
the engines: the agent's workers (the reward pool, kind "agent"), the gateway
server, the chat renderer and the tool parser, made once for the whole run.
Colocated that is the controller (run.py); under split placement each engine
process (AgentEpisodes, at its first `episodes` command: EngineWorker.cmd_episodes)."""

from __future__ import annotations

from typing import Any

import numpy as np

from areno.data.tokenizer import load_tokenizer
from areno.envs.driver import EnvBounds, EpisodeSpec
from areno.envs.plugin import EnvState
from areno.envs.pool import EnvPool
from areno.gateway.app import GatewayServer
from areno.gateway.conversation import ChatRenderer
from areno.gateway.driver import AgentRollout, rollout_agents
from areno.gateway.tools import ToolCallParser
from areno.rewards.pool import RewardScorer
from areno.rollout.engine import SamplingConfig


class AgentHost:
    """The agents of a run: path, workers, timeout and on_error as a reward plugin's."""

    def __init__(self, path: str, tokenizer: Any, *, workers: int, timeout: float, on_error: str,
                 tool_parser: str = "hermes", concurrency: int = 1, reward_fn_path: str | None = None) -> None:
        self.renderer = ChatRenderer(tokenizer)  # no chat template: ValueError before anything starts
        self.parser = ToolCallParser(tool_parser, tokenizer)
        self.parser.check()
        self.scorer: RewardScorer | None = None  # --reward-fn-path: scores the runs whose agent returns None
        self.server: GatewayServer | None = None
        self.pool = EnvPool(path, workers=workers, timeout=timeout, on_error=on_error, kind="agent",
                            concurrency=concurrency)
        try:
            if reward_fn_path is not None:
                self.scorer = RewardScorer(reward_fn_path, workers=workers, timeout=timeout,
                                           on_error=on_error)  # type: ignore[arg-type]
            self.server = GatewayServer()
        except BaseException:
            self.close()
            raise

    @classmethod
    def for_spec(cls, spec: EpisodeSpec, tokenizer: Any, tool_parser: str) -> "AgentHost":
        return cls(spec.env_path, tokenizer, workers=spec.workers, timeout=spec.timeout,
                   on_error=spec.on_error, tool_parser=tool_parser, concurrency=spec.concurrency,
                   reward_fn_path=spec.reward_fn_path)

    def run(self, engine: Any, states: list[EnvState], n: int, sampling: SamplingConfig,
            bounds: EnvBounds) -> AgentRollout:
        return rollout_agents(engine, self.pool, self.server, self.renderer, self.parser, states, n,
                              sampling, bounds, self.scorer)

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
        if self.scorer is not None:
            self.scorer.close()
        self.pool.close()

    def __enter__(self) -> "AgentHost":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AgentEpisodes:
    """envs.driver.EpisodeHost's counterpart for agents: the AgentHost of an engine
    process (its workers, its own gateway on localhost, the renderer and tool
    parser), made at the first `episodes` command and kept for the next ones
    (a new spec makes a new one). The prompts the controller sent are not used:
    an agent's conversation is its prompt (the rollout's batch carries it)."""

    def __init__(self) -> None:
        self.spec: EpisodeSpec | None = None
        self.host: AgentHost | None = None

    def run(self, engine: Any, spec: EpisodeSpec, ids: np.ndarray, offsets: np.ndarray,
            states: list[EnvState], n: int, sampling: SamplingConfig) -> AgentRollout:
        if spec != self.spec:
            self.close()
            self.host = AgentHost.for_spec(spec, load_tokenizer(spec.tokenizer_path), spec.tool_parser)
            self.spec = spec
        return self.host.run(engine, states, n, sampling, spec.bounds)

    def close(self) -> None:
        if self.host is not None:
            self.host.close()
        self.host = self.spec = None
