"""The options of multi-turn environments (--env-path, --max-turns,
--max-trajectory-tokens, --env-reward, --env-schedule) and of agents through the
gateway (--agent-path, --agent-tool-parser: areno/gateway/), and their rules. TrainConfig inherits
the fields (one declaration, flags and YAML alike); the driver is
areno/envs/driver.py. No torch here: the config is read before anything heavy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from areno.errors import UserError

# Without --max-trajectory-tokens: as many observation tokens as sampled ones.
DEFAULT_OBSERVATION_SHARE = 2


def _opt(default: Any, help: str, *, ge: float | None = None, shown: str | None = None) -> Any:
    return field(default=default, metadata=dict(help=help, group="Rollout", ge=ge, gt=None, le=None,
                                                lt=None, shown=shown))


@dataclass
class EnvOptions:
    env_path: str | None = _opt(
        None, "Multi-turn environment: a .py file defining step(state, completion) -> "
        "(observation, reward, done) and optionally reset(state) (async allowed). Its rewards "
        "replace --reward-fn-path; it runs on the reward workers (--reward-workers, "
        "--reward-timeout, --on-reward-error).", shown="unset (single-turn)")
    max_turns: int = _opt(4, "Completions per trajectory under --env-path; a trajectory the "
                          "environment has not ended by then finishes as length (reward counted).", ge=1)
    max_trajectory_tokens: int = _opt(
        0, "Response tokens (sampled + observation) per trajectory under --env-path; one that "
        "reaches it finishes as length (reward counted). 0: 2 x --max-turns x --max-new-tokens.",
        ge=0, shown="0 (2 x max turns x max new tokens)")
    env_reward: Literal["sum", "last"] = _opt(
        "sum", "A trajectory's reward under --env-path: the sum of its steps' rewards, or the "
        "last step's.")
    agent_path: str | None = _opt(
        None, "Agent written against the OpenAI API: a .py file defining agent(task) -> reward "
        "(async allowed; or None, and --reward-fn-path scores the final conversation) that talks to "
        "task.base_url, an OpenAI-compatible endpoint the run serves "
        "from the policy; each call is one trajectory, trained token for token as sampled. Runs on "
        "the reward workers (--reward-workers runs at once, --reward-timeout per run, "
        "--on-reward-error); --max-turns and --max-trajectory-tokens bound it.", shown="unset")
    agent_tool_parser: str = _opt(
        "hermes", "vLLM's tool parser that reads tool calls out of the policy's turns under "
        "--agent-path when a request passes tools (hermes: <tool_call>{json}</tool_call>, as "
        "Qwen, Hermes and SmolLM2 write them); none: the text is the answer.")
    agent_concurrency: int = _opt(
        32, "Runs of an async agent() one reward worker holds at once under --agent-path (one "
        "event loop; a run mostly waits on the gateway): --reward-workers x this many runs are in "
        "flight. A sync agent() runs one at a time.", ge=1)
    env_schedule: Literal["turns", "eager"] = _opt(
        "turns", "How the engines take turns under --env-path: turns (every trajectory whose "
        "environment has answered generates its next turn together; a seeded run repeats, a "
        "resume is exact, split placement samples what colocated does) or eager (a trajectory "
        "generates as soon as its own environment answers, so a slow call holds back only its "
        "own trajectory; which trajectories share a generate call then depends on timing and "
        "a seeded run does not repeat).")


def multi_turn(cfg: Any) -> bool:
    """An environment (--env-path) or an agent (--agent-path): trajectories of turns."""
    return cfg.env_path is not None or getattr(cfg, "agent_path", None) is not None


def trajectory_tokens(cfg: Any) -> int:
    """Response tokens one sample may hold: --max-new-tokens, or a trajectory's budget."""
    if not multi_turn(cfg):
        return cfg.max_new_tokens
    return cfg.max_trajectory_tokens or DEFAULT_OBSERVATION_SHARE * cfg.max_turns * cfg.max_new_tokens


def max_policy_tokens(cfg: Any) -> int:
    """Sampled tokens one sample may hold, seq-mean-token-sum-norm's constant (Dr.
    GRPO's generation budget): --max-new-tokens, or a trajectory's --max-turns x
    --max-new-tokens bounded by its budget (observation tokens never train)."""
    if not multi_turn(cfg):
        return cfg.max_new_tokens
    return min(cfg.max_turns * cfg.max_new_tokens, trajectory_tokens(cfg))


def check_env_options(cfg: Any) -> None:
    """--env-path against the options it cannot go with: UserError (one line)."""
    if cfg.agent_path is not None:
        return check_agent_options(cfg)
    if cfg.agent_tool_parser != "hermes":
        raise UserError("--agent-tool-parser needs --agent-path (an agent)")
    if cfg.agent_concurrency != 32:
        raise UserError("--agent-concurrency needs --agent-path (an agent)")
    if cfg.env_path is None:
        given = [f for f, on in (("--max-trajectory-tokens", cfg.max_trajectory_tokens),
                                 ("--env-reward last", cfg.env_reward != "sum"),
                                 ("--max-turns", cfg.max_turns != 4),
                                 ("--env-schedule eager", cfg.env_schedule != "turns")) if on]
        if given:
            raise UserError(f"{given[0]} needs --env-path (a multi-turn environment) or --agent-path")
        return
    from areno.config.fieldcheck import check_file
    from areno.envs.plugin import load_env_plugin

    check_file("--env-path", cfg.env_path, suffix=".py")
    load_env_plugin(cfg.env_path)  # no step(), a syntax error: one line now, not in a worker
    flag = f"--env-path {cfg.env_path}"
    if cfg.reward_fn_path is not None:
        raise UserError(f"{flag} with --reward-fn-path: the environment's step() rewards are the "
                        "reward; drop --reward-fn-path")
    if cfg.max_trajectory_tokens and cfg.max_trajectory_tokens < cfg.max_new_tokens:
        raise UserError(f"--max-trajectory-tokens {cfg.max_trajectory_tokens} is below --max-new-tokens "
                        f"{cfg.max_new_tokens}: not even one whole turn would fit")
    if cfg.agent_tool_parser not in ("hermes", "none"):  # a name typed by the user: before the run dir
        from areno.gateway.tools import tool_parser_class

        tool_parser_class(cfg.agent_tool_parser)


def check_agent_options(cfg: Any) -> None:
    """--agent-path against the options it cannot go with: UserError (one line)."""
    from areno.config.fieldcheck import check_file
    from areno.gateway.plugin import load_agent_plugin

    check_file("--agent-path", cfg.agent_path, suffix=".py")
    load_agent_plugin(cfg.agent_path)  # no agent(), a syntax error: one line now, not in a worker
    flag = f"--agent-path {cfg.agent_path}"
    if cfg.env_path is not None:
        raise UserError(f"{flag} with --env-path: an agent is the environment; give one of them")
    if cfg.reward_workers == 0:
        raise UserError(f"{flag} with --reward-workers 0: an agent calls the run's gateway, which "
                        "cannot answer while the agent runs in its thread; give --reward-workers >= 1")
    if cfg.max_trajectory_tokens and cfg.max_trajectory_tokens < cfg.max_new_tokens:
        raise UserError(f"--max-trajectory-tokens {cfg.max_trajectory_tokens} is below --max-new-tokens "
                        f"{cfg.max_new_tokens}: not even one whole turn would fit")
    if cfg.agent_tool_parser not in ("hermes", "none"):  # a name typed by the user: before the run dir
        from areno.gateway.tools import tool_parser_class

        tool_parser_class(cfg.agent_tool_parser)
