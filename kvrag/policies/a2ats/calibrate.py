"""A²ATS calibration: fit a model's codebooks (``kvrag.policies.a2ats.codebook``) on text.

The paper fits on web text plus random uuid strings (the key-retrieval heads that needle-style
lookups rely on). kvrag takes any text a user points at (``read_texts``), the chunk texts
already ingested into a KV store (``store_texts``: in-domain text helps most), or a built-in
sample (``builtin_texts``); ``calibration_sequences`` cuts it into sequences, and
``collect_statistics`` runs the model over them to gather each (layer, KV head)'s pre-RoPE keys
and the second moment of its ``R_b``-rotated queries, from which ``fit_codebooks`` fits the
codebooks. ``calibrate`` does it all and saves the file ``find_codebooks`` looks for.

Shapes as in ``kvrag.policies.a2ats.codebook``.
"""

from __future__ import annotations

import json
import logging
import os
import random
import uuid
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import torch

from kvrag.policies.a2ats.codebook import (
    DEFAULT_CODES,
    DEFAULT_ITERS,
    DEFAULT_ROPE_OFFSET,
    MAX_CODES,
    CodebookError,
    Codebooks,
    codebook_path,
    fit_codebook,
    model_probe,
)

log = logging.getLogger("kvrag")

DEFAULT_TOKENS = 8192  # paper: 64K web text + 16K random uuids
DEFAULT_SEQ_LEN = 512
DEFAULT_UUID_FRACTION = 0.2  # the paper's 16K uuid tokens of 80K


# ---- calibration text ----------------------------------------------------------------------
def uuid_text(n_chars: int, seed: int = 0) -> str:
    """Random uuid strings (the paper mixes 16K tokens of them into its calibration set: they
    exercise the key-retrieval heads that needle-style lookups rely on)."""
    rng = random.Random(seed)
    parts, total = [], 0
    while total < n_chars:
        u = str(uuid.UUID(int=rng.getrandbits(128), version=4))
        parts.append(u)
        total += len(u) + 1
    return "\n".join(parts)


