"""The formats stored K/V are kept in: a float dtype, or a packed format with per-group scales.

Float formats (``float32``, ``float16``, ``bfloat16``): the tensors as computed, rounded to
the dtype; their dtype says which, so they share one cache fingerprint (what stores written
before the packed formats hold).

Packed formats hold codes and, per group of ``GROUP`` elements, a float16 scale (and for
``int4`` a float16 zero point). Keys are grouped per channel (each of the D channels over
``GROUP`` consecutive tokens) and values per token (each token over ``GROUP`` consecutive
channels): keys have outlier *channels* and values do not, so a per-token key group would
spend its range on one channel (KIVI, Liu et al. 2024, found the same). Bounds, for an element
``x`` of a group with stored scale ``s`` (the decoded value in float32, before its cast to the
compute dtype):

- ``int8``: symmetric absmax, ``s >= absmax / 127``; codes int8 in [-127, 127];
  ``|x - x̂| <= s / 2``.
- ``int4``: asymmetric min/max, ``z <= min``, ``s >= (max - z) / 15``; codes 0..15, two per
  byte along D; ``|x - x̂| <= s / 2``.
- ``float8_e4m3fn``: symmetric absmax scale, ``s >= absmax / 448``, codes float8 e4m3
  (3 mantissa bits); ``|x - x̂| <= 2**-4 * |x| + 2**-10 * s`` (relative rounding of a normal
  e4m3 number, absolute below its smallest normal).

Scales are rounded *up* (zero points down) to float16, so no code is ever clamped and the bounds
hold for the stored scale. A packed format's fingerprint is the cache fingerprint with
``".<format>"`` appended (``format_fingerprint``): its entries have keys of their own, and a
blob whose header names another format than its fingerprint is refused (``kvrag.store.blob``).

Tensor names of a packed entry (``ChunkEntry.scales``): ``keys.scale`` [L, Hkv, ceil(T/G), D],
``values.scale`` [L, Hkv, T, D/g] (g = ``value_group(D)``), and for ``int4`` ``keys.zero`` /
``values.zero`` of the same shapes; codes ``keys``/``values`` [L, Hkv, T, D] (int8, float8)
or [L, Hkv, T, ceil(D/2)] uint8 (int4).
"""

from __future__ import annotations

import math
import sys

import torch

#: Float storage formats -> their dtype.
FLOAT_FORMATS: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
#: Packed formats -> the dtype of their codes.
PACKED_FORMATS: dict[str, torch.dtype] = {
    "int8": torch.int8,
    "int4": torch.uint8,
    "float8_e4m3fn": torch.float8_e4m3fn,
}
#: Every storage format ``KVRag(storage_dtype=...)`` and ``--storage-dtype`` accept.
STORAGE_FORMATS: tuple[str, ...] = (*FLOAT_FORMATS, *PACKED_FORMATS)

#: Elements per scale: tokens per key channel group, channels per value token group. 64 keeps
#: the scales' overhead at 1/32 byte per element (int8: 0.516x float16's bytes, int4: 0.281x).
GROUP = 64

_QMAX = {"int8": 127.0, "float8_e4m3fn": 448.0}
_INT4_LEVELS = 15.0


def check_format(name: object) -> str:
    if name not in STORAGE_FORMATS:
        raise ValueError(f"storage_dtype must be one of {', '.join(STORAGE_FORMATS)}, got {name!r}")
    return str(name)


def is_packed(name: str) -> bool:
    return name in PACKED_FORMATS


def format_fingerprint(fingerprint: str, name: str) -> str:
    """The cache fingerprint of entries stored as ``name``: ``fingerprint`` itself for a float
    format (stores written before the packed formats stay readable), else with ``.<name>``."""
    check_format(name)
    return f"{fingerprint}.{name}" if is_packed(name) else fingerprint


def format_of_fingerprint(fingerprint: str) -> str | None:
    """The packed format a fingerprint names (``format_fingerprint``), or None (a float one)."""
    tail = fingerprint.rpartition(".")[2] if "." in fingerprint else ""
    return tail if tail in PACKED_FORMATS else None


def value_group(head_dim: int) -> int:
    """Channels per value scale: ``GROUP`` where it divides the head dim, else the whole head."""
    return GROUP if head_dim % GROUP == 0 else head_dim


