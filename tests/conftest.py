"""Fixtures shared by the unit and the integration tests (the helpers that are not fixtures, shared
with the integration packages' tests too, are the package tests/helpers/)."""

import os

import pytest

# Tests never reach a model hub: every model comes from a local file or package.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module of tiny-model tests: they gain nothing from intra-op
    threads, and on a busy 2-core machine OpenMP's spinning threads made each tiny forward
    ~50x slower (measured: 0.96 s vs 0.019 s). Use with
    ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def isolated_home(tmp_path, monkeypatch):
    """A fresh kvrag home for one test, so no adapter, codebook or store of the user's leaks in,
    that shares the user's converted models: a real-model test then loads the packaged GGUF's
    safetensors copy instead of converting it again (20 s for SmolLM2, more for Gemma 3)."""
    from kvrag.paths import default_home

    models = default_home() / "models"  # read before KVRAG_HOME points elsewhere
    models.mkdir(parents=True, exist_ok=True)
    home = tmp_path / "home"
    home.mkdir()
    (home / "models").symlink_to(models, target_is_directory=True)
    monkeypatch.setenv("KVRAG_HOME", str(home))
    return home


@pytest.fixture(scope="module")
def handle():
    """The tiny random-weight llama with SmolLM2's tokenizer (kvrag.testing.tiny_llama, seed 0)."""
    from kvrag.testing import tiny_llama

    return tiny_llama(seed=0)


@pytest.fixture
def rag(handle, tmp_path):
    """A KVRag on the tiny model with the default policy and a fresh store of this test."""
    from kvrag.engine import KVRag

    return KVRag(handle, cache_dir=tmp_path / "kv")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The tiny model saved as an HF directory (a model with a path, as users load them; every
    process loading it gets the same fingerprint, so the same keys)."""
    from kvrag.testing import tiny_llama

    handle = tiny_llama(seed=0)
    d = tmp_path_factory.mktemp("tiny-model")
    handle.model.save_pretrained(d)
    handle.tokenizer.save_pretrained(d)
    return str(d)
