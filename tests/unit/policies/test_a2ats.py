"""A²ATS: query-aware VQ codebooks, windowed-RoPE scoring, decode-time top-k retrieval."""

import json
import math

import pytest
import torch
from helpers.fusion import CONFIGS, pieces_for, rand_ids, tiny

from kvrag.arch import Arch
from kvrag.layout.state import Layout
from kvrag.policies import get_policy
from kvrag.policies.a2ats import calibrate as cal
from kvrag.policies.a2ats import codebook as books
from kvrag.query.decode import FusedStepper, HFStepper
from kvrag.query.fusion import FusionEngine
from kvrag.testing import tiny_llama

# Tiny contexts: a smaller sink/window than the paper's 4/64 so that there is something to select.
SMALL = dict(sink=2, window=8)


def fit_tiny(arch, seed=0, n_codes=32):
    g = torch.Generator().manual_seed(seed)
    seqs = [rand_ids(128, g) for _ in range(6)]
    return cal.fit_codebooks(arch, seqs, n_codes=n_codes, iters=4, seed=seed)


@pytest.fixture(scope="module")
def llama_books(tmp_path_factory):
    """(model, arch, codebook path) of the tiny llama."""
    model = tiny("llama")
    arch = Arch(model)
    path = fit_tiny(arch).save(tmp_path_factory.mktemp("a2ats") / "books.safetensors")
    return model, arch, str(path)


def segments(g, n_chunks=2, chunk=30):
    return [(rand_ids(5, g), False)] + [(rand_ids(chunk, g), True) for _ in range(n_chunks)] + [(rand_ids(6, g), False)]


# ---- the quantizer itself -------------------------------------------------------------------
def test_query_aware_codes_recover_exact_topk_attention_mass():
    # Keys = a "semantic" part queries look at (dims 0-7, 24 clusters) + a loud part they
    # ignore (dims 8-15, 24 independent clusters): 576 combinations for 32 codewords.
    # Query-aware VQ spends its codewords on what moves the scores; plain VQ on the loud part.
    d, g = 16, torch.Generator().manual_seed(0)
    sem, loud = torch.randn(24, 8, generator=g) * 1.5, torch.randn(24, 8, generator=g) * 4

    def keys(n):
        a, b = torch.randint(24, (n,), generator=g), torch.randint(24, (n,), generator=g)
        return torch.cat([sem[a], loud[b]], 1) + 0.1 * torch.randn(n, d, generator=g)

    def queries(n):
        q = torch.randn(n, d, generator=g) * 2.0
        q[:, 8:] *= 0.05
        return q

    k_fit, q_fit = keys(4096), queries(4096)
    h = q_fit.T @ q_fit / len(q_fit)
    k_test, q_test = keys(2000), queries(200)
    u = q_test @ k_test.T
    p = torch.softmax(u / math.sqrt(d), -1)
    top = 60  # 3% of 2000, the paper's topk
    exact_mass = p.topk(top, -1).values.sum(-1)
    results = {}
    for qa in (True, False):
        book, chol = books.fit_codebook(
            k_fit[None], h[None], 32, iters=10, generator=torch.Generator().manual_seed(1), query_aware=qa
        )
        cb = books.Codebooks(book[None], chol[None], torch.zeros(1, 1, 1, d))
        codes = cb.codes_layer(0, k_test[None])[0].long()
        u_hat = q_test @ book[0][codes].T  # eq. 21
        mass = p.gather(1, u_hat.topk(top, -1).indices).sum(-1)
        results[qa] = (float((mass / exact_mass).mean()), float(((u - u_hat) ** 2).mean()))
    assert results[True][0] > 0.8, results
    # The paper's Observation 3: query-aware VQ approximates scores much better than plain VQ.
    assert results[True][1] < 0.2 * results[False][1], results
    assert results[False][0] < results[True][0] - 0.3, results


