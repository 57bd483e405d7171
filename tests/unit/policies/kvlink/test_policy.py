"""KVLink: link tokens after cached documents, the training loop, adapters and their loading."""

import json
import random
from types import SimpleNamespace

import pytest
import torch
from helpers.fusion import CONFIGS, hf_logits, pieces_for, rand_ids, tiny

from kvrag.arch import Arch
from kvrag.bench import metrics as M
from kvrag.engine import KVRag
from kvrag.layout.state import CACHED, INSERTED, Layout
from kvrag.policies import get_policy
from kvrag.policies.kvlink.adapter import KVLinkError, adapter_key, apply_adapter, load_adapter
from kvrag.policies.kvlink.config import TrainConfig
from kvrag.policies.kvlink.data import load_qa
from kvrag.policies.kvlink.forward import answer_logits, forward_hidden, forward_hidden_batch, kvlink_mask
from kvrag.policies.kvlink.loss import batch_loss, sample_loss
from kvrag.policies.kvlink.policy import ADAPTER_ATTR, mean_embedding
from kvrag.policies.kvlink.samples import build_sample, make_sample, pick_passages, prompt_pieces, rag_prompt
from kvrag.policies.kvlink.train import train_kvlink
from kvrag.qa.example import QAExample
from kvrag.query.fusion import FusionEngine
from kvrag.store.base import ChunkEntry
from kvrag.testing import tiny_llama

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


# ---- engine level: tiny models with a 512-token vocabulary ------------------------------
def _segments(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(rand_ids(5, g), False), (rand_ids(12, g), True), (rand_ids(9, g), True), (rand_ids(6, g), False)]


def _run(arch, segs, policy, pieces=None):
    eng = FusionEngine(arch)
    layout = eng.apply_insertions(pieces if pieces is not None else pieces_for(arch, segs), policy)
    return layout, eng.prefill(layout, policy, keep_state=True)


def test_link_tokens_see_every_earlier_document_and_documents_stay_local():
    arch = Arch(tiny("llama"))
    segs = _segments()
    pol = get_policy("kvlink", link_tokens=2)
    base_pieces = pieces_for(arch, segs)
    layout, ref = _run(arch, segs, pol, base_pieces)
    # Layout: prefix 0..4 | doc1 5..16 | link 17,18 | doc2 19..27 | link 28,29 | question 30..35
    assert layout.n == 36 and ref.stats.inserted_tokens == 4
    link1, doc2, link2 = slice(17, 19), slice(19, 28), slice(28, 30)

    # Perturb the cached K/V of document 1 only.
    g = torch.Generator().manual_seed(9)
    e1 = base_pieces[1].entry
    noisy = ChunkEntry(
        "test",
        "",
        e1.token_ids,
        e1.keys + 0.5 * torch.randn(e1.keys.shape, generator=g),
        e1.values + 0.5 * torch.randn(e1.values.shape, generator=g),
    )
    pert_pieces = list(base_pieces)
    pert_pieces[1] = type(base_pieces[1])(base_pieces[1].token_ids, CACHED, entry=noisy)
    _, pert = _run(arch, segs, pol, pert_pieces)
    for layer in range(1, arch.n_layers):  # layer 0's K is a function of the embedding alone
        # Both documents' link tokens read document 1 ...
        assert not torch.allclose(pert.K[layer][:, link1], ref.K[layer][:, link1], atol=1e-4)
        assert not torch.allclose(pert.K[layer][:, link2], ref.K[layer][:, link2], atol=1e-4)
        # ... while document 2's cached rows are untouched: documents keep local attention.
        torch.testing.assert_close(pert.K[layer][:, doc2], ref.K[layer][:, doc2], atol=0, rtol=0)
        torch.testing.assert_close(pert.V[layer][:, doc2], ref.V[layer][:, doc2], atol=0, rtol=0)
    assert not torch.allclose(pert.logits, ref.logits, atol=1e-4)

    # Causality: perturbing document 2 cannot reach document 1's link tokens.
    e2 = base_pieces[2].entry
    pert_pieces = list(base_pieces)
    pert_pieces[2] = type(base_pieces[2])(
        base_pieces[2].token_ids,
        CACHED,
        entry=ChunkEntry("test", "", e2.token_ids, e2.keys + 0.5, e2.values - 0.5),
    )
    _, pert2 = _run(arch, segs, pol, pert_pieces)
    for layer in range(arch.n_layers):
        torch.testing.assert_close(pert2.K[layer][:, link1], ref.K[layer][:, link1], atol=1e-6, rtol=0)
        assert layer == 0 or not torch.allclose(pert2.K[layer][:, link2], ref.K[layer][:, link2], atol=1e-4)


# Not LongRoPE: its frequencies follow the sequence length, so a document cached alone (short
# factors) and the same document inside the training sequence (long factors) differ by design.
@pytest.mark.parametrize("model_type", [m for m in CONFIGS if m != "llama-longrope"])
@pytest.mark.parametrize("anchor", [(), (7, 9)])
def test_fused_prefill_equals_the_training_forward_with_the_kvlink_mask(model_type, anchor):
    # The engine (cached documents + link tokens computed at query time) and the training
    # forward (one pass with the paper's mask) must be the same function, or training would
    # optimise something inference does not run -- also when chunks are cached behind an anchor.
    arch = Arch(tiny(model_type))
    segs = _segments(1)
    links = torch.randn(4, 3, arch.hidden_size, generator=torch.Generator().manual_seed(2)) * 0.2
    model = arch.model
    setattr(model, ADAPTER_ATTR, SimpleNamespace(link_tokens=3, links_for=lambda i: links[min(i, 3)]))
    try:
        _, res = _run(arch, segs, get_policy("kvlink", mode="trained"), pieces_for(arch, segs, anchor))
    finally:
        delattr(model, ADAPTER_ATTR)
    q = segs[-1][0]
    sample = build_sample(segs[:-1] + [(q[:-1], False)], [q[-1]], 3, 4, anchor)
    with torch.no_grad():
        ref = arch.logits(forward_hidden(arch, sample, links)[-1:])[0]
    torch.testing.assert_close(res.logits, ref, atol=1e-4, rtol=1e-4)
    assert res.stats.inserted_tokens == 6 and res.stats.recomputed_tokens == 0


