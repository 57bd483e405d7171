"""Packed K/V storage formats (kvrag.store.kv_format): each format's stated error bound, its
bytes, round trips through the blob, the disk store and the hot tier, crafted headers that
claim another format (a miss, never a wrong tensor), float blobs as written before the packed
formats, and a KVRag storing int8/int4 against one storing float16."""

import json
import os
import sqlite3

import pytest
import safetensors.torch
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from helpers.corpus import DOCS as CORPUS  # noqa: E402
from helpers.corpus import prompt_for  # noqa: E402
from helpers.store_entries import blob_files  # noqa: E402

import kvrag.store.base as base_mod  # noqa: E402
import kvrag.store.blob as blob_mod  # noqa: E402
from kvrag.defaults import STORAGE_DTYPES  # noqa: E402
from kvrag.engine import KVRag  # noqa: E402
from kvrag.layout.state import CACHED, Layout, Piece  # noqa: E402
from kvrag.policies import get_policy  # noqa: E402
from kvrag.precompute.ingest import cache_fingerprint  # noqa: E402
from kvrag.store import ChunkEntry, DiskStore, make_key  # noqa: E402
from kvrag.store.base import CACHE_FORMAT_VERSION  # noqa: E402
from kvrag.store.hot import HotCache  # noqa: E402
from kvrag.store.kv_format import (  # noqa: E402
    FLOAT_FORMATS,
    GROUP,
    PACKED_FORMATS,
    STORAGE_FORMATS,
    PackedRows,
    bytes_per_token,
    decode,
    encode,
    format_fingerprint,
    format_of_fingerprint,
)

DOCS = CORPUS[:3]
FP = "fingerprint-model-a"


def _kv(L=2, H=2, T=70, D=8, seed=0) -> torch.Tensor:
    """Random K/V [L, H, T, D] with an outlier channel and an outlier token, as real keys have."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(L, H, T, D, generator=g)
    x[..., 1] *= 30.0
    x[:, :, T // 2] *= 10.0
    return x


def _bound(name: str, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The error bound the kv_format docstring states, per element."""
    if name == "float8_e4m3fn":
        return 2**-4 * x.abs() + 2**-10 * scale
    return scale / 2


def _packed_entry(name: str, fp: str = FP, T: int = 70, D: int = 8, seed: int = 0) -> tuple[ChunkEntry, torch.Tensor]:
    k, v = _kv(T=T, D=D, seed=seed), _kv(T=T, D=D, seed=seed + 1)
    (kc, ks), (vc, vs) = encode(k, name, "keys"), encode(v, name, "values")
    scales = {**{f"keys.{n}": t for n, t in ks.items()}, **{f"values.{n}": t for n, t in vs.items()}}
    ids = torch.arange(T, dtype=torch.int64) + 100 * seed
    e = ChunkEntry(format_fingerprint(fp, name), f"chunk {seed}", ids, kc, vc, {}, name, scales)
    return e, torch.stack([k, v])


def test_the_cli_choices_are_the_formats():
    assert set(STORAGE_DTYPES) == set(STORAGE_FORMATS) == set(FLOAT_FORMATS) | set(PACKED_FORMATS)