def test_codes_are_nearest_codewords_in_query_metric():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(500, 8, generator=g)
    a = torch.randn(8, 8, generator=g)
    h = a @ a.T + 0.1 * torch.eye(8)
    book, chol = books.fit_codebook(x[None], h[None], 16, iters=3, generator=g)
    cb = books.Codebooks(book[None], chol[None], torch.zeros(1, 1, 1, 8))
    # Chol factor is what it claims to be, and C L = C^z.
    torch.testing.assert_close(chol[0] @ chol[0].T, h.double(), atol=1e-4, rtol=1e-4)
    codes = cb.codes_layer(0, x[None])[0].long()
    diff = x[:, None, :].double() - book[0][None].double()  # [N, C, D]
    dist = torch.einsum("ncd,de,nce->nc", diff, h.double(), diff)  # eq. 14
    assert torch.equal(codes, dist.argmin(1))


def test_kmeans_finds_separated_clusters():
    g = torch.Generator().manual_seed(0)
    centers = torch.tensor([[0.0, 0.0], [10.0, 0.0], [0.0, 10.0], [10.0, 10.0]])
    x = centers.repeat(50, 1) + 0.1 * torch.randn(200, 2, generator=g)
    got = books.kmeans(x[None], 4, iters=5, generator=g)[0]
    # Every true center has a fitted center within the noise.
    assert torch.cdist(centers, got).min(1).values.max() < 0.5
    with pytest.raises(ValueError, match="k <= number of points"):
        books.kmeans(x[None], 500)


# ---- calibration, files, lookup ---------------------------------------------------------------
def test_calibrate_tiny_model_shapes_and_reload_by_fingerprint(handle, tmp_path, monkeypatch):
    monkeypatch.setenv("KVRAG_HOME", str(tmp_path))
    text = ["The red fox lives in the northern forest and hunts small rodents at dawn. " * 40]
    cb, path = cal.calibrate(handle, texts=text, n_tokens=600, n_codes=24, iters=3, seq_len=128)
    assert path == tmp_path / "a2ats" / f"{handle.fingerprint}.safetensors" and path.is_file()
    arch = handle.arch
    assert cb.codebook.shape == (arch.n_layers, arch.n_kv_heads, 24, arch.head_dim)
    assert cb.chol.shape == (arch.n_layers, arch.n_kv_heads, arch.head_dim, arch.head_dim)
    # Lower-triangular Cholesky factors with a positive diagonal.
    assert torch.equal(cb.chol, torch.tril(cb.chol)) and bool((torch.diagonal(cb.chol, dim1=-2, dim2=-1) > 0).all())
    assert cb.meta["fingerprint"] == handle.fingerprint and 500 <= cb.meta["n_tokens"] <= 600
    back = books.Codebooks.load(path)
    assert torch.equal(back.codebook, cb.codebook) and torch.equal(back.chol, cb.chol) and back.digest == cb.digest
    assert back.meta["n_codes"] == 24
    # The policy finds it for this model without being told where it is...
    found = books.find_codebooks(arch)
    assert found is not None and found.digest == cb.digest
    pol = get_policy("a2ats")
    assert pol.codebooks(arch).digest == cb.digest
    # ...and never for another model with the same shapes.
    other = tiny_llama(seed=1)
    assert books.find_codebooks(other.arch) is None
    with pytest.raises(books.CodebookError, match="no A2ATS codebook"):
        get_policy("a2ats").codebooks(other.arch)
    with pytest.raises(books.CodebookError, match="different model"):
        get_policy("a2ats", codebook=str(path)).codebooks(other.arch)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_codebook_probe_matches_the_same_model_in_half_precision(dtype):
    """A codebook fitted in float32 serves the same weights run in half precision (its probe
    keys differ by rounding only), and never another model."""
    fp32 = books.model_probe(tiny_llama(seed=0).arch)
    half = tiny_llama(seed=0)
    half.model.to(dtype)
    probe = books.model_probe(half.arch)
    assert not torch.equal(probe, fp32)  # rounding did change the keys
    assert books.probe_matches(fp32, probe) and books.probe_matches(probe, fp32)
    assert not books.probe_matches(fp32, books.model_probe(tiny_llama(seed=1).arch))


