"""The engine's invariants on the compute device named by ``$KVRAG_TEST_DEVICE`` (default cpu).

CI has no GPU, so there this file checks the CPU; on a GPU machine run
``KVRAG_TEST_DEVICE=cuda pytest tests/unit/test_device_invariants.py`` to check the CUDA paths: SDPA's CUDA
kernels, grouped-query expansion and folding, RoPE tables on the device, device<->host moves of cached
K/V, per-layer selection code, and half-precision compute. Every test here also compares the
device against the model's own forward or against the same model on the CPU."""

import os

import pytest
import torch
from helpers.corpus import DOCS, hf_greedy, prompt_for

from kvrag.arch import Arch
from kvrag.chunk import compute_chunk_kv
from kvrag.engine import KVRag
from kvrag.policies import policy_names
from kvrag.query.decode import output_cache
from kvrag.testing import tiny_llama

DEVICE = os.environ.get("KVRAG_TEST_DEVICE", "cpu")
FAMILIES = {
    "llama": {},
    "mistral-window": {"sliding_window": 12},  # every layer windowed, shorter than the prompt
    "qwen2": {},
    "qwen3": {},
    "smollm3": {},  # layer 3 of 4 without RoPE
    "gemma3_text": {"sliding_window": 12},  # local (windowed, base 10k) and global (base 1M) layers
    "gemma2": {},  # soft-capped attention and logits
    "olmo2": {},
    "granite": {},
}
# Each policy's exact limit: recompute everything (or, for KVLink, no link tokens = naive).
EXACT = {
    "cacheblend": dict(recompute_ratio=1.0),
    "a3": dict(recompute_ratio=1.0),
    "epic": dict(k_head=10_000),
    "samkv": dict(keep_ratio=1.0, recompute_ratio=1.0, adaptive_p=False, update="overwrite"),
    "a2ats": dict(prefill="cacheblend", recompute_ratio=1.0, topk=1.0),
}
N_NEW = 8


def _family(name):
    return name.split("-")[0]


@pytest.fixture(scope="module")
def handles():
    """family -> (handle on DEVICE, the same weights on the CPU)."""
    out = {}
    for name, extra in FAMILIES.items():
        out[name] = (
            tiny_llama(seed=3, model_type=_family(name), device=DEVICE, **extra),
            tiny_llama(seed=3, model_type=_family(name), **extra),
        )
    return out


@pytest.fixture(scope="module")
def codebook(tmp_path_factory, handles):
    """A2ATS codebooks of the tiny llama (fitted on the CPU; the policy moves them)."""
    from kvrag.policies.a2ats import calibrate as cal

    handle = handles["llama"][1]
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, 5000, (128,), generator=g).tolist() for _ in range(6)]
    books = cal.fit_codebooks(handle.arch, seqs, n_codes=16, iters=3, seed=0)
    return str(books.save(tmp_path_factory.mktemp("a2ats") / "books.safetensors"))


def _rag(handle, tmp_path, name="kv", **kw):
    rag = KVRag(handle, cache_dir=tmp_path / name, storage_dtype="float32", kvlink_adapter=None, **kw)
    rag.precompute(DOCS[:3])
    return rag


def test_handle_is_on_the_requested_device(handles):
    dev = torch.device(DEVICE)
    for on_dev, _ in handles.values():
        assert on_dev.device.type == dev.type
        assert next(on_dev.model.parameters()).device.type == dev.type


@pytest.mark.parametrize("family", list(FAMILIES))
def test_full_prefill_equals_transformers_generate(handles, family, tmp_path):
    handle = handles[family][0]
    out = _rag(handle, tmp_path).generate(prompt_for(DOCS[:3]), policy="full_prefill", max_new_tokens=N_NEW)
    assert len(out.token_ids) == N_NEW
    assert out.token_ids == hf_greedy(handle.model, out.prompt_ids, N_NEW)


# A2ATS codebooks are fitted for the tiny llama only (other families: test_policy_a2ats).
@pytest.mark.parametrize("policy,family", [(p, f) for p in EXACT for f in FAMILIES if p != "a2ats" or f == "llama"])
def test_exact_limit_of_every_policy_equals_full_prefill(handles, family, policy, codebook, tmp_path):
    params = dict(EXACT[policy], **({"codebook": codebook} if policy == "a2ats" else {}))
    rag = _rag(handles[family][0], tmp_path)
    prompt = prompt_for(DOCS[:3])
    full = rag.generate(prompt, policy="full_prefill", max_new_tokens=N_NEW)
    out = rag.generate(prompt, policy=policy, max_new_tokens=N_NEW, **params)
    assert out.stats.chunks_hit == 3 and out.stats.cached_tokens > 0
    assert out.token_ids == full.token_ids
    lf, _ = rag.continuation_logits(prompt, full.token_ids[:4], policy="full_prefill")
    lp, _ = rag.continuation_logits(prompt, full.token_ids[:4], policy=policy, **params)
    torch.testing.assert_close(lp, lf, atol=1e-3, rtol=1e-3)


