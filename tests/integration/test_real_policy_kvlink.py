"""KVLink on the real packaged models, with the adapters shipped for them."""

import pytest
from helpers.scripts import benchmark_script

from kvrag.bench import metrics as M
from kvrag.engine import KVRag
from kvrag.policies.kvlink.policy import ADAPTER_ATTR


@pytest.mark.real
def test_real_model_kvlink(tmp_path, isolated_home):  # only the shipped adapter can be found
    from kvrag.layout.prompt import rag_messages
    from kvrag.policies.kvlink.adapter import ASSETS_DIR

    docs = [
        "The Arden range lies north of the capital. Its tallest peak is Mount Kelvar, 4,210 metres high.",
        "The river Lenne rises in the Varn Mountains and flows east into the Grey Sea.",
        "Port Saliva is the largest harbour on the Grey Sea and the home of the Lenne ferry company.",
    ]
    msgs = rag_messages(docs, "What is the tallest peak of the Arden range?")
    rag = KVRag(cache_dir=tmp_path / "kv", policy="kvlink")
    # A kvlink KVRag on the default model runs the shipped adapter (its LoRA merged into a copy).
    ad = getattr(rag.handle.model, ADAPTER_ATTR)
    assert ad is not None and ad.path.parent == ASSETS_DIR and ad.has_lora
    rag.precompute(docs)
    out = rag.generate(msgs, max_new_tokens=12)
    assert out.text.strip() and out.stats.chunks_hit == 3 and out.stats.inserted_tokens == 3 * ad.link_tokens
    zero = rag.generate(msgs, max_new_tokens=12, link_tokens=0)
    naive = rag.generate(msgs, policy="naive_reuse", max_new_tokens=12)
    assert zero.token_ids == naive.token_ids


def _held_out_items(model: str, handle) -> list[dict]:
    """Three QA items no shipped adapter trained on: for SmolLM2 its generator's seed 7
    (training used seed 1000), for Gemma 3 the accuracy yardstick's generator (another
    generator's templates and names), both at a short shape."""
    if model == "smollm2":
        from kvrag.qa import synthetic

        return synthetic.generate(3, 7, n_passages=4, passage_tokens=120, count_tokens=lambda s: len(handle.encode(s)))
    return benchmark_script("yardstick_set").generate(3, 7, n_passages=4, words=90)


@pytest.mark.real
@pytest.mark.parametrize("model", ["smollm2", "gemma3-270m"])
def test_shipped_adapter_brings_kvlink_closer_to_full_prefill(model, tmp_path, isolated_home):
    """The adapter in kvrag/assets is what KVRag(policy="kvlink") runs on a packaged model,
    and on prompts it was not trained on its next-token distributions are closer to the base
    model's full prefill than untrained KVLink's."""
    from kvrag.bench.examples import examples_from_items
    from kvrag.layout.prompt import rag_prompt
    from kvrag.policies.kvlink.adapter import ASSETS_DIR

    base = KVRag(model=model, cache_dir=tmp_path / "kv", kvlink_adapter=None)
    trained = KVRag(base.handle, cache_dir=tmp_path / "kv", policy="kvlink")
    ad = getattr(trained.handle.model, ADAPTER_ATTR)
    assert ad.path.parent == ASSETS_DIR and ad.has_lora and trained.fingerprint != base.fingerprint
    kl_trained = kl_untrained = 0.0
    for ex in examples_from_items(_held_out_items(model, base.handle), source="held-out"):
        msgs = rag_prompt(base.tokenizer, ex.passages, ex.question)  # Gemma's GGUF has no chat template
        base.precompute(ex.passages)
        trained.precompute(ex.passages)
        ans = base.generate(msgs, policy="full_prefill", max_new_tokens=8).token_ids
        ref, _ = base.continuation_logits(msgs, ans[:-1], policy="full_prefill")
        lt, st = trained.continuation_logits(msgs, ans[:-1], policy="kvlink")
        lu, su = base.continuation_logits(msgs, ans[:-1], policy="kvlink", mode="untrained")
        assert st.chunks_hit == su.chunks_hit == 4 and st.inserted_tokens == 4 * ad.link_tokens
        kl_trained += M.next_token_agreement(ref, lt)[1]
        kl_untrained += M.next_token_agreement(ref, lu)[1]
    assert kl_trained < 0.8 * kl_untrained, (kl_trained, kl_untrained)