def bytes_per_token(name: str, n_layers: int, n_kv_heads: int, head_dim: int, tokens: int = GROUP) -> float:
    """Stored K/V bytes per token of a chunk of ``tokens`` tokens (the key scales are per
    group of ``GROUP`` tokens: a shorter chunk pays a whole group's)."""
    check_format(name)
    n = n_layers * n_kv_heads
    if name in FLOAT_FORMATS:
        return 2.0 * n * head_dim * FLOAT_FORMATS[name].itemsize
    code = math.ceil(head_dim / 2) if name == "int4" else head_dim
    per_scale = 4 if name == "int4" else 2  # float16 scale (+ float16 zero point)
    key_scales = math.ceil(tokens / GROUP) * head_dim * per_scale / tokens
    value_scales = head_dim // value_group(head_dim) * per_scale
    return n * (2 * code + key_scales + value_scales)


def storage_itemsize(name: str) -> int:
    """Whole bytes per stored element, scales included, rounded up: an upper bound for sizing."""
    check_format(name)
    return FLOAT_FORMATS[name].itemsize if name in FLOAT_FORMATS else 2


# ---- encoding ----------------------------------------------------------------------------
# Rounded to nearest, a float16 is within 2**-11 of a normal value and 2**-25 of a subnormal
# one: nudged by more than that first, it lands on the wanted side. (Plain arithmetic, not
# ``torch.nextafter``: encoding runs on whatever device computed the K/V.)
_F16_MIN_NORMAL = 2.0**-14


def _round_up_f16(x: torch.Tensor) -> torch.Tensor:
    """``x`` (>= 0, float32) as a float16 >= it (at least float16's smallest normal number)."""
    return (x.clamp(min=_F16_MIN_NORMAL) * (1 + 2.0**-10)).to(torch.float16)


def _round_down_f16(x: torch.Tensor) -> torch.Tensor:
    """``x`` (float32) as a float16 <= it."""
    return (x - x.abs() * 2.0**-10 - 2.0**-24).to(torch.float16)