def test_broken_codebook_file_is_a_clear_error(tmp_path):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"not a safetensors file")
    with pytest.raises(books.CodebookError, match="cannot read"):
        books.Codebooks.load(bad)
    with pytest.raises(books.CodebookError, match="does not exist"):
        books.Codebooks.load(tmp_path / "missing.safetensors")


def test_calibration_sequences_mix_text_and_uuids(handle):
    enc = handle.encode
    seqs = cal.calibration_sequences(
        enc, ["alpha beta gamma delta " * 200], 1000, seq_len=100, uuid_fraction=0.25, prefix=[7]
    )
    assert all(s[0] == 7 and len(s) <= 100 for s in seqs)
    text = handle.tokenizer.decode([t for s in seqs for t in s[1:]])
    assert "alpha beta" in text and text.count("-4") >= 5  # uuid4 strings: xxxxxxxx-xxxx-4xxx-...
    assert 900 <= sum(len(s) - 1 for s in seqs) <= 1000
    with pytest.raises(ValueError, match="uuid_fraction"):
        cal.calibration_sequences(enc, ["x"], 10, uuid_fraction=1.5)


def test_read_texts(tmp_path):
    j = tmp_path / "d.json"
    j.write_text(
        json.dumps([{"ctxs": [{"title": "", "text": "a passage that is long enough to be calibration text"}]}])
    )
    t = tmp_path / "d.txt"
    t.write_text("plain text")
    assert cal.read_texts([j, t]) == ["a passage that is long enough to be calibration text", "plain text"]
    with pytest.raises(books.CodebookError, match="does not exist"):
        cal.read_texts([tmp_path / "nope.txt"])
    assert len(cal.builtin_texts()) > 10


# ---- the policy ------------------------------------------------------------------------------
@pytest.mark.parametrize("model_type", list(CONFIGS))
def test_topk_all_equals_naive_reuse_decode(model_type, tmp_path):
    # topk=1.0 reads every row through the per-head selection path: decode must equal the
    # model's own decode (HF DynamicCache) over naive_reuse's cache, step for step.
    model = tiny(model_type)
    arch = Arch(model)
    path = fit_tiny(arch, n_codes=16).save(tmp_path / "b.safetensors")
    g = torch.Generator().manual_seed(5)
    layout = Layout.build(pieces_for(arch, segments(g)))
    eng = FusionEngine(arch)
    for selection in ("per_head", "union"):
        pol = get_policy("a2ats", codebook=str(path), topk=1.0, selection=selection, **SMALL)
        res = eng.prefill(layout, pol, keep_state=True)
        naive = eng.prefill(layout, get_policy("naive_reuse"))
        torch.testing.assert_close(res.logits, naive.logits)
        toks = rand_ids(6, g)
        fused = FusedStepper(arch, res.K, res.V, res.next_position, pol, res.state).step(toks)
        hf = HFStepper(model, naive.K, naive.V, naive.next_position).step(toks)
        torch.testing.assert_close(fused, hf, atol=1e-4, rtol=1e-4)
        assert res.stats.policy_stats["a2ats.kv_read_fraction"] == 1.0


@pytest.mark.parametrize("model_type", ["llama", "mistral-window"])
def test_long_decode_through_growing_buffers_equals_the_models(model_type, tmp_path):
    """The fused decoder appends each token's K/V into buffers that grow when full (no copy of
    the cache per token): 120 single-token steps (the buffer grows once) still equal HF's decode, key
    positions of a sliding-window layer included."""
    model = tiny(model_type)
    arch = Arch(model)
    path = fit_tiny(arch, n_codes=16).save(tmp_path / "b.safetensors")
    g = torch.Generator().manual_seed(8)
    layout = Layout.build(pieces_for(arch, segments(g, n_chunks=1, chunk=20)))
    eng = FusionEngine(arch)
    pol = get_policy("a2ats", codebook=str(path), topk=1.0, **SMALL)
    res = eng.prefill(layout, pol, keep_state=True)
    naive = eng.prefill(layout, get_policy("naive_reuse"))
    fused = FusedStepper(arch, res.K, res.V, res.next_position, pol, res.state)
    hf = HFStepper(model, naive.K, naive.V, naive.next_position)
    n = layout.n
    for i, tok in enumerate(rand_ids(120, g)):
        torch.testing.assert_close(fused.step([tok]), hf.step([tok]), atol=1e-4, rtol=1e-4)
        assert fused.K[0].shape[1] == n + i + 1
    assert fused._bufs[0][0].shape[1] >= n + 120 > 2 * n  # grown more than once