@pytest.mark.parametrize("name", list(PACKED_FORMATS))
@pytest.mark.parametrize("kind", ["keys", "values"])
@pytest.mark.parametrize("T,D", [(1, 8), (5, 8), (64, 64), (70, 128), (130, 7)])
def test_each_format_is_within_its_stated_bound(name, kind, T, D):
    x = _kv(T=T, D=D)
    codes, stats = encode(x, name, kind)
    y = decode(codes, stats, name, kind, D, "cpu", torch.float32)
    assert y.shape == x.shape and y.dtype == torch.float32
    s = stats["scale"].float()
    s = (
        s.repeat_interleave(min(GROUP, T), dim=2)[:, :, :T]
        if kind == "keys"
        else s.repeat_interleave(D // s.shape[3], 3)
    )
    err = (x - y).abs()
    assert bool((err <= _bound(name, x, s) * (1 + 1e-6) + 1e-7).all())
    # Not a vacuous bound: the format does lose precision, and the scale is not oversized.
    assert float(err.max()) > 0
    assert float(s.max()) <= float(x.abs().max()) / (7.0 if name == "int4" else 100.0)


def test_keys_are_grouped_per_channel_and_values_per_token():
    """An outlier channel costs the other key channels nothing (per-channel key scales); an
    outlier token costs the other value tokens nothing (per-token value scales)."""
    x = torch.randn(1, 1, 64, 64)
    x[..., 5] *= 1000.0  # a channel
    _, ks = encode(x, "int8", "keys")
    assert float(ks["scale"][..., 5].float().max()) > 100 * float(ks["scale"][..., :5].float().max())
    x = torch.randn(1, 1, 64, 64)
    x[:, :, 9] *= 1000.0  # a token
    _, vs = encode(x, "int8", "values")
    assert float(vs["scale"][:, :, 9].float().max()) > 100 * float(vs["scale"][:, :, :9].float().max())


@pytest.mark.parametrize("name", list(PACKED_FORMATS))
@pytest.mark.parametrize("D", [8, 7])
def test_packed_rows_expand_each_layer_as_decode_expands_each_entry(name, D):
    """Entries of 70, 5, 64, 130 and 1 tokens (whole, partial and single key groups) joined:
    each layer is bit for bit the entries' own expansions side by side, in float32 and
    rounded to bfloat16."""
    entries = [_packed_entry(name, T=t, D=D, seed=i)[0] for i, t in enumerate((70, 5, 64, 130, 1))]
    kinds = ("keys", "values")
    rows = PackedRows(
        name,
        D,
        {k: [getattr(e, k) for e in entries] for k in kinds},
        {k: [e.stats_of(k) for e in entries] for k in kinds},
        "cpu",
    )
    for dtype in (torch.float32, torch.bfloat16):
        whole = [e.expanded(torch.device("cpu"), dtype) for e in entries]
        for k in kinds:
            ref = torch.cat([getattr(e, k) for e in whole], dim=2)  # [L, Hkv, C, D]
            for layer in range(ref.shape[0]):
                got = rows.layer(k, layer, dtype)
                assert got.dtype == dtype and torch.equal(got.view(torch.int16), ref[layer].view(torch.int16))


def test_bytes_per_token_meet_the_targets_and_match_a_stored_blob():
    smollm2 = (30, 3, 64)  # layers, KV heads, head dim
    f16 = bytes_per_token("float16", *smollm2)
    assert f16 == 30 * 3 * 64 * 2 * 2 == 23040
    assert bytes_per_token("int8", *smollm2) <= 0.52 * f16
    assert bytes_per_token("float8_e4m3fn", *smollm2) <= 0.52 * f16
    assert bytes_per_token("int4", *smollm2) <= 0.3 * f16
    for name in PACKED_FORMATS:
        e, _ = _packed_entry(name, T=256, D=64)
        kv_bytes = sum(t.numel() * t.element_size() for t in (e.keys, e.values, *e.scales.values()))
        assert kv_bytes == bytes_per_token(name, 2, 2, 64, tokens=256) * 256


def test_the_fingerprint_names_the_format_and_float_formats_keep_theirs():
    for name in FLOAT_FORMATS:
        assert format_fingerprint(FP, name) == FP and format_of_fingerprint(FP) is None
    fps = {format_fingerprint(FP, name) for name in PACKED_FORMATS}
    assert len(fps) == len(PACKED_FORMATS) and FP not in fps
    for name in PACKED_FORMATS:
        assert format_of_fingerprint(format_fingerprint(FP, name)) == name
    with pytest.raises(ValueError, match="storage_dtype"):
        format_fingerprint(FP, "int3")


@pytest.mark.parametrize("name", list(PACKED_FORMATS))
def test_disk_and_hot_tier_round_trips_hold_the_packed_bytes(name, tmp_path):
    e, kv = _packed_entry(name, T=256, D=64)
    key = make_key(e.fingerprint, e.token_ids)
    with DiskStore(tmp_path / "store") as store:
        store.put(key, e)
        (path,) = blob_files(tmp_path / "store")
        float_bytes = kv.numel() * 2
        assert path.stat().st_size < 0.6 * float_bytes  # the disk holds the codes, not floats
        got = store.get(key, e.fingerprint)
        assert got is not None and got.kv_format == name
        assert torch.equal(got.keys.view(torch.uint8), e.keys.view(torch.uint8))
        assert all(torch.equal(got.scales[n], e.scales[n]) for n in e.scales)
        assert store.get(key, FP) is None  # the float fingerprint never reads it
        assert store.gc(verify=True)["corrupt"] == 0 and store.ensure_indexed(key)  # a sound blob to gc
        assert store.texts(e.fingerprint) == {key: e.text}
    want = e.expanded(torch.device("cpu"), torch.float32)
    hot = HotCache(1 << 20, torch.device("cpu"), torch.float32)
    kept = hot.put(key, got)
    assert kept.packed and kept.keys.dtype == e.keys.dtype  # the hot tier holds it packed
    assert hot.stats()["bytes"] == sum(t.numel() * t.element_size() for t in (e.keys, e.values, *e.scales.values()))
    for served in (
        got.expanded(torch.device("cpu"), torch.float32),
        hot.get(key).expanded(torch.device("cpu"), torch.float32),
    ):
        assert not served.packed and served.keys.dtype == torch.float32
        assert torch.equal(served.keys, want.keys) and torch.equal(served.values, want.values)
        assert float((served.keys - kv[0]).abs().max()) > 0  # decoded, not the originals


def _forge(data: bytes, **meta) -> bytes:
    """``data`` (a blob) with its metadata fields replaced (None: removed)."""
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    for k, v in meta.items():
        if v is None:
            header["__metadata__"].pop(k, None)
        else:
            header["__metadata__"][k] = v
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    return len(h).to_bytes(8, "little") + h + data[8 + n :]


def _read(data: bytes, fingerprint: str) -> ChunkEntry:
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    verified = blob_mod.verified_header(buf, blob_mod.checksum(data), fingerprint)
    assert verified is not None
    return blob_mod.deserialize(buf, *verified)


def test_a_header_claiming_another_format_is_corrupt_never_a_wrong_tensor():
    e, _ = _packed_entry("int8")
    data = blob_mod.serialize(e, e.token_ids)
    assert _read(data, e.fingerprint).kv_format == "int8"
    fp4 = format_fingerprint(FP, "int4")
    forged = [
        _forge(data, kv_format="int4"),  # int8 codes claimed as int4
        _forge(data, kv_format=None, kvrag_format=str(CACHE_FORMAT_VERSION)),  # claimed float
        _forge(data, kv_format="int4", fingerprint=fp4),  # and the fingerprint too: shapes refuse it
        _forge(data, kv_format="float8_e4m3fn", fingerprint=format_fingerprint(FP, "float8_e4m3fn")),
        _forge(data, kvrag_format=str(CACHE_FORMAT_VERSION)),  # a packed entry as a version-1 blob
    ]
    f = ChunkEntry(FP, "float chunk", e.token_ids, torch.randn(2, 2, 70, 8), torch.randn(2, 2, 70, 8))
    fdata = blob_mod.serialize(f, f.token_ids)
    forged += [
        _forge(fdata, kv_format="int8", fingerprint=e.fingerprint, kvrag_format="2"),  # float claimed int8
        _forge(fdata, kv_format="int8"),  # a float fingerprint with a packed header
    ]
    for data in forged:
        fp = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])["__metadata__"]["fingerprint"]
        with pytest.raises(blob_mod.Corrupt):
            _read(data, fp)


