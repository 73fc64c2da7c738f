"""Written models and checkpoints get the modes the umask asks for (0644 files,
0755 directories under umask 022), though transformers writes safetensors 0600
and mkdtemp makes 0700 directories."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from areno.fileperms import current_umask, honour_umask


@pytest.fixture
def umask022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def modes(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): stat.S_IMODE(p.stat().st_mode)
            for p in [root, *root.rglob("*")]}


def private_tree(root: Path) -> None:
    root.mkdir(mode=0o700)
    (root / "sub").mkdir(mode=0o700)
    for name in ("model.safetensors", "sub/trainer.pt"):
        os.close(os.open(root / name, os.O_CREAT | os.O_WRONLY, 0o600))
    os.close(os.open(root / "run.sh", os.O_CREAT | os.O_WRONLY, 0o700))


def test_current_umask_reads_without_changing_it(umask022):
    assert current_umask() == 0o022
    assert current_umask() == 0o022


def test_honour_umask_opens_files_and_dirs_to_the_umask(tmp_path, umask022):
    private_tree(tmp_path / "m")
    honour_umask(tmp_path / "m")
    assert modes(tmp_path / "m") == {".": 0o755, "sub": 0o755, "model.safetensors": 0o644,
                                     "sub/trainer.pt": 0o644, "run.sh": 0o755}


def test_a_strict_umask_keeps_files_private(tmp_path):
    old = os.umask(0o077)
    try:
        private_tree(tmp_path / "m")
        honour_umask(tmp_path / "m")
    finally:
        os.umask(old)
    assert modes(tmp_path / "m")["model.safetensors"] == 0o600


def test_cached_tiny_model_is_readable_by_all(tmp_path, umask022):
    from areno.models.tiny import tiny_model_path

    path = tiny_model_path("arith", cache_dir=tmp_path)
    got = modes(path)
    assert got["."] == 0o755 and got["model.safetensors"] == 0o644
    assert all(m == 0o644 for name, m in got.items() if name != "."), got


def test_saved_hf_dir_is_readable_by_all(tmp_path, umask022, tiny_arith_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    from areno.backend.weights import save_hf_dir

    model = AutoModelForCausalLM.from_pretrained(tiny_arith_path)
    out = tmp_path / "out"
    out.mkdir()
    save_hf_dir(AutoConfig.from_pretrained(tiny_arith_path), iter(model.state_dict().items()),
                out, Path(tiny_arith_path))
    assert modes(out)["model.safetensors"] == 0o644


def test_checkpoint_files_are_readable_by_all(tmp_path, umask022):
    from areno.rundir.checkpoint import save_checkpoint
    from areno.config.train import TrainConfig

    class Backend:
        def save_pretrained(self, path: Path) -> None:
            private_tree(path)

        def save_state(self, path: Path) -> None:
            path.mkdir(mode=0o700)
            os.close(os.open(path / "trainer.pt", os.O_CREAT | os.O_WRONLY, 0o600))

    class Tokenizer:
        def save_pretrained(self, path: str) -> None:
            (Path(path) / "tokenizer_config.json").write_text("{}")

    class Sampler:
        def state_dict(self) -> dict:
            return {"epoch": 0, "position": 0, "seed": 0, "num_prompts": 4, "batch_size": 2}

    class Run:
        cfg = TrainConfig(output_dir=str(tmp_path / "run"))
        output_dir = tmp_path / "run"
        model_path = "m"
        backend, tokenizer, sampler = Backend(), Tokenizer(), Sampler()

    ckpt = save_checkpoint(Run(), 1)
    got = modes(ckpt)
    assert got["."] == 0o755 and got["backend"] == 0o755
    assert got["model.safetensors"] == 0o644 and got["backend/trainer.pt"] == 0o644