def _grouped(x: torch.Tensor, kind: str) -> tuple[torch.Tensor, int]:
    """``x`` [L, Hkv, T, D] as groups, and the dim a group spans: keys [L, Hkv, nG, G, D]
    (T padded with copies of its last token, which change no group's min or max), values
    [L, Hkv, T, D/g, g]."""
    L, H, T, D = x.shape
    if kind == "keys":
        g = min(GROUP, T)
        pad = -T % g
        if pad:
            x = torch.cat([x, x[:, :, -1:].expand(L, H, pad, D)], dim=2)
        return x.reshape(L, H, -1, g, D), 3
    g = value_group(D)
    return x.reshape(L, H, T, D // g, g), 4


def _expand_stat(s: torch.Tensor, kind: str, shape: torch.Size) -> torch.Tensor:
    """A per-group statistic back to ``shape`` [L, Hkv, T, D] (float32)."""
    T, D = shape[2], shape[3]
    s = s.float()
    if kind == "keys":
        g = min(GROUP, T)
        return s.repeat_interleave(g, dim=2)[:, :, :T]
    return s.repeat_interleave(value_group(D), dim=3)


def encode(x: torch.Tensor, name: str, kind: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``x`` [L, Hkv, T, D] (keys or values, ``kind``) in packed format ``name`` -> (codes,
    {"scale": ..., "zero": ...}) on ``x``'s device (shapes in the module docstring). Raises
    ValueError if a scale is not finite in float16 (K/V beyond its range)."""
    if not is_packed(name):
        raise ValueError(f"{name!r} is not a packed format")
    if kind not in ("keys", "values"):
        raise ValueError(f"kind must be 'keys' or 'values', got {kind!r}")
    xf = x.float()
    xg, dim = _grouped(xf, kind)
    if name == "int4":
        lo, hi = xg.amin(dim), xg.amax(dim)
        zero = _round_down_f16(lo)
        scale = _round_up_f16((hi - zero.float()) / _INT4_LEVELS)
        stats = {"scale": scale, "zero": zero}
    else:
        absmax = xg.abs().amax(dim)
        scale = _round_up_f16(absmax / _QMAX[name])
        stats = {"scale": scale}
    if not all(bool(torch.isfinite(t).all()) for t in stats.values()):
        raise ValueError(f"K/V beyond float16's range: their {name} scales are not finite")
    s = _expand_stat(stats["scale"], kind, x.shape)
    if name == "int4":
        q = ((xf - _expand_stat(stats["zero"], kind, x.shape)) / s).round_().clamp_(0, _INT4_LEVELS).to(torch.uint8)
        if q.shape[3] % 2:
            q = torch.cat([q, torch.zeros_like(q[..., :1])], dim=3)
        codes = q[..., 0::2] | (q[..., 1::2] << 4)
    elif name == "int8":
        codes = (xf / s).round_().clamp_(-127, 127).to(torch.int8)
    else:
        codes = (xf / s).clamp_(-448, 448).to(torch.float8_e4m3fn)
    return codes.contiguous(), {k: v.contiguous() for k, v in stats.items()}


def decode(
    codes: torch.Tensor,
    stats: dict[str, torch.Tensor],
    name: str,
    kind: str,
    head_dim: int,
    device: torch.device | str,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Codes and scales (``encode``) -> [L, Hkv, T, D] in ``dtype`` on ``device``. The packed
    bytes are moved first (asynchronously from pinned memory) and expanded there: a GPU gets
    the small tensors, never a float copy made on the host."""
    codes = codes.to(device=device, non_blocking=True)
    stats = {k: v.to(device=device, non_blocking=True) for k, v in stats.items()}
    q = _codes_as_float(codes, name, head_dim)
    L, H, T, D = q.shape
    out = torch.empty((L, H, T, D), dtype=torch.float32, device=q.device)
    scale = stats["scale"].float()
    zero = stats["zero"].float() if "zero" in stats else None
    # Each group's statistic broadcast over a view of its group (one pass writing the output),
    # not repeated out to [L, Hkv, T, D] first (a float copy per statistic).
    if kind == "keys":
        g = min(GROUP, T)
        whole = T // g  # groups of g tokens; the last group may be shorter
        if whole:
            n = whole * g
            _scaled(out[:, :, :n].view(L, H, whole, g, D), q[:, :, :n].view(L, H, whole, g, D), scale, zero, whole)
        if whole * g < T:
            _scaled(
                out[:, :, whole * g :],
                q[:, :, whole * g :],
                scale[:, :, -1:],
                None if zero is None else zero[:, :, -1:],
            )
    else:
        g = value_group(D)
        s5, z5 = scale.unsqueeze(-1), None if zero is None else zero.unsqueeze(-1)
        _scaled(out.view(L, H, T, D // g, g), q.view(L, H, T, D // g, g), s5, z5)
    return out if dtype == torch.float32 else out.to(dtype)


def _codes_as_float(codes: torch.Tensor, name: str, head_dim: int) -> torch.Tensor:
    """Codes [..., W] as float32 [..., D] (int4: two codes a byte, low nibble first). Made
    float in one pass of their own: the scaling that follows then runs on one dtype, where
    mixing integer codes and float scales in it runs ~2x slower on a CPU."""
    if name == "int4":
        if sys.byteorder == "little":
            # Each byte b as the int16 (b & 0xF) | (b >> 4) << 8: its two bytes in memory are
            # the two codes in order; one vectorised pass, where interleaving two uint8
            # tensors (torch.stack) writes byte by byte.
            wide = codes.to(torch.int16)
            pair = wide & 0xF0
            pair <<= 4
            pair |= wide & 0xF
            codes = pair.view(torch.uint8)
        else:
            codes = torch.stack([codes & 0xF, codes >> 4], dim=-1).flatten(-2)
        codes = codes[..., :head_dim]
    return codes.float()


def _scaled(
    out: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, key_groups: int = 0
) -> None:
    """``out = q * scale (+ zero)`` (``out`` may be ``q``); ``key_groups``: ``out``/``q`` are
    keys viewed as [L, Hkv, groups, G, D], whose first ``key_groups`` scale rows [L, Hkv,
    groups, D] each group reads. A product then a sum, not ``addcmul``: with a statistic
    broadcast along the last dim (a value group's) a CPU's ``addcmul`` runs ~5x slower than
    the two."""
    if key_groups:
        scale = scale[:, :, :key_groups, None]
        zero = None if zero is None else zero[:, :, :key_groups, None]
    torch.mul(q, scale, out=out)
    if zero is not None:
        out.add_(zero)


class PackedRows:
    """Packed entries of one format joined along their tokens (C = sum T_i) and expanded one
    layer at a time, as the fusion engine places them: a layer's float rows (a few MB) stay
    in a CPU's cache, where expanding whole entries writes every layer's floats to fresh
    memory first and the placement reads them back. Every element equals what ``decode``
    gives for its own entry: the key groups stay the entry's (a token reads its group's
    scale through ``_group_of``), and the arithmetic is ``decode``'s.

    codes: per kind (``"keys"``, ``"values"``), each entry's codes [L, Hkv, T_i, W]; stats:
    per kind, each entry's {"scale": ..., "zero": ...} (``encode``'s shapes). The packed
    bytes are moved to ``device`` here, once."""

    def __init__(
        self,
        name: str,
        head_dim: int,
        codes: dict[str, list[torch.Tensor]],
        stats: dict[str, list[dict[str, torch.Tensor]]],
        device: torch.device | str,
    ) -> None:
        if not is_packed(name):
            raise ValueError(f"{name!r} is not a packed format")
        self.name, self.head_dim = name, head_dim
        self.codes = {k: [c.to(device=device, non_blocking=True) for c in cs] for k, cs in codes.items()}
        # The statistics are small (1/32 of the codes' elements): joined for every layer at once.
        self.stats = {
            kind: {
                s: torch.cat([d[s] for d in per_entry], dim=2).to(device=device, non_blocking=True).float()
                for s in per_entry[0]
            }
            for kind, per_entry in stats.items()
        }
        # Token -> its key group's row in the joined key statistics: decode's rule per entry
        # (groups of min(GROUP, T) tokens, the last group taking the remainder).
        rows, first = [], 0
        for c, st in zip(self.codes["keys"], stats["keys"]):
            t = c.shape[2]
            rows.append(first + torch.arange(t) // min(GROUP, t))
            first += st["scale"].shape[2]
        self._group_of = torch.cat(rows).to(device=device, non_blocking=True)  # [C]

    def layer(self, kind: str, layer: int, dtype: torch.dtype) -> torch.Tensor:
        """One layer of ``kind`` (``"keys"``, ``"values"``), every entry's tokens in order:
        [Hkv, C, D] in ``dtype`` on the codes' device."""
        q = _codes_as_float(torch.cat([c[layer] for c in self.codes[kind]], dim=1), self.name, self.head_dim)
        H, C, D = q.shape  # [Hkv, C, D]
        stats = self.stats[kind]
        # In place over the float codes: no other [Hkv, C, D] tensor is written.
        if kind == "keys":
            rows = self._group_of
            zero = stats["zero"][layer].index_select(1, rows) if "zero" in stats else None
            _scaled(q, q, stats["scale"][layer].index_select(1, rows), zero)
        else:
            g = value_group(D)
            scale = stats["scale"][layer].unsqueeze(-1)  # [Hkv, C, D/g, 1]
            zero = stats["zero"][layer].unsqueeze(-1) if "zero" in stats else None
            view = q.view(H, C, D // g, g)
            _scaled(view, view, scale, zero)
        return q if dtype == torch.float32 else q.to(dtype)


# ---- validation --------------------------------------------------------------------------
def stat_names(name: str) -> tuple[str, ...]:
    """The names ``ChunkEntry.scales`` holds for packed format ``name``."""
    kinds = ("scale", "zero") if name == "int4" else ("scale",)
    return tuple(f"{part}.{k}" for part in ("keys", "values") for k in kinds)


def packed_problem(
    name: str, codes_k: torch.Tensor, codes_v: torch.Tensor, stats: dict[str, torch.Tensor], n_tokens: int
) -> str | None:
    """Why codes and scales cannot be a ``name`` entry of ``n_tokens`` tokens, or None: every
    shape and dtype is checked, so an entry that passes expands without error (a crafted blob
    with a valid checksum included)."""
    if name not in PACKED_FORMATS:
        return f"unknown K/V format {name!r}"
    if sorted(stats) != sorted(stat_names(name)):
        return f"{name} entry holds scales {sorted(stats)}, expected {sorted(stat_names(name))}"
    want_dtype = PACKED_FORMATS[name]
    for part, c in (("keys", codes_k), ("values", codes_v)):
        if c.dtype != want_dtype or c.dim() != 4 or c.shape[2] != n_tokens:
            return f"{part} codes {tuple(c.shape)} {c.dtype}, expected [L, Hkv, {n_tokens}, *] {want_dtype}"
    if codes_k.shape != codes_v.shape:
        return f"keys codes {tuple(codes_k.shape)} and values codes {tuple(codes_v.shape)} differ"
    L, H, T, width = codes_k.shape
    ks = stats["keys.scale"]
    D = ks.shape[-1] if ks.dim() == 4 else -1
    # int4 packs two channels a byte: the key scales (one per channel) say which of 2*width
    # and 2*width - 1 it is; the entry's layout check pins the model's.
    if D not in ((2 * width, 2 * width - 1) if name == "int4" else (width,)):
        return f"{name} key scales {tuple(ks.shape)} do not fit codes {tuple(codes_k.shape)}"
    g = min(GROUP, T)
    want = {"keys": (L, H, -(-T // g), D), "values": (L, H, T, D // value_group(D))}
    for n, t in stats.items():
        if tuple(t.shape) != want[n.partition(".")[0]] or t.dtype != torch.float16:
            return f"{name} {n} {tuple(t.shape)} {t.dtype}, expected {want[n.partition('.')[0]]} float16"
    return None


def head_dim_of(stats: dict[str, torch.Tensor]) -> int:
    """The head dim D of a packed entry's scales (``packed_problem`` checked)."""
    return int(stats["keys.scale"].shape[-1])


def formats_held(fingerprints: list[str]) -> dict[str, dict[str, float | int]]:
    """What ``kvrag cache stats`` says of a store's formats: per format among the entries'
    ``fingerprints`` (``"float"``: any float dtype, which the fingerprint does not name), its
    entries and its bytes per token as a fraction of float16's (at a head dim of 64 and
    chunks of whole scale groups; a float store's depends on its dtype: 1 for float16)."""
    out: dict[str, dict[str, float | int]] = {}
    for fp in fingerprints:
        name = format_of_fingerprint(fp) or "float"
        rec = out.setdefault(name, {"entries": 0})
        rec["entries"] = int(rec["entries"]) + 1
        if name != "float":
            rec["vs_float16"] = bytes_per_token(name, 1, 1, 64) / bytes_per_token("float16", 1, 1, 64)
    return out


# ---- which format to store in ----------------------------------------------------------------
#: The formats a corpus is planned in, most faithful first, as measured against the float16
#: store (docs/cache.md, "Which format"): ``int8`` kept 95-100% of the answers at 0.52x the
#: bytes (SmolLM2 held out under every policy measured; Gemma 3's yardstick, n = 100: 99% under
#: its default); what ``int4`` (0.28x) costs is the model's (Gemma 3's default kept 98/100
#: answers, SmolLM2's moved 3 of 20 first tokens) and it changes answers where nothing is
#: recomputed (``naive_reuse``: 20/100 on Gemma 3). From the hot tier neither is faster than
#: float16 on a CPU (each hit pays the expansion: 2-6% of the TTFT at 4k tokens); they pay
#: where bytes bind: capacity, a cold disk, the network to a shared tier.
FORMATS_BY_FIDELITY = ("float16", "int8", "int4")


def recommended_format(fraction_fit: dict[str, float]) -> tuple[str, str] | None:
    """(format, why) for a corpus of which each format's store holds ``fraction_fit[format]``
    (0..1, ``kvrag cache plan``'s figure): the most faithful format of ``FORMATS_BY_FIDELITY``
    that holds the whole corpus, else the one that holds the most of it (a chunk that does not
    fit is a miss: a full prefill of its tokens). None if no such format was planned."""
    planned = [f for f in FORMATS_BY_FIDELITY if f in fraction_fit]
    if not planned:
        return None
    top = planned[0]
    for f in planned:
        if fraction_fit[f] >= 1.0:
            if f == top:
                return f, "the whole corpus fits in the most faithful format"
            return f, f"the most faithful format that holds the whole corpus ({top} holds {fraction_fit[top]:.0%})"
    best = max(planned, key=lambda f: fraction_fit[f])
    why = f"no format holds the whole corpus; {best} holds the most of it ({fraction_fit[best]:.0%})"
    if best == "int4":
        why += "; int4 changes some answers: measure it on your model first (benchmarks/kv_formats.py)"
    return best, why