def test_a_forged_format_on_disk_is_a_miss(tmp_path):
    e, _ = _packed_entry("int4")
    key = make_key(e.fingerprint, e.token_ids)
    with DiskStore(tmp_path / "store") as store:
        store.put(key, e)
        forged = _forge(blob_mod.serialize(e, e.token_ids), kv_format="int8")
        (path,) = blob_files(tmp_path / "store")
        path.write_bytes(forged)
        con = sqlite3.connect(str(tmp_path / "store" / "blobs" / "cache.db"), isolation_level=None)
        try:
            con.execute(
                "UPDATE Cache SET size = ?, tag = ? WHERE key = ?", (len(forged), blob_mod.checksum(forged), key)
            )
        finally:
            con.close()
        assert store.get(key, e.fingerprint) is None
        assert key not in store  # dropped as corrupt


def test_float_blobs_are_written_and_read_as_before():
    """A float entry's blob is the version-1 layout a kvrag before the packed formats wrote
    (and reads): no format field, no scales."""
    f = ChunkEntry(FP, "float chunk", torch.arange(5), torch.randn(2, 2, 5, 8).half(), torch.randn(2, 2, 5, 8).half())
    data = blob_mod.serialize(f, f.token_ids)
    meta = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])["__metadata__"]
    assert meta["kvrag_format"] == str(CACHE_FORMAT_VERSION) == "1" and "kv_format" not in meta
    old = safetensors.torch.save(
        {"token_ids": f.token_ids, "keys": f.keys, "values": f.values},
        metadata={"kvrag_format": "1", "fingerprint": FP, "text": "float chunk", "n_tokens": "5"},
    )
    got = _read(old, FP)
    assert not got.packed and torch.equal(got.keys, f.keys) and torch.equal(got.values, f.values)