def _uneven_samples(seed=3):
    """Three samples of different lengths (14 to 76 tokens, one to four documents, one read
    behind an anchor: private rows and their own positions), answers of 1 to 4 tokens."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for sizes, anchor, answer in (((4, 9, 7, 3), (5, 6), 4), ((6, 20, 15, 11, 8, 2), (), 2), ((2, 5, 3), (), 1)):
        pieces = [(rand_ids(n, g), 0 < i < len(sizes) - 1) for i, n in enumerate(sizes)]
        out.append(build_sample(pieces, rand_ids(answer, g), 3, 4, anchor))
    assert len({s.n for s in out}) == 3 and out[0].private is not None
    return out


@pytest.mark.parametrize("model_type", list(CONFIGS))
def test_packed_forward_equals_each_sample_alone(model_type):
    # Every family's wiring, sliding windows (8 tokens: shorter than the samples) and LongRoPE
    # (16 tokens: one sample below, two above, so each must keep its own RoPE tables).
    arch = Arch(tiny(model_type))
    samples = _uneven_samples()
    links = torch.randn(4, 3, arch.hidden_size, generator=torch.Generator().manual_seed(2)) * 0.2
    with torch.no_grad():
        packed = forward_hidden_batch(arch, samples, links)
        alone = [forward_hidden(arch, s, links) for s in samples]
    assert [h.shape for h in packed] == [(s.n, arch.hidden_size) for s in samples]
    for p, a in zip(packed, alone):
        torch.testing.assert_close(p, a, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("objective", ["answer", "distill"])
def test_a_batched_step_has_the_accumulated_gradients(objective):
    # One packed forward of three samples must train exactly like three single-sample passes
    # accumulating loss / 3: same loss, same gradients on LoRA and on the link table.
    from peft import LoraConfig, get_peft_model

    model = tiny("llama").double()
    # peft injects LoRA into ``model`` in place, as training does.
    get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    with torch.no_grad():  # LoRA's B starts at zero, which would leave A without gradient
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    arch = Arch(model)
    links = torch.nn.Parameter(torch.randn(4, 3, arch.hidden_size, dtype=torch.float64) * 0.2)
    params = [p for p in model.parameters() if p.requires_grad] + [links]
    samples = _uneven_samples()
    g = torch.Generator().manual_seed(4)
    teachers = [
        torch.randn(s.n - s.answer_start, 512, generator=g, dtype=torch.float64) if objective == "distill" else None
        for s in samples
    ]

    def grads():
        out = [p.grad.clone() for p in params]
        for p in params:
            p.grad = None
        return out

    batched = batch_loss(arch, samples, links, objective, teachers)
    batched.backward()
    g_batched = grads()
    accumulated = 0.0
    for s, t in zip(samples, teachers):
        loss = sample_loss(arch, s, links, objective, t) / len(samples)
        loss.backward()
        accumulated += float(loss.detach())
    g_accumulated = grads()
    assert float(batched.detach()) == pytest.approx(accumulated, rel=1e-12)
    assert all(float(x.abs().max()) > 0 for x in g_batched)  # every parameter is trained
    for b, a in zip(g_batched, g_accumulated):
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match="2 teacher logits for 3 samples"):
        batch_loss(arch, samples, links, objective, teachers[:2])


def test_kvlink_mask_is_the_papers_map():
    # prefix(0) | doc 1 (2 tokens) | link | doc 2 (2 tokens) | link | question
    seg = torch.tensor([0, 1, 1, 0, 2, 2, 0, 0])
    m = kvlink_mask(seg)
    assert m[2].tolist() == [False, True, True, False, False, False, False, False]  # doc 1: itself only
    assert m[4].tolist() == [False, False, False, False, True, False, False, False]  # doc 2 not the prefix
    assert m[3].tolist() == [True] * 4 + [False] * 4  # link 1 sees all before it
    assert m[6].tolist() == [True] * 7 + [False]  # link 2 sees docs 1, 2 and link 1
    assert m[7].all()


def test_zero_link_tokens_equals_naive_reuse():
    arch = Arch(tiny("qwen2"))
    segs = _segments(3)
    layout = Layout.build(pieces_for(arch, segs))
    eng = FusionEngine(arch)
    naive = eng.prefill(layout, get_policy("naive_reuse"))
    pol = get_policy("kvlink", link_tokens=0)
    res = eng.prefill(eng.apply_insertions(layout.pieces, pol), pol)
    torch.testing.assert_close(res.logits, naive.logits, atol=0, rtol=0)
    assert res.stats.inserted_tokens == 0
    # With link tokens the answer changes (they are real attention participants) ...
    pol5 = get_policy("kvlink")
    res5 = eng.prefill(eng.apply_insertions(layout.pieces, pol5), pol5)
    assert res5.stats.inserted_tokens == 10 and res5.stats.prompt_tokens == layout.n + 10
    assert not torch.allclose(res5.logits, naive.logits, atol=1e-4)
    # ... and neither is full prefill: untrained re-encoded concatenation stays approximate.
    all_ids = [t for s, _ in segs for t in s]
    assert not torch.allclose(res5.logits, hf_logits(arch.model, all_ids), atol=1e-3)


def _untrained_kvlink(segs):
    """(arch, layout, engine, run): ``run(**params)`` is untrained kvlink's prefill of ``segs``."""
    arch = Arch(tiny("llama"))
    layout = Layout.build(pieces_for(arch, segs))
    eng = FusionEngine(arch)

    def run(**kw):
        pol = get_policy("kvlink", mode="untrained", **kw)
        return eng.prefill(eng.apply_insertions(layout.pieces, pol), pol)

    return arch, layout, eng, run