def test_decode_reads_topk_rows_per_head(llama_books):
    model, arch, path = llama_books
    g = torch.Generator().manual_seed(6)
    layout = Layout.build(pieces_for(arch, segments(g, n_chunks=3, chunk=40)))
    pol = get_policy("a2ats", codebook=path, topk=0.1, **SMALL)
    res = FusionEngine(arch).prefill(layout, pol, keep_state=True)
    stepper = FusedStepper(arch, res.K, res.V, res.next_position, pol, res.state)
    seen = []
    orig = pol.decode_select

    def spy(layer, q, st):
        idx = orig(layer, q, st)
        seen.append((st.K[layer].shape[1], idx))
        return idx

    pol.decode_select = spy
    stepper.step(rand_ids(4, g))
    assert len(seen) == 4 * arch.n_layers
    read = full = 0
    for m, idx in seen:
        k = math.ceil(0.1 * m)
        assert idx.shape == (arch.n_kv_heads, 2 + 8 + k)
        # Sink and window rows always; sorted, distinct rows per head.
        assert bool((idx[:, :2] == torch.arange(2)).all()) and bool((idx[:, -8:] == torch.arange(m - 8, m)).all())
        assert bool((idx.diff(dim=1) > 0).all())
        read += idx.numel()
        full += arch.n_kv_heads * m
    # The KV heads disagree somewhere (else per-head selection would be pointless).
    assert any(not torch.equal(idx[0], idx[1]) for _, idx in seen)
    s = res.stats.policy_stats
    assert s["a2ats.decode_tokens"] == 4
    assert s["a2ats.kv_read_fraction"] == pytest.approx(read / full)
    assert s["a2ats.kv_bytes_read"] == read * 2 * arch.head_dim * 4
    # Decoded tokens got codes once they left the window.
    assert res.state.scratch["a2ats"]["codes"][0].shape[1] >= seen[-1][0] - 8