def test_put_refuses_an_entry_whose_format_and_fingerprint_disagree(tmp_path):
    e, _ = _packed_entry("int8")
    with DiskStore(tmp_path / "store") as store:
        for bad in (
            ChunkEntry(FP, e.text, e.token_ids, e.keys, e.values, {}, "int8", e.scales),
            ChunkEntry(e.fingerprint, e.text, e.token_ids, e.keys, e.values, {}, "int4", e.scales),
        ):
            with pytest.raises(ValueError):
                store.put(make_key(bad.fingerprint, bad.token_ids), bad)


# ---- a KVRag storing packed K/V -------------------------------------------------------
@pytest.fixture(scope="module")
def stores(handle, tmp_path_factory):
    d = tmp_path_factory.mktemp("kv")
    out = {}
    for name in ("float16", "int8", "float8_e4m3fn", "int4"):
        rag = KVRag(handle, cache_dir=d / name, storage_dtype=name, kvlink_adapter=None, hot_cache=0)
        rag.precompute(DOCS)
        out[name] = rag
    return out


def test_a_packed_store_has_its_own_keys_and_float16_keeps_todays(handle, stores):
    base = cache_fingerprint(handle.fingerprint, stores["float16"].anchor)
    assert stores["float16"].fingerprint == base
    assert stores["int8"].fingerprint == base + ".int8" and stores["int4"].fingerprint == base + ".int4"
    for name in ("int8", "int4"):
        rag = stores[name]
        entry = rag.store.get(rag.chunk_key(DOCS[0]), rag.fingerprint)
        assert entry is not None and entry.kv_format == name
        assert rag.store.get(stores["float16"].chunk_key(DOCS[0]), rag.fingerprint) is None


def _logits(rag, prompt, policy):
    return rag.prefill(prompt, policy=policy).logits.float()


def test_full_prefill_is_unaffected_and_naive_reuse_stays_close_to_float16(stores):
    """full_prefill reads no stored K/V: identical logits whatever the format. naive_reuse
    reads them: the last-token distribution's KL from the float16 store's stays below 1e-2
    with int8 (bfloat16's is ~3e-4 here), below 5e-2 with float8 and below 1.0 with int4, in
    that order, and int8 keeps the top token. Tolerances for this tiny random-weight model
    (head dim 16: one value group per head), whose attention amplifies K/V noise; a real
    model's gaps are what benchmarks/kv_formats.py measures."""
    prompt = prompt_for(DOCS)
    ref = _logits(stores["float16"], prompt, "full_prefill")
    for name in ("int8", "int4"):
        assert torch.equal(_logits(stores[name], prompt, "full_prefill"), ref)
    f16 = _logits(stores["float16"], prompt, "naive_reuse").log_softmax(-1)
    kls = []
    for name, tol in (("int8", 1e-2), ("float8_e4m3fn", 5e-2), ("int4", 1.0)):
        res = stores[name].prefill(prompt, policy="naive_reuse")
        assert res.stats.chunks_hit == len(DOCS)
        q = res.logits.float().log_softmax(-1)
        kls.append(float((f16.exp() * (f16 - q)).sum()))
        assert 0 < kls[-1] < tol, (name, kls[-1])
        if name == "int8":
            assert int(q.argmax()) == int(f16.argmax())
    assert kls == sorted(kls)