def test_links_plus_recompute_composes_kvlink_and_cacheblend():
    """kvlink(recompute_ratio=r): link tokens inserted *and* cacheblend's selection on top."""
    segs = _segments(4)
    arch, layout, eng, run = _untrained_kvlink(segs)
    links = run(link_tokens=2)
    assert links.stats.recomputed_tokens == 0
    both = run(link_tokens=2, recompute_ratio=0.5)
    n_cached = sum(len(s) for s, cached in segs if cached)
    assert both.stats.inserted_tokens == links.stats.inserted_tokens == 4
    assert both.stats.recomputed_tokens == n_cached // 2  # cacheblend's count: the links are not ranked
    assert not torch.allclose(both.logits, links.logits, atol=1e-4)
    blend = eng.prefill(layout, get_policy("cacheblend", recompute_ratio=0.5))
    assert both.stats.recomputed_tokens == blend.stats.recomputed_tokens
    # Without links it is cacheblend itself, to the bit.
    torch.testing.assert_close(run(link_tokens=0, recompute_ratio=0.5).logits, blend.logits, atol=0, rtol=0)
    # The same with the layer-0 attention estimate of the deviation.
    cheap = run(link_tokens=2, recompute_ratio=0.5, deviation="attention")
    assert cheap.stats.recomputed_tokens == n_cached // 2 and cheap.stats.inserted_tokens == 4
    blend_cheap = eng.prefill(layout, get_policy("cacheblend", recompute_ratio=0.5, deviation="attention"))
    torch.testing.assert_close(
        run(link_tokens=0, recompute_ratio=0.5, deviation="attention").logits, blend_cheap.logits, atol=0, rtol=0
    )
    # The exact limit: no links, everything recomputed == full prefill.
    exact = run(link_tokens=0, recompute_ratio=1.0)
    torch.testing.assert_close(
        exact.logits, hf_logits(arch.model, [t for s, _ in segs for t in s]), atol=1e-4, rtol=1e-4
    )
    with pytest.raises(ValueError, match="check_layers"):
        get_policy("kvlink", recompute_ratio=0.2, check_layers=(9,)).check_model(arch)
    for bad in ({"recompute_ratio": 1.5}, {"check_layers": (0,)}, {"deviation": "keys"}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            get_policy("kvlink", **bad)


def test_links_plus_heads_composes_kvlink_and_epic():
    """kvlink(k_head=k): link tokens inserted *and* epic's first k tokens of every document."""
    segs = _segments(4)
    _, layout, eng, run = _untrained_kvlink(segs)
    both = run(link_tokens=2, k_head=3)
    n_docs = sum(1 for _, cached in segs if cached)
    assert both.stats.inserted_tokens == 2 * n_docs
    assert both.stats.recomputed_tokens == eng.prefill(layout, get_policy("epic", k_head=3)).stats.recomputed_tokens
    assert not torch.allclose(both.logits, run(link_tokens=2).logits, atol=1e-4)
    # Without links it is epic itself, to the bit.
    alone = run(link_tokens=0, k_head=3)
    torch.testing.assert_close(alone.logits, eng.prefill(layout, get_policy("epic", k_head=3)).logits, atol=0, rtol=0)
    with pytest.raises(ValueError, match="pick one way"):
        get_policy("kvlink", k_head=3, recompute_ratio=0.1)
    with pytest.raises(ValueError, match="k_head"):
        get_policy("kvlink", k_head=-1)


def test_untrained_link_embedding_is_the_mean_embedding():
    arch = Arch(tiny("llama"))
    layout = Layout.build(pieces_for(arch, _segments()))
    ins = get_policy("kvlink", link_tokens=3, mode="untrained").insertions(layout, arch)
    assert sorted(ins) == [1, 2]
    mean = arch.body.embed_tokens.weight.mean(0)
    for emb in ins.values():
        assert emb.shape == (3, arch.hidden_size)
        torch.testing.assert_close(emb, mean.expand(3, -1), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize(
    "params",
    [
        {"link_tokens": -1},
        {"link_tokens": 65},
        {"link_tokens": 1.5},
        {"link_tokens": "5"},
        {"link_tokens": True},
        {"mode": "learned"},
        {"ratio": 0.1},
    ],
)
def test_bad_params_raise_value_error(params):
    with pytest.raises(ValueError, match=next(iter(params))):  # the message names the parameter
        get_policy("kvlink", **params)


def test_trained_mode_without_adapter_raises():
    arch = Arch(tiny("llama"))
    layout = Layout.build(pieces_for(arch, _segments()))
    with pytest.raises(ValueError, match="needs a model loaded with a KVLink adapter"):
        get_policy("kvlink", mode="trained").insertions(layout, arch)


# ---- training, adapters, KVRag: tiny model with the SmolLM2 tokenizer --------------------
NAMES = ["Ada", "Bo", "Cy", "Dee", "Eli", "Fay"]
COLOURS = ["red", "blue", "green", "amber", "violet", "silver"]


def qa_rows():
    rows = []
    for i, n in enumerate(NAMES):
        ctxs = [{"title": "", "text": f"{m} keeps a {COLOURS[j]} lantern in the hall."} for j, m in enumerate(NAMES)]
        rows.append({"question": f"What colour is {n}'s lantern?", "answers": [COLOURS[i]], "ctxs": ctxs})
    return rows


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("kvlink_data") / "qa.json"
    p.write_text(json.dumps(qa_rows()))
    return p


CFG = dict(lora_rank=4, link_tokens=2, max_docs=4, docs=2, lr=3e-2, link_lr=3e-2, warmup=2, log_every=100)


@pytest.fixture(scope="module")
def trained(handle, data_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("kvlink_adapter")
    return train_kvlink(
        handle,
        TrainConfig(data=str(data_file), steps=16, **CFG),
        out,
        force=True,
        command=["kvrag", "train", "kvlink", "--test"],
    )


def test_training_reduces_the_loss_and_records_the_run(trained, data_file):
    first, last = sum(trained.losses[:4]) / 4, sum(trained.losses[-4:]) / 4
    assert last < 0.6 * first, trained.losses
    meta = json.loads((trained.out / "kvlink.json").read_text())
    assert meta["steps"] == 16 and len(meta["losses"]) == 16 and meta["command"][:3] == ["kvrag", "train", "kvlink"]
    assert meta["lora"]["rank"] == 4 and meta["data_sha256"]
    for f in ("link_embeddings.safetensors", "adapter_model.safetensors", "adapter_config.json"):
        assert (trained.out / f).is_file()
    ad = load_adapter(trained.out)
    assert ad.links.shape == (2, 2, 64) and ad.has_lora  # the rows training reached: docs=2 of max_docs=4
    # The link embeddings moved away from their (mean-embedding) initialisation.
    assert not torch.allclose(ad.links[0], ad.links[0].mean(0).expand(2, -1), atol=1e-3)


def test_min_docs_draws_every_passage_count_and_trains_every_row(handle, data_file, tmp_path, monkeypatch):
    import kvrag.policies.kvlink.samples as ks

    counts = []
    real = ks.make_sample

    def spy(*a, docs, **kw):
        counts.append(docs)
        return real(*a, docs=docs, **kw)

    monkeypatch.setattr(ks, "make_sample", spy)
    res = train_kvlink(
        handle, TrainConfig(data=str(data_file), steps=24, **{**CFG, "docs": 4, "min_docs": 1}), tmp_path / "a"
    )
    assert set(counts) == {1, 2, 3, 4}, counts
    # Four documents reached the link table's four rows, all saved.
    assert res.meta["trained_rows"] == 4 and res.adapter.links.shape[0] == 4


@pytest.mark.parametrize("objective", ["answer", "distill"])
def test_batched_training_equals_accumulated_training(data_file, tmp_path, objective):
    # float64 weights: the two differ by rounding only, which Adam's first step (about
    # lr * sign(g)) must not turn into another update. The losses are float32 (Arch.logits
    # returns float32 logits), summed in another order: equal to float32 rounding.
    h64 = tiny_llama(seed=0)
    h64.model.double()  # a handle of this test's own: kvrag loads models in float32/16 only
    cfg = dict(data=str(data_file), steps=2, batch=2, **{**CFG, "objective": objective})
    runs = [train_kvlink(h64, TrainConfig(**cfg, batched=b), tmp_path / str(b)) for b in (True, False)]
    packed, accumulated = runs
    assert packed.losses == pytest.approx(accumulated.losses, rel=1e-6)
    assert packed.losses[1] != pytest.approx(packed.losses[0], rel=1e-3)  # the first step changed the model
    assert packed.meta["samples_by_source"] == accumulated.meta["samples_by_source"] == {"data": 4}
    assert packed.meta["config"]["batched"] and not accumulated.meta["config"]["batched"]
    torch.testing.assert_close(packed.adapter.links, accumulated.adapter.links, rtol=1e-5, atol=1e-6)


def test_source_order_keeps_the_items_order_and_the_gold_passage():
    item = QAExample("Where?", ["Brell"], [f"passage {i}" + (" at Brell" if i == 6 else "") for i in range(9)])
    reordered = 0
    for seed in range(30):
        shuffled = pick_passages(item, 4, random.Random(seed))
        kept = pick_passages(item, 4, random.Random(seed), shuffle=False)
        assert any("Brell" in p for p in kept) and len(kept) == 4
        assert kept == sorted(kept, key=item.passages.index)  # the item's own order
        assert sorted(shuffled) == sorted(kept)  # the same passages, only reordered
        reordered += shuffled != kept
    assert reordered > 0  # the default does shuffle


def test_saved_adapter_reproduces_the_trained_model(handle, trained):
    # Loading (LoRA merged into a copy + link table) must give the model training produced:
    # on training samples its loss is far below the untouched model's with untrained links.
    adapted = apply_adapter(handle, trained.out)
    ad = getattr(adapted.model, ADAPTER_ATTR)
    base_arch, new_arch = Arch(handle.model), Arch(adapted.model)
    base_links = mean_embedding(base_arch).expand(4, 2, -1)
    rng = random.Random(5)
    items = [QAExample(r["question"], r["answers"], [c["text"] for c in r["ctxs"]]) for r in qa_rows()]
    base_loss = new_loss = 0.0
    with torch.no_grad():
        for it in items:
            s = make_sample(handle, it, rng, docs=2, max_passage_chars=0, link_tokens=2, max_docs=4)
            tgt = s.ids[s.answer_start :]
            base_loss += torch.nn.functional.cross_entropy(answer_logits(base_arch, s, base_links), tgt).item()
            new_loss += torch.nn.functional.cross_entropy(answer_logits(new_arch, s, ad.links), tgt).item()
    assert new_loss < 0.7 * base_loss
    # The caller's model is untouched.
    assert getattr(handle.model, ADAPTER_ATTR, None) is None


def test_documents_past_the_trained_rows_get_the_last_trained_links(handle, trained, tmp_path):
    # Training reads CFG["docs"] = 2 documents per sample, so rows 2 and 3 of a max_docs=4
    # table never get a gradient: serving them (their initial mean embedding) after the 3rd
    # and 4th documents would give the fine-tuned model link tokens it never saw there.
    ad = trained.adapter
    mean = mean_embedding(Arch(handle.model)).expand(2, -1)
    for i in (2, 3, 9):
        assert not torch.allclose(ad.links_for(i), mean, atol=1e-3)
        torch.testing.assert_close(ad.links_for(i), ad.links_for(1), atol=0, rtol=0)
    assert trained.meta["trained_rows"] == 2 and ad.max_docs == 2
    # An adapter saved before ``trained_rows`` was recorded (the whole table, untrained rows
    # included) is read the same way, from the ``docs`` it was trained with.
    import shutil

    from safetensors.torch import save_file

    old = tmp_path / "old"
    shutil.copytree(trained.out, old)
    meta = json.loads((old / "kvlink.json").read_text())
    del meta["trained_rows"]
    (old / "kvlink.json").write_text(json.dumps(meta))
    save_file(
        {"links": torch.cat([ad.links, mean.expand(2, 2, -1).contiguous()])}, str(old / "link_embeddings.safetensors")
    )
    loaded = load_adapter(old)
    assert loaded.max_docs == 2
    torch.testing.assert_close(loaded.links_for(3), ad.links_for(1), atol=0, rtol=0)


def test_trained_kvrag_uses_the_adapted_fingerprint_and_changes_outputs(handle, trained, tmp_path):
    docs = [r["text"] for r in qa_rows()[0]["ctxs"][:3]]
    prompt = [
        {"role": "system", "content": "Answer."},
        {"role": "user", "content": "\n\n".join(docs) + "\n\nWhat colour is Bo's lantern?"},
    ]
    base = KVRag(handle, cache_dir=tmp_path / "kv", policy="kvlink")
    rag = KVRag(handle, cache_dir=tmp_path / "kv", policy="kvlink", kvlink_adapter=str(trained.out))
    assert rag.fingerprint != base.fingerprint
    assert rag.handle.fingerprint == apply_adapter(handle, trained.out).fingerprint
    # Same store, but the base model's chunk caches are not the adapted model's.
    base.precompute(docs)
    assert all(base.is_cached(d) for d in docs) and not any(rag.is_cached(d) for d in docs)
    rag.precompute(docs)
    out = rag.generate(prompt, max_new_tokens=4)
    assert out.stats.chunks_hit == 3 and out.stats.inserted_tokens == 3 * 2 and out.stats.cached_tokens > 0
    lt, _ = rag.continuation_logits(prompt, [], policy="kvlink", mode="trained")
    lu, _ = base.continuation_logits(prompt, [], policy="kvlink", mode="untrained")
    assert not torch.allclose(lt, lu, atol=1e-3)
    with pytest.raises(ValueError, match="trained with 2 link tokens"):
        rag.generate(prompt, max_new_tokens=1, link_tokens=5, mode="trained")
    # mode 'auto' with a link count the adapter was not trained with: the untrained variant.
    out5 = rag.generate(prompt, max_new_tokens=1, link_tokens=5)
    assert out5.stats.inserted_tokens == 3 * 5


def test_adapter_for_another_model_is_refused(trained):
    other = tiny_llama(seed=1)
    with pytest.raises(KVLinkError, match="trained for model key"):
        apply_adapter(other, trained.out)
    with pytest.raises(KVLinkError, match="not a KVLink adapter directory"):
        load_adapter(trained.out.parent)


def test_links_only_distill_adapter_keeps_fingerprint_and_is_found_by_auto(handle, data_file, tmp_path, monkeypatch):
    monkeypatch.setenv("KVRAG_HOME", str(tmp_path / "home"))
    cfg = TrainConfig(data=str(data_file), steps=6, objective="distill", **{**CFG, "lora_rank": 0})
    res = train_kvlink(handle, cfg)  # default out: $KVRAG_HOME/kvlink/<model key>/
    assert res.out == tmp_path / "home" / "kvlink" / adapter_key(handle)
    assert all(x >= 0 for x in res.losses) and not res.adapter.has_lora  # KL >= 0, finite
    # Distillation moved the link embeddings off their common (mean-embedding) start.
    assert not torch.allclose(
        res.adapter.links[0], res.adapter.links[0].mean(0).expand_as(res.adapter.links[0]), atol=1e-3
    )
    assert not (res.out / "adapter_model.safetensors").exists()
    rag = KVRag(handle, cache_dir=tmp_path / "kv", policy="kvlink", kvlink_adapter="auto")
    # The weights did not change, so neither do the fingerprint and the chunk caches.
    assert rag.handle.fingerprint == handle.fingerprint
    assert rag.handle.model is not handle.model and getattr(handle.model, ADAPTER_ATTR, None) is None
    # The default (kvlink_adapter="links") applies a links-only adapter by itself ...
    default = KVRag(handle, cache_dir=tmp_path / "kv", policy="kvlink")
    assert getattr(default.handle.model, ADAPTER_ATTR) is not None
    assert default.handle.fingerprint == handle.fingerprint
    # ... unless told not to; either way the chunk caches are shared.
    bare = KVRag(handle, cache_dir=tmp_path / "kv", kvlink_adapter=None)
    assert getattr(bare.handle.model, ADAPTER_ATTR, None) is None
    assert bare.fingerprint == default.fingerprint
    with pytest.raises(KVLinkError, match="already holds a KVLink adapter"):
        train_kvlink(handle, cfg)


def test_a_found_lora_adapter_applies_by_default_only_to_a_kvlink_kvrag(handle, trained, tmp_path, monkeypatch):
    """A LoRA adapter changes the model for every policy: by default only a KVRag built for
    kvlink gets it; one built for another policy keeps the base model (and its caches)."""
    import shutil

    monkeypatch.setenv("KVRAG_HOME", str(tmp_path / "home"))
    shutil.copytree(trained.out, tmp_path / "home" / "kvlink" / adapter_key(handle))
    rag = KVRag(handle, cache_dir=tmp_path / "kv")
    assert getattr(rag.handle.model, ADAPTER_ATTR, None) is None and rag.handle.fingerprint == handle.fingerprint
    links = KVRag(handle, cache_dir=tmp_path / "kv", policy="kvlink", kvlink_adapter="links")
    assert getattr(links.handle.model, ADAPTER_ATTR, None) is None
    adapted = apply_adapter(handle, trained.out).fingerprint
    assert KVRag(handle, cache_dir=tmp_path / "kv", kvlink_adapter="auto").handle.fingerprint == adapted
    kv = KVRag(handle, cache_dir=tmp_path / "kv", policy="kvlink")
    assert kv.handle.fingerprint == adapted and getattr(kv.handle.model, ADAPTER_ATTR).has_lora
    # Per call on the base-model KVRag, kvlink runs untrained (the model carries no adapter).
    prompt = [{"role": "user", "content": "\n\n".join(r["text"] for r in qa_rows()[0]["ctxs"][:2]) + "\n\nWhy?"}]
    rag.precompute([r["text"] for r in qa_rows()[0]["ctxs"][:2]])
    assert rag.generate(prompt, policy="kvlink", max_new_tokens=1).stats.inserted_tokens == 2 * 5


def test_auto_without_adapter_raises(handle, tmp_path, monkeypatch):
    monkeypatch.setenv("KVRAG_HOME", str(tmp_path / "empty"))
    with pytest.raises(KVLinkError, match="no KVLink adapter for this model"):
        KVRag(handle, cache_dir=tmp_path / "kv", kvlink_adapter="auto")


@pytest.mark.parametrize(
    "change,match",
    [
        ({"steps": 0}, "steps"),
        ({"lora_rank": 0, "link_tokens": 0}, "nothing to train"),
        ({"objective": "rl"}, "objective"),
        ({"docs": 0}, "docs"),
        ({"holdout": 6}, "holdout"),
        ({"min_docs": 3}, "min_docs must be in"),
        ({"passage_order": "reverse"}, "passage_order must be one of"),
    ],
)
def test_bad_training_options_raise(handle, data_file, tmp_path, change, match):
    with pytest.raises(KVLinkError, match=match):
        train_kvlink(handle, TrainConfig(data=str(data_file), **{**CFG, "steps": 2, **change}), tmp_path / "o")


def test_init_trains_further_from_an_adapter_and_records_it(handle, trained, data_file, tmp_path):
    # Same seed, so the first sample is the one the fresh run began with: loaded weights
    # start where the trained adapter ended, far below the fresh run's first loss.
    warm = train_kvlink(
        handle,
        TrainConfig(data=str(data_file), steps=3, **{**CFG, "max_docs": 6}, init=str(trained.out)),
        tmp_path / "w",
    )
    assert warm.losses[0] < 0.5 * trained.losses[0], (warm.losses, trained.losses)
    rec = warm.meta["init"]
    assert (
        rec["path"] == str(trained.out)
        and rec["steps"] == 16
        and rec["lora_digest"] == load_adapter(trained.out).lora_digest
    )
    assert rec["data_sha256"] == trained.meta["data_sha256"] and len(rec["links_sha256"]) == 64
    assert warm.meta["trained_rows"] == 2 and warm.adapter.links.shape[0] == 2
    # The started-from rows stay trained rows: one-document samples reach row 1 only, and the
    # adapter's row 2 is saved all the same.
    one = train_kvlink(
        handle, TrainConfig(data=str(data_file), steps=1, **{**CFG, "docs": 1}, init=str(trained.out)), tmp_path / "1"
    )
    assert one.meta["trained_rows"] == 2 and one.adapter.links.shape[0] == 2


def test_warm_start_fills_new_link_rows_with_the_last_one(handle, trained):
    from kvrag.policies.kvlink.warm_start import warm_start

    ad = load_adapter(trained.out)
    links = torch.nn.Parameter(torch.zeros(5, 2, ad.links.shape[2]))
    warm_start(ad, None, links)
    assert torch.equal(links[:2], ad.links) and all(torch.equal(links[i], ad.links[1]) for i in (2, 3, 4))


@pytest.mark.parametrize(
    "change,match",
    [
        ({"link_tokens": 3}, "has 2 link tokens per document; link_tokens is 3"),
        ({"lora_rank": 2}, "has LoRA .*'rank': 4.*'rank': 2"),
        ({"lora_rank": 0}, "has LoRA .*these options give None"),
        ({"max_docs": 1}, "has 2 trained link rows; max_docs must be >= 2"),
    ],
)
def test_init_from_a_mismatched_adapter_is_refused(handle, trained, data_file, tmp_path, change, match):
    with pytest.raises(KVLinkError, match=match):
        train_kvlink(
            handle,
            TrainConfig(data=str(data_file), steps=1, **{**CFG, **change}, init=str(trained.out)),
            tmp_path / "o",
        )
    assert not (tmp_path / "o" / "kvlink.json").exists()


def test_init_from_another_models_adapter_is_refused(trained, data_file, tmp_path):
    with pytest.raises(KVLinkError, match="was trained for model key .*not this model"):
        train_kvlink(
            tiny_llama(seed=3), TrainConfig(data=str(data_file), steps=1, **CFG, init=str(trained.out)), tmp_path
        )


def test_init_names_a_missing_adapter(handle, data_file, tmp_path, monkeypatch):
    monkeypatch.setenv("KVRAG_HOME", str(tmp_path / "empty"))
    for init, match in (("auto", "init='auto': no KVLink adapter"), (str(tmp_path / "nope"), "not a KVLink adapter")):
        with pytest.raises(KVLinkError, match=match):
            train_kvlink(handle, TrainConfig(data=str(data_file), steps=1, **CFG, init=init), tmp_path / "o")


def test_resume_refuses_another_starting_adapter(handle, trained, data_file, tmp_path):
    other = train_kvlink(handle, TrainConfig(data=str(data_file), steps=1, **CFG), tmp_path / "other")
    cfg = dict(data=str(data_file), steps=3, **CFG)
    train_kvlink(handle, TrainConfig(**cfg, init=str(trained.out)), tmp_path / "w", stop_at_step=1)
    with pytest.raises(KVLinkError, match="other options or data: init="):
        train_kvlink(handle, TrainConfig(**cfg, init=str(other.out)), tmp_path / "w", resume=True)
    done = train_kvlink(handle, TrainConfig(**cfg, init=str(trained.out)), tmp_path / "w", resume=True)
    assert done.meta["complete"] and done.meta["init"]["path"] == str(trained.out)


def test_lora_targets_the_model_lacks_are_named(data_file, tmp_path):
    # Phi-3 fuses q/k/v into qkv_proj: the default targets would adapt o_proj alone.
    from kvrag.testing import tiny_llama

    phi = tiny_llama(seed=0, model_type="phi3")
    with pytest.raises(KVLinkError, match=r"LoRA targets q_proj, k_proj, v_proj name no module .*qkv_proj"):
        train_kvlink(phi, TrainConfig(data=str(data_file), **{**CFG, "steps": 2}), tmp_path / "o")


@pytest.mark.parametrize(
    "rows,match",
    [
        ([], "non-empty list"),
        ([{"question": "q", "answers": [], "ctxs": [{"text": "t"}]}], "answers"),
        ([{"question": "q", "answers": ["a"], "ctxs": [{"title": "x"}]}], "ctx 0 has no 'text'"),
        ([{"answers": ["a"], "ctxs": [{"text": "t"}]}], "no 'question'"),
    ],
)
def test_bad_training_data_is_named(tmp_path, rows, match):
    p = tmp_path / "bad.json"
    p.write_text(json.dumps(rows))
    with pytest.raises(KVLinkError, match=match):
        load_qa(p)


SERVED_DOCS = [
    "The Arden range lies north of the capital. Its tallest peak is Mount Kelvar.",
    "The river Lenne rises in the Varn Mountains and flows east into the Grey Sea. ",  # trailing space
    "Port Saliva is the largest harbour on the Grey Sea.",
]


@pytest.mark.parametrize("layout", ["rag", "merged-edges"])
def test_training_sample_is_the_prompt_kvrag_serves(handle, tmp_path, layout):
    # The trainer must optimise the sequence inference runs: the same token ids (the
    # tokenizer's ids of the whole prompt, not of each segment alone: SmolLM2 spells a blank
    # line between passages as one token alone but two inside the prompt), the same tokens
    # served from the cache (a document's edge token merged with its neighbour is computed as
    # plain text), link tokens at the same places, and so the same logits.
    docs, q = SERVED_DOCS, "Where does the river Lenne rise?"
    if layout == "rag":
        prompt = rag_prompt(handle, docs, q)
    else:  # first token of a document merged with the text before it (" The" after "Context:")
        prompt = f"Context: {docs[0]}\n\n{docs[1]}\nQuestion: {q}\nAnswer:"
    rag = KVRag(handle, cache_dir=tmp_path / "kv", policy="kvlink", kvlink_adapter=None, storage_dtype="float32")
    rag.precompute(docs)
    pieces, _ = rag.pieces(prompt)
    links = torch.randn(4, 2, rag.arch.hidden_size, generator=torch.Generator().manual_seed(3)) * 0.2
    setattr(rag.arch.model, ADAPTER_ATTR, SimpleNamespace(link_tokens=2, links_for=lambda i: links[min(i, 3)]))
    try:
        pol = get_policy("kvlink", mode="trained")
        lay = rag.fusion.apply_insertions(pieces, pol)
        res = rag.fusion.prefill(lay, pol)
    finally:
        delattr(rag.arch.model, ADAPTER_ATTR)
    assert res.stats.chunks_hit == len([p for p in pieces if p.kind == CACHED]) >= 2
    sample = build_sample(prompt_pieces(handle, prompt, docs), [42], 2, 4, handle.anchor_ids())
    shown = ~sample.private if sample.private is not None else torch.ones(sample.n, dtype=torch.bool)
    n = int(shown[: sample.answer_start].sum())
    assert sample.ids[shown][:n].tolist() == lay.token_ids.tolist()
    assert (sample.segment[shown][:n] > 0).tolist() == (lay.kind == CACHED).tolist()
    assert (sample.link_slot[shown][:n] >= 0).tolist() == (lay.kind == INSERTED).tolist()
    with torch.no_grad():
        train_logits = rag.arch.logits(forward_hidden(rag.arch, sample, links)[sample.answer_start - 1 :][:1])[0]
    torch.testing.assert_close(train_logits, res.logits, atol=1e-4, rtol=1e-4)


def test_cli_train_kvlink(handle, data_file, tmp_path, capsys):
    from kvrag.cli import main

    model_dir = tmp_path / "model"
    handle.model.save_pretrained(model_dir)
    handle.tokenizer.save_pretrained(model_dir)
    out = tmp_path / "adapter"
    argv = [
        "train",
        "kvlink",
        "--data",
        str(data_file),
        "--model",
        str(model_dir),
        "--steps",
        "2",
        "--lora-rank",
        "2",
        "--link-tokens",
        "1",
        "--docs",
        "2",
        "--passage-order",
        "source",
        "--out",
        str(out),
        "--threads",
        "1",
    ]
    assert main(argv) == 0
    meta = json.loads((out / "kvlink.json").read_text())
    assert meta["steps"] == 2 and meta["link_tokens"] == 1 and meta["lora"]["rank"] == 2
    assert meta["config"]["passage_order"] == "source"
    assert "loss" in capsys.readouterr().out
    assert main(argv) == 2  # refuses to overwrite without --force
    assert "already holds" in capsys.readouterr().err
    further = [*argv[:-4], "--init", str(out), "--out", str(tmp_path / "further"), "--threads", "1"]
    further += ["--batch", "2", "--accumulate"]
    assert main(further) == 0
    meta = json.loads((tmp_path / "further" / "kvlink.json").read_text())
    assert meta["init"]["path"] == str(out) and meta["config"]["batch"] == 2 and not meta["config"]["batched"]
    assert main([*argv[:-4], "--steps", "0", "--out", str(tmp_path / "x")]) == 2


def _bench_example(handle):
    """The one synthetic example (and its prompt) the bench tests below run with `--synthetic 1
    --synthetic-passages 3 --synthetic-passage-tokens 40`."""
    from kvrag.bench.examples import examples_from_items
    from kvrag.layout.prompt import rag_messages
    from kvrag.qa import synthetic

    item = synthetic.generate(1, 0, n_passages=3, passage_tokens=40, count_tokens=lambda s: len(handle.encode(s)))
    ex = examples_from_items(item, source="synthetic")[0]
    return ex, rag_messages(ex.passages, ex.question)


def test_bench_measures_a_lora_adapter_on_its_own_model_against_the_base_reference(
    handle, trained, tmp_path, monkeypatch, capsys
):
    """`kvrag bench --kvlink-adapter DIR` with LoRA weights: trained kvlink runs on the adapted
    model (its own chunk caches), full_prefill and the untrained variant on the base model."""
    from kvrag.bench.config import STOP
    from kvrag.cli import main
    from kvrag.model import ModelHandle

    monkeypatch.setenv("KVRAG_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(ModelHandle, "load", lambda *a, **k: handle)
    out = tmp_path / "out"
    assert (
        main(
            [
                "bench",
                "--synthetic",
                "1",
                "--policies",
                "kvlink",
                "--repeats",
                "1",
                "--max-new-tokens",
                "4",
                "--scaling",
                "none",
                "--sweep-policies",
                "none",
                "--check-items",
                "0",
                "--synthetic-passages",
                "3",
                "--synthetic-passage-tokens",
                "40",
                "--no-footprint",
                "--no-warmup",
                "--device",
                "cpu",
                "--kvlink-adapter",
                str(trained.out),
                "--cache-dir",
                str(tmp_path / "kv"),
                "--out",
                str(out),
            ]
        )
        == 0
    )
    recs = {r["label"]: r for r in json.loads((out / "results.json").read_text())}
    meta = json.loads((out / "summary.json").read_text())["meta"]
    assert set(recs) == {"full_prefill", "kvlink", "kvlink(mode=untrained)"}
    assert not any(r["error"] for r in recs.values())
    assert meta["model"]["kvlink_adapter"]["lora"] is True
    assert "--kvlink-adapter" in meta["command"]
    assert "LoRA weights: a model of its own" in (out / "benchmarks.md").read_text()

    ex, msgs = _bench_example(handle)
    base = KVRag(handle, cache_dir=tmp_path / "kv2", kvlink_adapter=None)
    adapted = KVRag(handle, cache_dir=tmp_path / "kv2", kvlink_adapter=str(trained.out))
    base.precompute(ex.passages)
    adapted.precompute(ex.passages)
    for rag, label, kw in (
        (base, "full_prefill", {}),
        (adapted, "kvlink", {}),
        (base, "kvlink(mode=untrained)", {"mode": "untrained"}),
    ):
        policy = label.split("(")[0]
        want = rag.generate(msgs, policy=policy, max_new_tokens=4, stop=STOP, **kw)
        assert recs[label]["answer_token_ids"] == list(want.token_ids), label
        # Teacher-forced NLL of the gold answer: computed on the same model as the answer.
        gold = handle.encode(ex.answers[0])
        (lg,), _ = rag.continuations_logits(msgs, [gold], policy=policy, **kw)
        assert recs[label]["gold_nll"] == pytest.approx(-M.mean_logprob(lg, gold), abs=1e-5), label
    # The adapted model's logits differ from the base model's on the same prompt: the routing
    # above is observable, not a coincidence of equal outputs.
    la, _ = adapted.continuation_logits(msgs, [], policy="kvlink")
    lb, _ = base.continuation_logits(msgs, [], policy="kvlink", mode="untrained")
    assert not torch.allclose(la, lb, atol=1e-3)
    # A wrong adapter path is named before any model is loaded.
    monkeypatch.setattr(ModelHandle, "load", lambda *a, **k: pytest.fail("model loaded"))
    capsys.readouterr()
    assert main(["bench", "--synthetic", "1", "--kvlink-adapter", str(tmp_path / "nope"), "--out", str(out)]) == 2
    assert "nope is not a KVLink adapter directory" in capsys.readouterr().err


def test_bench_sweeps_a_lora_adapter_on_its_own_model(handle, trained, tmp_path, monkeypatch):
    """`kvrag bench --sweep-policies kvlink` with kvlink not among --policies: the swept trained
    kvlink still runs on the adapted model, not untrained on the base one."""
    from kvrag.bench.config import STOP, label_of
    from kvrag.cli import main
    from kvrag.model import ModelHandle

    monkeypatch.setenv("KVRAG_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(ModelHandle, "load", lambda *a, **k: handle)
    out = tmp_path / "out"
    argv = ["bench", "--synthetic", "1", "--policies", "full_prefill", "--repeats", "1", "--max-new-tokens", "4"]
    argv += ["--scaling", "none", "--check-items", "0", "--synthetic-passages", "3", "--synthetic-passage-tokens", "40"]
    argv += ["--sweep-policies", "kvlink", "--sweep-ratios", "0", "--sweep-limit", "1", "--no-footprint"]
    argv += ["--no-warmup", "--device", "cpu", "--kvlink-adapter", str(trained.out)]
    assert main([*argv, "--cache-dir", str(tmp_path / "kv"), "--out", str(out)]) == 0
    recs = [r for r in json.loads((out / "results.json").read_text()) if r["scenario"] == "sweep"]
    swept = {r["label"]: r for r in recs}[label_of("kvlink", {"recompute_ratio": 0.0})]
    assert not swept["error"]

    ex, msgs = _bench_example(handle)
    adapted = KVRag(handle, cache_dir=tmp_path / "kv2", kvlink_adapter=str(trained.out))
    adapted.precompute(ex.passages)
    gold = handle.encode(ex.answers[0])
    (la,), _ = adapted.continuations_logits(msgs, [gold], policy="kvlink", recompute_ratio=0.0)
    assert swept["gold_nll"] == pytest.approx(-M.mean_logprob(la, gold), abs=1e-5)
    want = adapted.generate(msgs, policy="kvlink", recompute_ratio=0.0, max_new_tokens=4, stop=STOP)
    assert swept["answer_token_ids"] == list(want.token_ids)
    # The base model's untrained links give another likelihood: the check above can fail.
    base = KVRag(handle, cache_dir=tmp_path / "kv3", kvlink_adapter=None)
    base.precompute(ex.passages)
    (lb,), _ = base.continuations_logits(msgs, [gold], policy="kvlink", mode="untrained")
    assert -M.mean_logprob(lb, gold) != pytest.approx(swept["gold_nll"], abs=1e-5)


# ---- the real model ----------------------------------------------------------------------