def test_kvlink_without_link_tokens_equals_naive_reuse(handles, tmp_path):
    rag = _rag(handles["llama"][0], tmp_path)
    prompt = prompt_for(DOCS[:3])
    naive, _ = rag.continuation_logits(prompt, [5, 6], policy="naive_reuse")
    link0, _ = rag.continuation_logits(prompt, [5, 6], policy="kvlink", link_tokens=0)
    torch.testing.assert_close(link0, naive, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("policy", [p for p in policy_names() if p != "full_prefill"])
def test_every_policy_at_its_defaults_matches_the_cpu(handles, policy, codebook, tmp_path):
    """Selection (which tokens to recompute, keep or read) must not depend on the device: the
    same weights on DEVICE and on the CPU give the same statistics and the same answer. (With
    the default DEVICE=cpu both runs are on the CPU, and this checks only that every policy is
    deterministic; KVRAG_TEST_DEVICE=cuda makes it the device check.)"""
    params = {"codebook": codebook} if policy == "a2ats" else {}
    on_dev, on_cpu = handles["llama"]
    prompt = prompt_for(DOCS[:3])
    runs = [
        _rag(h, tmp_path, name).generate(prompt, policy=policy, max_new_tokens=N_NEW, **params)
        for h, name in ((on_dev, "dev"), (on_cpu, "cpu"))
    ]
    (d, c) = runs
    assert d.stats.chunks_hit == c.stats.chunks_hit == 3
    assert d.stats.recomputed_tokens == c.stats.recomputed_tokens
    assert d.stats.kept_tokens == c.stats.kept_tokens
    assert d.token_ids == c.token_ids


@pytest.mark.parametrize("mode", ["native", "expand", "fold"])
def test_grouped_heads_under_a_mask_give_the_same_answer_every_way(handles, mode, tmp_path):
    """However a masked attention meets grouped-query heads (the kernel's own GQA, K/V
    expanded per query head, query heads folded into rows), the device answers as the CPU does
    and selects the same tokens."""
    on_dev, on_cpu = handles["llama"]
    assert on_dev.arch.n_heads != on_dev.arch.n_kv_heads
    prompt = prompt_for(DOCS[:3])
    ref = _rag(on_cpu, tmp_path, "cpu").generate(prompt, policy="cacheblend", max_new_tokens=N_NEW)
    on_dev.arch.gqa_masked = mode
    try:
        out = _rag(on_dev, tmp_path, "dev").generate(prompt, policy="cacheblend", max_new_tokens=N_NEW)
    finally:
        on_dev.arch.gqa_masked = None
    assert out.stats.recomputed_tokens == ref.stats.recomputed_tokens > 0
    assert out.token_ids == ref.token_ids


def test_stream_equals_generate_and_the_cache_reloads_on_the_device(handles, tmp_path):
    handle = handles["llama"][0]
    prompt = prompt_for(DOCS[:3])
    first = _rag(handle, tmp_path).generate(prompt, policy="naive_reuse", max_new_tokens=N_NEW)
    # A second KVRag over the same directory reads the stored blobs back onto the device.
    again = KVRag(handle, cache_dir=tmp_path / "kv", storage_dtype="float32", kvlink_adapter=None)
    stream = again.stream(prompt, policy="naive_reuse", max_new_tokens=N_NEW)
    text = "".join(stream)
    assert stream.stats.chunks_hit == 3 and stream.token_ids == first.token_ids and text == first.text


def test_cold_reads_onto_the_device_equal_hot_entries(handles, tmp_path):
    """Chunks read from disk at every query (no hot tier) give the same logits as chunks served
    from memory. On CUDA the blob is read into page-locked host memory (bit-exact, copied to the
    GPU asynchronously); on the CPU its tensors are views of the file mapping."""
    handle = handles["llama"][0]
    prompt = prompt_for(DOCS[:3])
    cold = _rag(handle, tmp_path, hot_cache=0)
    hot = KVRag(handle, cache_dir=tmp_path / "kv", storage_dtype="float32", kvlink_adapter=None)
    runs = [rag.continuation_logits(prompt, [5, 6], policy="cacheblend") for rag in (cold, hot, cold)]
    (a, sa), (b, sb), (c, _) = runs
    assert sa.chunks_hit == sb.chunks_hit == 3 and sa.chunks_hot == 0
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(c, a, atol=0, rtol=0)
    store = cold.store
    pin = handle.device.type == "cuda"
    for key in store.texts(cold.fingerprint):
        got = store.get(key, cold.fingerprint, pin_memory=pin)
        ref = store.get(key, cold.fingerprint)
        assert got.keys.is_pinned() == pin and torch.equal(got.keys, ref.keys) and torch.equal(got.values, ref.values)


def test_host_hot_tier_serves_page_locked_copies_with_device_tier_logits(handles, tmp_path):
    """A hot tier in host RAM (``hot_tier="host"``) keeps its entries on the CPU, page-locked
    beside a CUDA device and in storage of its own (not the read buffer), and serves the same
    logits as the hot tier on the device."""
    handle = handles["llama"][0]
    prompt = prompt_for(DOCS[:3])
    device_tier = _rag(handle, tmp_path)
    host_tier = KVRag(handle, cache_dir=tmp_path / "kv", storage_dtype="float32", kvlink_adapter=None, hot_tier="host")
    for rag in (device_tier, host_tier):
        rag.continuation_logits(prompt, [5, 6], policy="cacheblend")  # the first query fills the hot tier
    (a, sa), (b, sb) = (
        rag.continuation_logits(prompt, [5, 6], policy="cacheblend") for rag in (device_tier, host_tier)
    )
    assert sb.chunks_hot == 3 and sa.chunks_hot == 3
    torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
    pin = handle.device.type == "cuda"
    held = host_tier.hot.values()
    assert len(held) == 3
    for entry in held:
        assert entry.keys.device.type == "cpu" and entry.keys.is_pinned() == pin and entry.values.is_pinned() == pin
        ref = device_tier.store.get(device_tier.chunk_key(entry.text), device_tier.fingerprint)
        assert (
            torch.equal(entry.keys, ref.keys)
            and entry.keys.untyped_storage().data_ptr() != ref.keys.untyped_storage().data_ptr()
        )


def test_rerotated_key_equals_key_at_position(handles):
    handle = handles["llama"][0]
    arch = Arch(handle.model)
    ids = list(range(100, 112))
    prefix = list(range(200, 207))
    with torch.no_grad():
        out = handle.model(torch.tensor([prefix + ids], device=handle.device), use_cache=True)
    k_true = output_cache(out).layers[0].keys[0][:, -12:]
    k_pre, _ = compute_chunk_kv(arch, [ids])[0]
    pos = torch.arange(7, 19, device=handle.device)
    k_rot = arch.rotate(k_pre[0].to(handle.device), pos)
    assert k_rot.device.type == torch.device(DEVICE).type
    torch.testing.assert_close(k_rot, k_true, atol=1e-5, rtol=1e-5)


# float16 matmuls are a GPU format; the CPU runs bfloat16.
@pytest.mark.parametrize("dtype", ["bfloat16"] + (["float16"] if DEVICE != "cpu" else []))
def test_half_precision_compute_at_ratio_one_tracks_full_prefill(dtype, tmp_path):
    handle = tiny_llama(seed=3, device=DEVICE, dtype=dtype)
    rag = KVRag(handle, cache_dir=tmp_path / "kv", storage_dtype=dtype, kvlink_adapter=None)
    rag.precompute(DOCS[:3])
    prompt = prompt_for(DOCS[:3])
    full = rag.generate(prompt, policy="full_prefill", max_new_tokens=N_NEW)
    assert full.token_ids == hf_greedy(handle.model, full.prompt_ids, N_NEW)
    lf, _ = rag.continuation_logits(prompt, full.token_ids[:4], policy="full_prefill")
    for policy in ("cacheblend", "a3"):
        lp, _ = rag.continuation_logits(prompt, full.token_ids[:4], policy=policy, recompute_ratio=1.0)
        assert lp.dtype == lf.dtype and torch.isfinite(lp).all()
        # Half-precision rounding differs between one fused pass and a chunked one; the top
        # token per position must still agree.
        assert torch.equal(lp.argmax(-1), lf.argmax(-1))
        assert (lp.float() - lf.float()).abs().max() < 0.1 * lf.float().abs().max()


@pytest.mark.skipif(
    DEVICE == "cpu",
    reason="the CPU case is tests/unit/policies/kvlink/test_tune.py::test_resumed_run_equals_the_uninterrupted_one",
)
def test_kvrag_tune_trains_and_resumes_on_the_device(tmp_path):
    """`kvrag tune`'s loop on the device: teacher answers generated there, LoRA + links trained
    there, and a checkpoint (saved from device tensors, loaded on the CPU) resumed there."""
    from kvrag.policies.kvlink import data as D
    from kvrag.policies.kvlink.config import TrainConfig
    from kvrag.policies.kvlink.train import train_kvlink

    handle = tiny_llama(seed=0, device=DEVICE)
    mix = D.Mixture({"text": [" ".join(d.split()[:60]) for d in DOCS]}, min_docs=2, max_docs=3)
    sampler = D.TaskSampler(handle, mix, link_tokens=2, max_docs=3, answer_tokens=3)
    cfg = dict(
        data="mixture",
        steps=4,
        lora_rank=2,
        link_tokens=2,
        max_docs=3,
        docs=3,
        warmup=1,
        log_every=100,
        objective="distill",
        seed=1,
    )
    straight = train_kvlink(handle, TrainConfig(**cfg), tmp_path / "a", sampler=sampler)
    train_kvlink(handle, TrainConfig(**cfg), tmp_path / "b", sampler=sampler, stop_at_step=2)
    resumed = train_kvlink(handle, TrainConfig(**cfg), tmp_path / "b", sampler=sampler, resume=True)
    assert resumed.losses == pytest.approx(straight.losses, rel=1e-4, abs=1e-5)
    assert straight.adapter.links.device.type == "cpu" and torch.isfinite(straight.adapter.links).all()