def test_the_hot_tier_of_a_packed_store_holds_codes_and_serves_the_same_answer(handle, stores):
    rag = KVRag(
        handle, cache_dir=stores["int8"].cache_dir, storage_dtype="int8", kvlink_adapter=None, hot_cache=1 << 26
    )
    prompt = prompt_for(DOCS)
    cold = rag.prefill(prompt, policy="naive_reuse")
    assert cold.stats.chunks_hit == len(DOCS) and cold.stats.chunks_hot == 0
    kept = rag.hot.get(rag.chunk_key(DOCS[0]))
    assert kept is not None and kept.packed and kept.keys.dtype == torch.int8
    warm = rag.prefill(prompt, policy="naive_reuse")
    assert warm.stats.chunks_hot == len(DOCS)
    assert torch.equal(warm.logits, cold.logits)


@pytest.mark.parametrize("name", ["int8", "int4"])
@pytest.mark.parametrize("layerwise", [True, False])
def test_packed_entries_reach_the_prefill_packed_and_place_as_their_expansion(stores, name, layerwise, monkeypatch):
    """The lookup hands the fusion engine the stored (packed) entries and counts their
    packed bytes; placed a layer at a time (a CPU's way) or all layers at once (a GPU's),
    alone or beside a float entry (a kept prefix's, say), the prefill is bit for bit the one
    from the entries expanded first."""
    rag = stores[name]
    pieces, stats = rag.pieces(rag.render(prompt_for(DOCS)))
    cached = [p for p in pieces if p.kind == CACHED]
    assert len(cached) == len(DOCS) and all(p.entry.packed for p in cached)
    assert stats.bytes_loaded == sum(p.entry.nbytes for p in cached)
    dev, dt = rag.arch.device, rag.arch.dtype
    floats = [
        Piece(p.token_ids, p.kind, entry=p.entry.expanded(dev, dt), key=p.key, span=p.span) if p.kind == CACHED else p
        for p in pieces
    ]
    first = next(i for i, p in enumerate(pieces) if p.kind == CACHED)
    mixed = [floats[first] if i == first else p for i, p in enumerate(pieces)]
    for policy in ("naive_reuse", "cacheblend"):
        rag.fusion.layerwise = layerwise
        try:
            ref = rag.fusion.prefill(Layout.build(floats), get_policy(policy))
            if layerwise:  # no packed entry is expanded whole: each layer is, as it is placed

                def whole(*args, **kwargs):
                    raise AssertionError("a packed entry was expanded whole")

                monkeypatch.setattr(base_mod, "decode", whole)
            for variant in (pieces, mixed):
                got = rag.fusion.prefill(Layout.build(variant), get_policy(policy))
                assert torch.equal(got.logits, ref.logits)
                assert all(torch.equal(a, b) for a, b in zip(got.K + got.V, ref.K + ref.V))
        finally:
            rag.fusion.layerwise = None
            monkeypatch.undo()