def _strings(obj) -> Iterable[str]:
    if isinstance(obj, str):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _strings(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _strings(v)


def read_texts(paths: Sequence[str | os.PathLike]) -> list[str]:
    """Calibration texts from files: ``.json`` -> every string in it (e.g. a dataset's
    passages) longer than 32 characters, ``.jsonl`` -> the same for every line, anything else
    -> the file's text. A file that yields no text is an error (CodebookError), not a
    codebook fitted on uuids alone."""
    out: list[str] = []
    for p in paths:
        p = Path(p)
        if not p.is_file():
            raise CodebookError(
                f"calibration text file {str(p)!r} "
                + ("is a directory, not a file" if p.is_dir() else "does not exist")
            )
        try:
            raw = p.read_text(encoding="utf-8", errors="replace")
        except OSError as e:
            raise CodebookError(f"cannot read calibration text file {str(p)!r}: {e.strerror or e}") from None
        got: list[str] = []
        try:
            if p.suffix.lower() == ".json":
                got.extend(s for s in _strings(json.loads(raw)) if len(s.strip()) > 32)
            elif p.suffix.lower() == ".jsonl":
                for line in raw.splitlines():
                    if line.strip():
                        got.extend(s for s in _strings(json.loads(line)) if len(s.strip()) > 32)
            elif raw.strip():
                got.append(raw)
        except json.JSONDecodeError as e:
            raise CodebookError(f"calibration text file {str(p)!r} is not valid JSON: {e}") from e
        if not got:
            what = (
                "holds no string longer than 32 characters" if p.suffix.lower() in (".json", ".jsonl") else "is empty"
            )
            raise CodebookError(f"calibration text file {str(p)!r} {what}: no calibration text in it")
        out.extend(got)
    return out


def store_texts(store) -> list[str]:
    """Calibration texts from a kvrag KV store (``DiskStore``): the chunk texts ingested into it,
    by any model — the documents the deployment retrieves, i.e. in-domain text. An empty store
    is an error (CodebookError), not a codebook fitted on uuids alone."""
    texts = [t for _, t in sorted(store.texts(None).items()) if t.strip()]
    if not texts:
        raise CodebookError(
            f"the KV store at {store.directory} holds no chunk text: ingest documents first, "
            "or calibrate on files with --text"
        )
    return texts


def builtin_texts() -> list[str]:
    """Generic English text that ships with kvrag and Python, so calibration needs no network:
    kvrag's demo corpus and the Python documentation topics (``pydoc_data``, ~100K tokens of
    technical prose). In-domain text (``--text your_documents``) is a better choice."""
    import importlib.resources

    out: list[str] = []
    try:
        demo = json.loads(importlib.resources.files("kvrag.data").joinpath("demo_corpus.json").read_text("utf-8"))
        out.extend(s for s in _strings(demo) if len(s) > 32)
    except (FileNotFoundError, ModuleNotFoundError, json.JSONDecodeError):
        pass
    try:
        from pydoc_data.topics import topics

        out.extend(topics[k] for k in sorted(topics))
    except ImportError:  # some distributions strip pydoc_data
        pass
    if not out:
        raise CodebookError("no built-in calibration text found; pass --text FILE")
    return out


def calibration_sequences(
    encode: Callable[[str], list[int]],
    texts: Sequence[str],
    n_tokens: int,
    *,
    seq_len: int = DEFAULT_SEQ_LEN,
    uuid_fraction: float = DEFAULT_UUID_FRACTION,
    seed: int = 0,
    prefix: Sequence[int] = (),
) -> list[list[int]]:
    """Token sequences of at most ``seq_len`` tokens, ~``n_tokens`` in all: ``1 - uuid_fraction``
    of them from ``texts`` (joined by blank lines), the rest random uuids. Each sequence starts
    with ``prefix`` (the BOS the model sees at the start of a prompt). Fewer tokens come back
    when the texts run out (a warning says so)."""
    if n_tokens < 1 or seq_len < 2:
        raise ValueError(f"need n_tokens >= 1 and seq_len >= 2, got {n_tokens}, {seq_len}")
    if not 0.0 <= uuid_fraction <= 1.0:
        raise ValueError(f"uuid_fraction must be in [0, 1], got {uuid_fraction}")
    body = seq_len - len(prefix)
    if body < 1:
        raise ValueError(f"seq_len {seq_len} leaves no room after the {len(prefix)}-token prefix")
    n_uuid = int(round(n_tokens * uuid_fraction))
    n_text = n_tokens - n_uuid

    def cut(ids: list[int], budget: int) -> list[list[int]]:
        seqs = []
        for s in range(0, min(len(ids), budget), body):
            piece = ids[s : min(s + body, budget)]
            if len(piece) >= 2:
                seqs.append(list(prefix) + piece)
        return seqs

    seqs: list[list[int]] = []
    if n_text and not any(t.strip() for t in texts):
        raise CodebookError("no calibration text (every text is empty); pass text, or uuid_fraction=1")
    if n_text:
        ids: list[int] = []
        for t in texts:
            ids.extend(encode(t + "\n\n"))
            if len(ids) >= n_text:
                break
        if len(ids) < n_text:
            log.warning("calibration text has only %d tokens (asked for %d)", len(ids), n_text)
        seqs += cut(ids, n_text)
    if n_uuid:
        # ~2.3 characters per token for uuid hex: generate generously, then cut.
        seqs += cut(encode(uuid_text(n_uuid * 3, seed)), n_uuid)
    if not seqs:
        raise CodebookError("calibration produced no token sequences (empty text?)")
    return seqs


# ---- fitting ---------------------------------------------------------------------------
@torch.no_grad()
def collect_statistics(arch, sequences: Sequence[Sequence[int]], rope_offset: int = DEFAULT_ROPE_OFFSET, progress=None):
    """Run the model over ``sequences`` (each alone, positions from 0).

    ``progress("tokens", n)`` is called after each sequence. Returns (h [L, Hkv, D, D]
    float64 — mean of ``q~^T q~`` over every token and every query head of the group, with
    ``q~ = q_pre R_b`` (eq. 12) —, keys [L, Hkv, N, D] float32 pre-RoPE keys, N = total tokens)."""
    L, hkv, d, H = arch.n_layers, arch.n_kv_heads, arch.head_dim, arch.n_heads
    g = H // hkv
    hsum = torch.zeros(L, hkv, d, d, dtype=torch.float64)
    count = 0
    keys: list[list[torch.Tensor]] = [[] for _ in range(L)]
    dev = arch.device
    for seq in sequences:
        t = len(seq)
        pos = torch.arange(t, device=dev)
        cs = arch.cos_sin(pos)
        # Rotating q (already at position p) by b - p gives q_pre R_b: WRoPE's query.
        cs_b = arch.cos_sin(rope_offset - pos)
        mask = pos[:, None] >= pos[None, :]
        hidden = arch.embed(torch.tensor(list(seq), dtype=torch.long))
        for layer in range(L):
            q, k, v, k_pre = arch.qkv(layer, hidden, cs)
            qb = arch.rotate(q, None, cs_b, layer=layer).double().reshape(hkv, g * t, d)
            hsum[layer] += torch.matmul(qb.transpose(1, 2), qb).cpu()  # hsum stays on the CPU
            keys[layer].append(k_pre.float().cpu())
            if layer < L - 1:
                hidden = arch.attend(layer, hidden, q, k, v, arch.windowed(layer, mask, pos, pos))
        count += g * t
        if progress is not None:
            progress("tokens", t)
    return hsum / count, torch.stack([torch.cat(k, dim=1) for k in keys])


def fit_codebooks(
    arch,
    sequences: Sequence[Sequence[int]],
    *,
    n_codes: int = DEFAULT_CODES,
    iters: int = DEFAULT_ITERS,
    rope_offset: int = DEFAULT_ROPE_OFFSET,
    seed: int = 0,
    max_keys: int | None = None,
    meta: dict | None = None,
    progress=None,
) -> Codebooks:
    """Fit one query-aware codebook per (layer, KV head) of ``arch``'s model on ``sequences``.

    ``max_keys`` caps the keys per head k-means sees (a random subset; None = all);
    ``progress(stage, n)`` is told about tokens run ("tokens", n) and layers fitted ("layers", 1)."""
    if not 1 <= n_codes <= MAX_CODES:
        raise ValueError(f"n_codes must be in 1..{MAX_CODES}, got {n_codes}")
    if iters < 0:
        raise ValueError(f"iters must be >= 0, got {iters}")
    h, keys = collect_statistics(arch, sequences, rope_offset, progress=progress)
    n = keys.shape[2]
    if n < n_codes:
        raise ValueError(f"{n} calibration tokens cannot fit {n_codes} codewords; use more tokens or fewer codes")
    gen = torch.Generator().manual_seed(seed)
    if max_keys is not None and n > max_keys:
        keys = keys[:, :, torch.randperm(n, generator=gen)[:max_keys]]
    books, chols = [], []
    for layer in range(arch.n_layers):  # the KV heads of a layer are fitted as one batch
        cb, ch = fit_codebook(keys[layer], h[layer], n_codes, iters=iters, generator=gen)
        books.append(cb)
        chols.append(ch)
        if progress is not None:
            progress("layers", 1)
    info = {
        "model_type": arch.config.model_type,
        "n_layers": arch.n_layers,
        "n_kv_heads": arch.n_kv_heads,
        "n_heads": arch.n_heads,
        "head_dim": arch.head_dim,
        "n_codes": n_codes,
        "n_tokens": int(n),
        "iters": iters,
        "rope_offset": rope_offset,
        "seed": seed,
        **(meta or {}),
    }
    return Codebooks(torch.stack(books), torch.stack(chols), model_probe(arch), info)


def calibrate(
    handle,
    *,
    texts: Sequence[str] | None = None,
    n_tokens: int = DEFAULT_TOKENS,
    n_codes: int = DEFAULT_CODES,
    iters: int = DEFAULT_ITERS,
    seq_len: int = DEFAULT_SEQ_LEN,
    uuid_fraction: float = DEFAULT_UUID_FRACTION,
    rope_offset: int = DEFAULT_ROPE_OFFSET,
    seed: int = 0,
    out: str | os.PathLike | None = None,
    progress=None,
) -> tuple[Codebooks, Path]:
    """Fit codebooks for a ``ModelHandle`` and save them to ``out`` (default
    ``$KVRAG_HOME/a2ats/<fingerprint>.safetensors``). ``texts`` None = ``builtin_texts()``."""
    texts = builtin_texts() if texts is None else list(texts)
    if not 1 <= n_codes <= MAX_CODES:
        raise ValueError(f"n_codes must be in 1..{MAX_CODES}, got {n_codes}")
    from kvrag.outpaths import check_file

    path = Path(out) if out is not None else codebook_path(handle.fingerprint)
    check_file(path, "codebook file", CodebookError)  # now, not after the model pass
    seqs = calibration_sequences(
        handle.encode,
        texts,
        n_tokens,
        seq_len=seq_len,
        uuid_fraction=uuid_fraction,
        seed=seed,
        prefix=handle.prefix_ids(),
    )
    # Too few tokens (asked for, or the text ran out): caught before the model pass, not after.
    n = sum(len(s) for s in seqs)
    if n < n_codes:
        raise ValueError(
            f"{n} calibration tokens cannot fit {n_codes} codewords; use more tokens (or text) or fewer codes"
        )
    cb = fit_codebooks(
        handle.arch,
        seqs,
        n_codes=n_codes,
        iters=iters,
        rope_offset=rope_offset,
        seed=seed,
        meta={"fingerprint": handle.fingerprint, "uuid_fraction": uuid_fraction, "seq_len": seq_len},
        progress=progress,
    )
    cb.save(path)
    return cb, path