def test_topk_scores_track_exact_attention_on_model(llama_books):
    # On the tiny model's real decode queries, the rows chosen from codes carry more exact
    # attention mass than the same number of random rows: the scores carry signal.
    model, arch, path = llama_books
    g = torch.Generator().manual_seed(7)
    layout = Layout.build(pieces_for(arch, segments(g, n_chunks=4, chunk=50)))
    pol = get_policy("a2ats", codebook=path, topk=0.15, **SMALL)
    res = FusionEngine(arch).prefill(layout, pol, keep_state=True)
    stepper = FusedStepper(arch, res.K, res.V, res.next_position, pol, res.state)
    got, rnd = [], []
    orig = pol.decode_select

    def spy(layer, q, st):
        idx = orig(layer, q, st)
        p = arch.attention_probs(q, st.K[layer], None)[:, 0]  # [H, M] exact
        grp = arch.n_heads // arch.n_kv_heads
        cand = torch.arange(2, st.K[layer].shape[1] - 8)
        for h in range(arch.n_heads):
            rows = idx[h // grp]
            chosen = rows[(rows >= 2) & (rows < st.K[layer].shape[1] - 8)]
            got.append(float(p[h, chosen].sum()))
            perm = cand[torch.randperm(cand.numel(), generator=g)[: chosen.numel()]]
            rnd.append(float(p[h, perm].sum()))
        return idx

    pol.decode_select = spy
    stepper.step(rand_ids(3, g))
    assert sum(got) > 1.3 * sum(rnd), (sum(got), sum(rnd))


def test_chunk_extras_codes_equal_on_the_fly_codes(llama_books):
    model, arch, path = llama_books
    pol = get_policy("a2ats", codebook=path, **SMALL)
    g = torch.Generator().manual_seed(8)
    segs = segments(g)
    pieces = pieces_for(arch, segs)
    # First chunk carries codes from precompute time, the second does not.
    e1 = pieces[1].entry
    e1.extras = pol.chunk_extras(arch, e1.keys, e1.values, e1.token_ids)
    assert e1.extras["a2ats.codes"].dtype == torch.int16
    assert e1.extras["a2ats.codes"].shape == (arch.n_layers, arch.n_kv_heads, 30)
    layout = Layout.build(pieces)
    res = FusionEngine(arch).prefill(layout, pol, keep_state=True)
    codes = res.state.scratch["a2ats"]["codes"]
    s = res.stats.policy_stats
    # Per (token, layer): chunk 1 from its stored codes, chunk 2 and the 11 plain tokens coded here.
    L = arch.n_layers
    assert s["a2ats.codes_reused"] == 30 * L and s["a2ats.codes_computed"] == (30 + 11) * L
    cb = pol.codebooks(arch)
    for layer in range(arch.n_layers):
        # Stored codes were used for chunk 1, on-the-fly ones equal what chunk_extras would give.
        assert torch.equal(codes[layer][:, 5:35], e1.extras["a2ats.codes"][layer].long())
        e2 = pieces[2].entry
        assert torch.equal(
            codes[layer][:, 35:65],
            pol.chunk_extras(arch, e2.keys, e2.values, e2.token_ids)["a2ats.codes"][layer].long(),
        )
        # Every row's code describes the key actually in the fused cache (plain rows included).
        k_pre = arch.rotate(res.K[layer], -layout.positions)
        assert torch.equal(codes[layer], cb.codes_layer(layer, k_pre).long())
    # Codes made with another codebook are recognised and recomputed, not trusted.
    e1.extras["a2ats.codebook"] = torch.zeros(16, dtype=torch.uint8)
    e1.extras["a2ats.codes"] = torch.zeros_like(e1.extras["a2ats.codes"])
    res2 = FusionEngine(arch).prefill(layout, pol, keep_state=True)
    assert res2.stats.policy_stats["a2ats.codes_reused"] == 0
    assert torch.equal(res2.state.scratch["a2ats"]["codes"][0], codes[0])


def test_cacheblend_prefill_recodes_recomputed_rows(llama_books):
    model, arch, path = llama_books
    g = torch.Generator().manual_seed(9)
    pieces = pieces_for(arch, segments(g))
    pol = get_policy("a2ats", codebook=path, prefill="cacheblend", recompute_ratio=0.5, **SMALL)
    e1 = pieces[1].entry  # the first chunk brings stored codes, the second does not
    e1.extras = pol.chunk_extras(arch, e1.keys, e1.values, e1.token_ids)
    layout = Layout.build(pieces)
    eng = FusionEngine(arch)
    res = eng.prefill(layout, pol, keep_state=True)
    blend = eng.prefill(layout, get_policy("cacheblend", recompute_ratio=0.5))
    torch.testing.assert_close(res.logits, blend.logits)
    assert 0 < res.stats.recompute_fraction < 1
    # Stored codes count only at the layers where CacheBlend left the chunk's row as stored.
    L, n, counts = arch.n_layers, layout.n, res.state.layer_counts
    ps = res.stats.policy_stats
    assert ps["a2ats.codes_reused"] == int((L - counts[5:35]).sum()) < 30 * L
    assert ps["a2ats.codes_reused"] + ps["a2ats.codes_computed"] == L * n
    cb = pol.codebooks(arch)
    for layer in range(arch.n_layers):
        k_pre = arch.rotate(res.K[layer], -layout.positions)
        assert torch.equal(res.state.scratch["a2ats"]["codes"][layer], cb.codes_layer(layer, k_pre).long())
    # Exact limit: everything recomputed and every token read == full prefill + full decode.
    full_pol = get_policy("a2ats", codebook=path, prefill="cacheblend", recompute_ratio=1.0, topk=1.0, **SMALL)
    res = eng.prefill(layout, full_pol, keep_state=True)
    ids = layout.token_ids.tolist()
    toks = rand_ids(4, g)
    with torch.no_grad():
        ref = model(torch.tensor([ids + toks])).logits[0, len(ids) - 1 :].float()
    torch.testing.assert_close(res.logits, ref[0], atol=1e-4, rtol=1e-4)
    fused = FusedStepper(arch, res.K, res.V, res.next_position, full_pol, res.state).step(toks)
    torch.testing.assert_close(fused, ref[1:], atol=1e-4, rtol=1e-4)


def test_missing_codebook_fails_before_prefill(tmp_path, monkeypatch):
    monkeypatch.setenv("KVRAG_HOME", str(tmp_path))
    arch = Arch(tiny("llama", seed=3))
    g = torch.Generator().manual_seed(1)
    pol = get_policy("a2ats")
    assert (
        pol.chunk_extras(arch, torch.zeros(4, 2, 3, 16), torch.zeros(4, 2, 3, 16), torch.zeros(3, dtype=torch.long))
        == {}
    )
    with pytest.raises(books.CodebookError, match="kvrag calibrate a2ats"):
        FusionEngine(arch).prefill(Layout.build(pieces_for(arch, segments(g))), pol)


@pytest.mark.parametrize(
    "bad",
    [
        dict(topk=0),
        dict(topk=1.5),
        dict(topk="many"),
        dict(window=0),
        dict(sink=-1),
        dict(sink=1.5),
        dict(rope_offset=-1),
        dict(selection="all"),
        dict(group_reduce="max"),
        dict(prefill="epic"),
        dict(recompute_ratio=2.0),
        dict(codebook="/nonexistent/books.safetensors"),
        dict(top_k=3),
    ],
)
def test_bad_params_raise(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):  # the message names the parameter
        get_policy("a2ats", **bad)


# ---- engine + CLI --------------------------------------------------------------------------
DOCS = [
    "The red fox lives in the northern forest and hunts small rodents at dawn. " * 3,
    "Mount Kelvar is the tallest peak of the Arden range, at 4,210 metres. " * 3,
    "The river Lenne flows from the Varn Mountains to the eastern sea. " * 3,
]


def test_kvrag_for_a2ats_checks_its_codebook_up_front_and_stores_codes_with_it(handle, tmp_path, monkeypatch):
    """KVRag(policy="a2ats") without a codebook fails at construction (not once chunks are
    cached and the first prompt hits them); with codebook=PATH, its chunk codes are stored
    at precompute by that configured policy, with no ingest_policies given."""
    from kvrag.engine import KVRag

    monkeypatch.setenv("KVRAG_HOME", str(tmp_path / "home"))  # no codebook to find
    with pytest.raises(books.CodebookError, match="kvrag calibrate a2ats"):
        KVRag(handle, cache_dir=tmp_path / "kv", policy="a2ats")
    _, path = cal.calibrate(
        handle, texts=DOCS * 4, n_tokens=400, n_codes=16, iters=2, seq_len=128, out=tmp_path / "books.safetensors"
    )
    rag = KVRag(handle, cache_dir=tmp_path / "kv", policy="a2ats", codebook=str(path), **SMALL)
    assert rag.ingest_policies == [rag.policy]
    keys = rag.precompute(DOCS)
    assert all("a2ats.codes" in rag.store.get(k, rag.fingerprint).extras for k in keys)
    prompt = "Answer from the passages.\n\n" + "\n\n".join(DOCS) + "\n\nQuestion: Where does the fox live?\nAnswer:"
    out = rag.generate(prompt, max_new_tokens=2)
    assert out.stats.chunks_hit == 3
    assert out.stats.policy_stats["a2ats.codes_reused"] == out.stats.cached_tokens * rag.arch.n_layers


def test_kvrag_precompute_stores_codes_and_decode_reports_bytes(handle, tmp_path, monkeypatch):
    from kvrag.engine import KVRag

    monkeypatch.setenv("KVRAG_HOME", str(tmp_path))
    cal.calibrate(handle, texts=DOCS * 4, n_tokens=400, n_codes=16, iters=2, seq_len=128)
    rag = KVRag(
        handle,
        cache_dir=tmp_path / "kv",
        policy="a2ats",
        ingest_policies=["a2ats"],
        storage_dtype="float32",
        **SMALL,
    )
    keys = rag.precompute(DOCS)
    entry = rag.store.get(keys[0], rag.fingerprint)
    assert entry.extras["a2ats.codes"].shape == (4, 2, len(rag.chunk_ids(DOCS[0])))
    prompt = "Answer from the passages.\n\n" + "\n\n".join(DOCS) + "\n\nQuestion: Where does the fox live?\nAnswer:"
    out = rag.generate(prompt, max_new_tokens=6, topk=0.05)
    s = out.stats
    assert s.chunks_hit == 3 and s.policy == "a2ats" and len(out.token_ids) == 6
    ps = s.policy_stats
    assert ps["a2ats.codes_reused"] == s.cached_tokens * rag.arch.n_layers
    assert ps["a2ats.decode_tokens"] == 5  # the first token comes from the prefill
    assert 0 < ps["a2ats.kv_read_fraction"] < 0.5
    # topk=1.0 reproduces naive reuse's answer token for token.
    naive = rag.generate(prompt, policy="naive_reuse", max_new_tokens=6)
    assert rag.generate(prompt, max_new_tokens=6, topk=1.0).token_ids == naive.token_ids


def test_cli_calibrate_a2ats(handle, tmp_path, capsys):
    from kvrag.cli import main

    model_dir = tmp_path / "model"
    handle.model.save_pretrained(model_dir)
    handle.tokenizer.save_pretrained(model_dir)
    text = tmp_path / "corpus.txt"
    text.write_text(" ".join(DOCS) * 5)
    out = tmp_path / "books.safetensors"
    code = main(
        [
            "calibrate",
            "a2ats",
            "--model",
            str(model_dir),
            "--tokens",
            "500",
            "--codes",
            "16",
            "--iters",
            "2",
            "--text",
            str(text),
            "--out",
            str(out),
            "--home",
            str(tmp_path),
            "--json",
        ]
    )
    assert code == 0
    info = json.loads(capsys.readouterr().out)
    assert info["path"] == str(out) and info["codes"] == 16 and info["layers"] == 4
    assert books.Codebooks.load(out).codebook.shape == (4, 2, 16, 16)
    # User errors are exit code 2 with a message, not a traceback.
    assert main(["calibrate", "a2ats", "--model", str(model_dir), "--codes", "0", "--home", str(tmp_path)]) == 2
    assert (
        main(
            [
                "calibrate",
                "a2ats",
                "--model",
                str(model_dir),
                "--tokens",
                "10",
                "--codes",
                "64",
                "--text",
                str(text),
                "--out",
                str(out),
                "--home",
                str(tmp_path),
            ]
        )
        == 2
    )
    assert "codewords" in capsys.readouterr().err


def test_cli_calibrate_a2ats_on_the_documents_of_a_kv_store(handle, tmp_path, capsys, monkeypatch):
    # In-domain calibration text is what helps A2ATS most: --store fits on the chunk texts a
    # KVRag ingested (any model's), together with --text files.
    from kvrag.cli import main

    model_dir = tmp_path / "model"
    handle.model.save_pretrained(model_dir)
    handle.tokenizer.save_pretrained(model_dir)
    store_dir = tmp_path / "kv"
    from kvrag.engine import KVRag

    KVRag(handle, cache_dir=store_dir).precompute(DOCS)
    extra = tmp_path / "extra.txt"
    extra.write_text("An extra calibration document about lighthouses and their keepers. " * 3)
    seen = []
    real = cal.calibration_sequences

    def spy(encode, texts, *args, **kwargs):
        seen.append(list(texts))
        return real(encode, texts, *args, **kwargs)

    monkeypatch.setattr(cal, "calibration_sequences", spy)
    out = tmp_path / "books.safetensors"
    code = main(
        [
            "calibrate",
            "a2ats",
            "--model",
            str(model_dir),
            "--tokens",
            "400",
            "--codes",
            "16",
            "--iters",
            "2",
            "--store",
            str(store_dir),
            "--text",
            str(extra),
            "--out",
            str(out),
            "--home",
            str(tmp_path),
            "--json",
        ]
    )
    assert code == 0 and out.is_file()
    assert sorted(seen[0]) == sorted([extra.read_text(), *DOCS])


def test_calibrate_checks_text_tokens_and_output_before_the_model_pass(handle, tmp_path, monkeypatch):
    def boom(*a, **k):
        raise AssertionError("the model pass ran before the input was checked")

    monkeypatch.setattr(cal, "collect_statistics", boom)
    out = tmp_path / "cb.safetensors"
    # Text that runs out: fewer tokens than codewords.
    with pytest.raises(ValueError, match="codewords"):
        cal.calibrate(handle, texts=["a few words"], n_tokens=400, n_codes=64, uuid_fraction=0.0, out=out)
    with pytest.raises(books.CodebookError, match="no calibration text"):
        cal.calibrate(handle, texts=["", "  "], n_tokens=400, n_codes=16, out=out)
    with pytest.raises(books.CodebookError, match="is a directory"):
        cal.calibrate(handle, texts=[" ".join(DOCS)], n_tokens=400, n_codes=16, out=tmp_path)
    assert not out.exists()
    # read_texts: a file that yields no text is an error, not a codebook fitted on uuids.
    (tmp_path / "nostr.json").write_text('[1, {"a": "short"}]')
    (tmp_path / "empty.txt").write_text("")
    for name in ("nostr.json", "empty.txt"):
        with pytest.raises(books.CodebookError, match="no calibration text"):
            cal.read_texts([tmp_path / name])


# ---- the real default model ---------------------------------------------------------------


@pytest.mark.parametrize("model_type", ["mistral-window", "qwen2-window"])
def test_sliding_window_layers_pick_only_rows_the_layer_can_see(model_type, tmp_path):
    # A sliding-window layer (Mistral's 8 here) attends to its last 8 positions only: a row
    # behind that is masked after selection, so a top-k pick there is a wasted read that
    # displaces a row the layer does see. With a2ats' own window (2) inside the layer's and a
    # budget k >= the 6 visible candidates, every visible row is picked: with a window on every
    # layer (Mistral) decode equals the model's; on any windowed layer (Qwen2's upper layers
    # only) no row the layer cannot see is read.
    model = tiny(model_type)
    arch = Arch(model)
    path = fit_tiny(arch, n_codes=16).save(tmp_path / "b.safetensors")
    g = torch.Generator().manual_seed(9)
    layout = Layout.build(pieces_for(arch, segments(g, n_chunks=2, chunk=30)))
    eng = FusionEngine(arch)
    pol = get_policy("a2ats", codebook=str(path), topk=0.1, sink=0, window=2)
    res = eng.prefill(layout, pol, keep_state=True)
    naive = eng.prefill(layout, get_policy("naive_reuse"))
    fused = FusedStepper(arch, res.K, res.V, res.next_position, pol, res.state, res.positions)
    hf = HFStepper(model, naive.K, naive.V, naive.next_position)
    seen = []
    orig = pol.decode_select

    def spy(layer, q, st):
        idx = orig(layer, q, st)
        seen.append((layer, st.pos, st.K[layer].shape[1], idx))
        return idx

    pol.decode_select = spy
    every_layer = all(w is not None for w in arch.windows)
    for tok in rand_ids(4, g):
        out = fused.step([tok])
        if every_layer:
            torch.testing.assert_close(out, hf.step([tok]), atol=1e-4, rtol=1e-4)
    windowed = [s for s in seen if arch.windows[s[0]] is not None]
    assert windowed
    for layer, _pos, m, idx in windowed:
        # Prompt rows sit at positions 0..m-1 here: a row is visible iff m - 1 - row < 8.
        assert bool((idx >= m - arch.windows[layer]).all()), (layer, m, idx)