def test_model_info_and_cache_stats_show_the_formats(model_dir, tmp_path, capsys):
    from kvrag.cli import main

    rag = KVRag(model_dir, cache_dir=tmp_path / "kv", storage_dtype="int4", kvlink_adapter=None)
    rag.precompute(DOCS[:2])
    assert main(["model", "info", "--model", model_dir, "--storage-dtype", "int4", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["cache_fingerprint"] == rag.fingerprint
    by = info["kv_bytes_per_token_by_format"]
    assert set(by) == set(STORAGE_FORMATS) and by["float16"] == 2 * 4 * 2 * 16 * 2  # tiny llama: 4 x 2 x 16
    assert info["kv_bytes_per_token"] == by["int4"] < by["int8"] == by["float8_e4m3fn"] < by["float16"]
    assert main(["model", "info", "--model", model_dir]) == 0
    (line,) = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("KV bytes/token by format:")]
    assert "float16 512 (1x float16)" in line and f"int4 {by['int4']} (0.328x float16)" in line
    assert main(["cache", "stats", "--cache-dir", str(tmp_path / "kv"), "--json"]) == 0
    formats = json.loads(capsys.readouterr().out)["formats"]
    assert formats == {
        "int4": {"entries": 2, "vs_float16": bytes_per_token("int4", 1, 1, 64) / bytes_per_token("float16", 1, 1, 64)}
    }
    assert main(["cache", "stats", "--cache-dir", str(tmp_path / "kv")]) == 0
    assert "format      int4: 2 entries (0.281x float16's bytes per token)" in capsys.readouterr().out


# Each recompute policy's exact limit: every token recomputed, so the stored K/V (whatever
# their format) are read but change nothing (as tests/unit/test_device_invariants.py for float stores).
EXACT = {
    "cacheblend": dict(recompute_ratio=1.0),
    "a3": dict(recompute_ratio=1.0),
    "epic": dict(k_head=10_000),
    "samkv": dict(keep_ratio=1.0, recompute_ratio=1.0, adaptive_p=False, update="overwrite"),
}


@pytest.mark.parametrize("name", ["int8", "int4"])
@pytest.mark.parametrize("policy", list(EXACT))
def test_every_policy_at_its_exact_limit_equals_full_prefill_from_a_packed_store(stores, name, policy):
    rag = stores[name]
    prompt = prompt_for(DOCS)
    full = rag.generate(prompt, policy="full_prefill", max_new_tokens=6)
    out = rag.generate(prompt, policy=policy, max_new_tokens=6, **EXACT[policy])
    assert out.stats.chunks_hit == len(DOCS) and out.stats.cached_tokens > 0
    assert out.token_ids == full.token_ids
    lf, _ = rag.continuation_logits(prompt, full.token_ids[:3], policy="full_prefill")
    lp, _ = rag.continuation_logits(prompt, full.token_ids[:3], policy=policy, **EXACT[policy])
    torch.testing.assert_close(lp, lf, atol=1e-3, rtol=1e-3)


DEVICE = os.environ.get("KVRAG_TEST_DEVICE", "cpu")


@pytest.mark.parametrize("tier", ["device", "host"])
def test_a_packed_store_on_the_test_device_serves_what_the_cpu_does(stores, tier, tmp_path):
    """Expanded on the compute device (KVRAG_TEST_DEVICE=cuda: the codes and scales copied
    there, from a pinned host tier too) the K/V give the CPU's answer; the hot tier keeps the
    codes where the tier says."""
    from kvrag.testing import tiny_llama

    cpu = stores["int8"]
    rag = KVRag(
        tiny_llama(seed=0, device=DEVICE),
        cache_dir=tmp_path / "kv",
        storage_dtype="int8",
        kvlink_adapter=None,
        hot_cache=1 << 26,
        hot_tier=tier,
    )
    rag.precompute(DOCS)
    prompt = prompt_for(DOCS)
    want = cpu.prefill(prompt, policy="naive_reuse").logits
    for _ in range(2):  # from the store, then from the hot tier
        got = rag.prefill(prompt, policy="naive_reuse")
        assert got.stats.chunks_hit == len(DOCS)
        torch.testing.assert_close(got.logits.float().cpu(), want.float(), atol=1e-3, rtol=1e-3)
    kept = rag.hot.get(rag.chunk_key(DOCS[0]))
    assert kept.packed and kept.keys.dtype == torch.int8
    assert kept.keys.device.type == ("cpu" if tier == "host" else torch.device(DEVICE).type)
