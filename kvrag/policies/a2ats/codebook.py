"""A²ATS codebooks: query-aware vector quantization of position-free keys, fitted once per model.

A²ATS (He et al., 2025) approximates the attention score of every cached key from a small
integer code, so a decode step can rank all keys without reading them and then read only the
top-K exactly. Two ideas make one *shared* codebook per (layer, KV head) work:

* **Windowed RoPE** (eq. 11-12): a key more than ``w`` positions behind the query is scored as
  if it were exactly ``b`` positions behind, ``u ≈ q R_b · k``, with ``k`` the *pre-RoPE* key.
  So the keys being quantized carry no position at all (kvrag stores them that way anyway),
  and the query is rotated once per step by the fixed offset ``b``.
* **Query-aware VQ** (eq. 13-21): the score error of a quantized key is
  ``(k - c) H (k - c)^T`` with ``H = E[q~^T q~]`` the second moment of the (``R_b``-rotated)
  queries. With the Cholesky factor ``H = L L^T`` this is plain squared distance between
  ``z = k L`` and ``c L``, so ordinary k-means++ on ``z`` fits the codebook ``C^z`` and
  ``C = C^z L^{-1}`` is the codebook the scores use.

This module holds a codebook (``Codebooks``: fit one layer's with ``fit_codebook``, assign
codes with ``Codebooks.codes``), stores codebooks as safetensors named by the model fingerprint
(``$KVRAG_HOME/a2ats/<fingerprint>.safetensors``) and finds the one belonging to a loaded
model (``find_codebooks``). Calibration -- which text, which statistics -- is
``kvrag.policies.a2ats.calibrate``.

Shapes: ``L`` layers, ``H`` query heads, ``Hkv`` KV heads, ``G = H / Hkv`` query heads per KV
head, ``D`` head dim, ``C`` codewords, ``T`` tokens, ``N`` calibration keys per head.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import uuid
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvrag.errors import KVRagError

log = logging.getLogger("kvrag")

FORMAT = "kvrag-a2ats-codebooks/1"
DEFAULT_CODES = 512  # paper: 4096 (fitted on 80K tokens of an 8B model, on GPUs)
DEFAULT_ITERS = 8
DEFAULT_ROPE_OFFSET = 2048  # the paper's b
MAX_CODES = 32767  # codes are stored as int16
# Tokens of the probe sequence whose keys identify a model (see ``model_probe``).
_PROBE_TOKENS = 16


class CodebookError(KVRagError):
    """No usable A²ATS codebook: none fitted for this model, or the file is broken/foreign."""


# ---- k-means++ ---------------------------------------------------------------------------
def _nearest(x: torch.Tensor, centers: torch.Tensor, block: int = 4096) -> torch.Tensor:
    """Index of the nearest center for each point: x [B, N, D], centers [B, C, D] -> [B, N].

    ``||x - c||^2 = ||x||^2 - 2 x.c + ||c||^2`` and the first term does not change the argmin;
    computed in blocks of points so [B, block, C] distance tiles stay small."""
    c2 = (centers * centers).sum(-1)  # [B, C]
    out = []
    for s in range(0, x.shape[1], block):
        xs = x[:, s : s + block]
        d = c2[:, None, :] - 2 * torch.matmul(xs, centers.transpose(1, 2))
        out.append(d.argmin(-1))
    return torch.cat(out, dim=1)


def kmeans(
    x: torch.Tensor, k: int, iters: int = DEFAULT_ITERS, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Batched k-means++ (seeding + ``iters`` Lloyd steps) of B independent point sets.

    x [B, N, D] -> centers [B, k, D] (same dtype). A cluster that ends up empty keeps its
    previous center (with k-means++ seeding that is rare and harmless)."""
    if x.dim() != 3:
        raise ValueError(f"kmeans expects points [B, N, D], got shape {tuple(x.shape)}")
    b, n, d = x.shape
    if not 1 <= k <= n:
        raise ValueError(f"kmeans: need 1 <= k <= number of points, got k={k}, points={n}")
    ar = torch.arange(b)
    centers = torch.empty(b, k, d, dtype=x.dtype)
    x2 = (x * x).sum(-1)  # [B, N]
    xt = x.transpose(1, 2).contiguous()  # [B, D, N]: a [1, D] x [D, N] product per step is fast

    def dist_to(c: torch.Tensor) -> torch.Tensor:  # c [B, D] -> squared distances [B, N]
        dots = torch.bmm(c.unsqueeze(1), xt).squeeze(1)
        return (x2 - 2 * dots + (c * c).sum(-1, keepdim=True)).clamp_min(0)

    first = torch.randint(n, (b,), generator=generator)
    centers[:, 0] = x[ar, first]
    d2 = dist_to(centers[:, 0])  # [B, N] squared distance to the nearest center so far
    for i in range(1, k):
        # D^2 sampling (Arthur & Vassilvitskii 2007): pick a point with probability
        # proportional to its squared distance from the centers so far; inverse-CDF sampling
        # (cumsum + searchsorted) is ~10x cheaper than torch.multinomial here.
        cdf = d2.double().cumsum(-1)
        u = torch.rand(b, 1, generator=generator, dtype=torch.float64) * cdf[:, -1:]
        # right=True skips zero-weight points; if every weight is 0 (duplicates) the last
        # point is as good as any.
        pick = torch.searchsorted(cdf, u, right=True).squeeze(1).clamp_max(n - 1)
        centers[:, i] = x[ar, pick]
        d2 = torch.minimum(d2, dist_to(centers[:, i]))
    for _ in range(iters):
        assign = _nearest(x, centers)  # [B, N]
        sums = torch.zeros_like(centers).scatter_add_(1, assign[..., None].expand(-1, -1, d), x)
        counts = torch.zeros(b, k, dtype=x.dtype).scatter_add_(1, assign, torch.ones(b, n, dtype=x.dtype))
        nonempty = counts > 0
        centers = torch.where(nonempty[..., None], sums / counts.clamp_min(1)[..., None], centers)
    return centers


def query_cholesky(h: torch.Tensor, jitter: float = 1e-6) -> torch.Tensor:
    """Lower Cholesky factor of second-moment matrices: h [..., D, D] -> L [..., D, D],
    ``h + eps I = L L^T``. The small ridge (``jitter`` x mean eigenvalue) keeps a rank-deficient
    H (a query direction never used) factorizable without changing the objective noticeably."""
    h = h.double()
    h = 0.5 * (h + h.transpose(-1, -2))
    d = h.shape[-1]
    scale = torch.diagonal(h, dim1=-2, dim2=-1).mean(-1).clamp_min(1e-12)
    eye = torch.eye(d, dtype=h.dtype)
    return torch.linalg.cholesky(h + (jitter * scale)[..., None, None] * eye)


def fit_codebook(
    keys: torch.Tensor,
    h: torch.Tensor,
    n_codes: int,
    *,
    iters: int = DEFAULT_ITERS,
    generator: torch.Generator | None = None,
    query_aware: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Query-aware VQ codebooks for B independent (layer, head) problems.

    keys [B, N, D] (position-free keys), h [B, D, D] (query second moments) ->
    (codebook C [B, C, D] float32 — the codewords scores use —, chol L [B, D, D] float64 with
    ``C L`` the codewords codes are assigned against). ``query_aware=False`` fits conventional
    VQ (L = I): the paper's ablation baseline, kept for tests and comparisons."""
    if keys.dim() != 3 or h.dim() != 3 or h.shape[0] != keys.shape[0] or h.shape[1:] != (keys.shape[2], keys.shape[2]):
        raise ValueError(
            f"fit_codebook: keys [B, N, D] and h [B, D, D] do not match: {tuple(keys.shape)}, {tuple(h.shape)}"
        )
    if query_aware:
        chol = query_cholesky(h)
    else:
        chol = torch.eye(keys.shape[2], dtype=torch.float64).expand(keys.shape[0], -1, -1).clone()
    z = torch.matmul(keys.double(), chol).float()  # eq. 15: z = k L
    cz = kmeans(z, n_codes, iters, generator).double()  # C^z, eq. 16-18
    # eq. 19: C = C^z L^{-1}, i.e. solve C L = C^z.
    codebook = torch.linalg.solve_triangular(chol, cz, upper=False, left=False)
    return codebook.float(), chol


# ---- codebooks -------------------------------------------------------------------------
@dataclass
class Codebooks:
    """Fitted A²ATS codebooks of one model.

    codebook [L, Hkv, C, D] float32 (``C``: scores use ``q R_b · codebook[code]``);
    chol [L, Hkv, D, D] float64 (lower Cholesky factor of the query second moment; codes are
    ``argmin_c ||k L - C_c L||``); probe [L, Hkv, P, D] float32 (pre-RoPE keys of a fixed
    token sequence: identifies the model the codebook belongs to); meta: JSON-able facts
    (fingerprint, model_type, rope_offset, n_tokens, ...)."""

    codebook: torch.Tensor
    chol: torch.Tensor
    probe: torch.Tensor
    meta: dict = field(default_factory=dict)
    # device -> these codebooks with their scoring and coding tensors there (see ``to``).
    _on: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        cb, ch, pr = self.codebook, self.chol, self.probe
        if cb.dim() != 4 or ch.dim() != 4 or pr.dim() != 4:
            raise CodebookError(
                f"codebook tensors have the wrong rank: codebook {tuple(cb.shape)}, chol {tuple(ch.shape)}, "
                f"probe {tuple(pr.shape)}"
            )
        n_layers, hkv, c, d = cb.shape
        if tuple(ch.shape) != (n_layers, hkv, d, d) or tuple(pr.shape[:2]) != (n_layers, hkv) or pr.shape[3] != d:
            raise CodebookError(
                f"inconsistent codebook shapes: codebook {tuple(cb.shape)}, chol {tuple(ch.shape)}, "
                f"probe {tuple(pr.shape)}"
            )
        if not 1 <= c <= MAX_CODES:
            raise CodebookError(f"codebook has {c} codewords; codes are int16, so 1..{MAX_CODES} are supported")
        self.codebook = cb.float().contiguous()
        self.chol = ch.double().contiguous()
        self.probe = pr.float().contiguous()
        # Codewords in z-space (C L), float64 so that code assignment is not sensitive to
        # how a batch of keys happens to be blocked by the matmul (ties are then ~1e-16).
        self._cz = torch.matmul(self.codebook.double(), self.chol)
        self._cz2 = (self._cz * self._cz).sum(-1)  # [L, Hkv, C]
        h = hashlib.sha256()
        for t in (self.codebook, self.chol):
            h.update(t.numpy().tobytes())
        self.digest = h.digest()[:16]

    @property
    def n_layers(self) -> int:
        return self.codebook.shape[0]

    @property
    def n_kv_heads(self) -> int:
        return self.codebook.shape[1]

    @property
    def n_codes(self) -> int:
        return self.codebook.shape[2]

    @property
    def head_dim(self) -> int:
        return self.codebook.shape[3]

    @property
    def device(self) -> torch.device:
        return self.codebook.device

    @property
    def rope_offset(self) -> int:
        return int(self.meta.get("rope_offset", DEFAULT_ROPE_OFFSET))

    def digest_tensor(self) -> torch.Tensor:
        """The codebook identity as a uint8 [16] tensor (stored beside chunk codes, so codes made
        with another codebook are recognised and recomputed)."""
        return torch.tensor(list(self.digest), dtype=torch.uint8)

    def to(self, device: str | torch.device) -> Codebooks:
        """These codebooks with the tensors that score and assign codes (codebook, chol and
        their z-space codewords) on ``device``, copied once per device and then reused; the
        probe stays where it is (it only identifies the model)."""
        device = torch.device(device)
        if device == self.device:
            return self
        moved = self._on.get(device)
        if moved is None:
            moved = copy.copy(self)
            moved._on = {}
            for name in ("codebook", "chol", "_cz", "_cz2"):
                setattr(moved, name, getattr(self, name).to(device))
            self._on[device] = moved
        return moved

    def check_model(self, n_layers: int, n_kv_heads: int, head_dim: int) -> None:
        if (self.n_layers, self.n_kv_heads, self.head_dim) != (n_layers, n_kv_heads, head_dim):
            raise CodebookError(
                f"codebook is for {self.n_layers} layers x {self.n_kv_heads} KV heads x {self.head_dim} dims, "
                f"the model has {n_layers} x {n_kv_heads} x {head_dim}"
            )

    def codes_layer(
        self, layer: int, keys: torch.Tensor, block: int = 2048, dtype: torch.dtype = torch.int16
    ) -> torch.Tensor:
        """Codes of pre-RoPE keys at one layer: keys [Hkv, T, D] -> [Hkv, T] (eq. 20), computed
        and returned on the codebooks' device (``to``); ``dtype``: int16 as chunks store them,
        long to index with."""
        if keys.dim() != 3 or keys.shape[0] != self.n_kv_heads or keys.shape[2] != self.head_dim:
            raise ValueError(
                f"codes_layer: keys must be [{self.n_kv_heads}, T, {self.head_dim}], got {tuple(keys.shape)}"
            )
        chol, cz, cz2 = self.chol[layer], self._cz[layer], self._cz2[layer]
        k = keys.detach().to(chol.device, torch.float64)
        out = []
        for s in range(0, k.shape[1], block):
            z = torch.matmul(k[:, s : s + block], chol)  # [Hkv, t, D]
            d = cz2[:, None, :] - 2 * torch.matmul(z, cz.transpose(1, 2))
            out.append(d.argmin(-1))
        if not out:
            return torch.empty(self.n_kv_heads, 0, dtype=dtype, device=chol.device)
        return torch.cat(out, dim=1).to(dtype)

    def codes(self, keys: torch.Tensor) -> torch.Tensor:
        """Codes of a chunk's pre-RoPE keys: keys [L, Hkv, T, D] -> int16 [L, Hkv, T], on the
        codebooks' device (the keys move there in one copy, not one per layer)."""
        if keys.dim() != 4 or keys.shape[0] != self.n_layers:
            raise ValueError(f"codes: keys must be [{self.n_layers}, Hkv, T, D], got {tuple(keys.shape)}")
        keys = keys.to(self.device)
        return torch.stack([self.codes_layer(layer, keys[layer]) for layer in range(self.n_layers)])

    # -- files --------------------------------------------------------------------------
    def save(self, path: str | os.PathLike) -> Path:
        """Write a safetensors file (atomically: a reader never sees half a file)."""
        from safetensors.torch import save_file

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        meta = {"format": FORMAT, **{k: json.dumps(v) for k, v in self.meta.items()}}
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
        try:
            save_file({"codebook": self.codebook, "chol": self.chol, "probe": self.probe}, str(tmp), metadata=meta)
            os.replace(tmp, path)
        finally:
            if tmp.exists():
                tmp.unlink()
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> Codebooks:
        from safetensors import safe_open

        path = Path(path)
        if not path.is_file():
            raise CodebookError(f"A2ATS codebook file {str(path)!r} does not exist")
        try:
            with safe_open(str(path), framework="pt") as f:
                raw = f.metadata() or {}
                if raw.get("format") != FORMAT:
                    raise CodebookError(
                        f"{str(path)!r} is not a kvrag A2ATS codebook file (format {raw.get('format')!r})"
                    )
                tensors = {k: f.get_tensor(k) for k in ("codebook", "chol", "probe")}
        except CodebookError:
            raise
        except Exception as e:  # safetensors raises assorted errors on truncated/garbage files
            raise CodebookError(f"cannot read A2ATS codebook {str(path)!r}: {e}") from e
        meta = {k: json.loads(v) for k, v in raw.items() if k != "format"}
        return cls(tensors["codebook"], tensors["chol"], tensors["probe"], meta)


# ---- model identity ----------------------------------------------------------------------
def probe_ids(vocab_size: int) -> list[int]:
    """A fixed, arbitrary token sequence spread over the vocabulary."""
    return [(i * 7919 + 11) % vocab_size for i in range(1, _PROBE_TOKENS + 1)]


_PROBES: weakref.WeakKeyDictionary[torch.nn.Module, torch.Tensor] = weakref.WeakKeyDictionary()


def model_probe(arch) -> torch.Tensor:
    """Pre-RoPE keys [L, Hkv, P, D] (float32, CPU) of the probe sequence under ``arch``'s model.

    Policies only see the model object, not the ``ModelHandle`` that knows the fingerprint,
    so a codebook carries the probe keys of the model it was fitted on: equal probe keys mean
    the same weights (a different model gives unrelated keys), at the cost of a 16-token
    forward once per process and model."""
    from kvrag.chunk import compute_chunk_kv

    probe = _PROBES.get(arch.model)
    if probe is None:
        keys, _ = compute_chunk_kv(arch, [probe_ids(arch.config.vocab_size)])[0]
        probe = keys.detach().float().cpu()
        _PROBES[arch.model] = probe
    return probe


def probe_matches(stored: torch.Tensor, probe: torch.Tensor, rtol: float = 0.05) -> bool:
    """Same model? Relative L2 distance of the probe keys below ``rtol``. The same weights give
    ~1e-7 in one precision, up to ~0.013 when one side ran in bfloat16 (measured: SmolLM2 0.009,
    tiny Llama 0.013; float16 0.001-0.002), another model ~1: a codebook fitted in float32 must
    serve the model run in half precision too."""
    if stored.shape != probe.shape:
        return False
    return float((stored - probe).norm()) <= rtol * float(probe.norm()) + 1e-12


def codebook_dir() -> Path:
    """Where fitted codebooks live: ``$KVRAG_HOME/a2ats`` (default ``~/.cache/kvrag/a2ats``)."""
    from kvrag.paths import default_home

    return default_home() / "a2ats"


def codebook_path(fingerprint: str, directory: str | os.PathLike | None = None) -> Path:
    """Default file of a model's codebooks: ``<directory or codebook_dir()>/<fingerprint>.safetensors``."""
    return (Path(directory) if directory is not None else codebook_dir()) / f"{fingerprint}.safetensors"


_LOADED: dict[tuple, Codebooks] = {}


def load_cached(path: str | os.PathLike) -> Codebooks:
    """``Codebooks.load`` memoized by (path, mtime, size): a query must not re-read and
    re-hash megabytes of codebook on every call, but a recalibrated file is picked up."""
    p = Path(path).resolve()
    try:
        st = p.stat()
    except OSError:
        raise CodebookError(f"A2ATS codebook file {str(path)!r} does not exist") from None
    key = (str(p), st.st_mtime_ns, st.st_size)
    cb = _LOADED.get(key)
    if cb is None:
        cb = Codebooks.load(p)
        if len(_LOADED) > 8:
            _LOADED.clear()
        _LOADED[key] = cb
    return cb


def _header_meta(path: Path) -> dict | None:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            raw = f.metadata() or {}
            if raw.get("format") != FORMAT:
                return None
            shape = f.get_slice("codebook").get_shape()
        return {"shape": list(shape), **{k: json.loads(v) for k, v in raw.items() if k != "format"}}
    except Exception:  # noqa: BLE001 - an unreadable codebook file is no codebook
        return None


def find_codebooks(arch, directory: str | os.PathLike | None = None) -> Codebooks | None:
    """The codebook fitted for ``arch``'s model in ``directory`` (default ``codebook_dir()``),
    or None. Files whose header shapes do not fit are skipped without loading; among those
    whose probe keys match the model, the newest wins."""
    d = Path(directory) if directory is not None else codebook_dir()
    if not d.is_dir():
        return None
    want = (arch.n_layers, arch.n_kv_heads, arch.head_dim)
    cands = []
    for p in d.glob("*.safetensors"):
        meta = _header_meta(p)
        if meta is None:
            continue
        s = meta["shape"]
        if (s[0], s[1], s[3]) != want or meta.get("model_type") != arch.config.model_type:
            continue
        cands.append((p.stat().st_mtime_ns, p))
    if not cands:
        return None
    probe = model_probe(arch)
    for _, p in sorted(cands, reverse=True):
        try:
            cb = load_cached(p)
        except CodebookError as e:
            log.warning("skipping A2ATS codebook %s: %s", p, e)
            continue
        if probe_matches(cb.probe, probe):
            return cb
    return None


def verify_for_model(cb: Codebooks, arch, source: str) -> Codebooks:
    """Raise CodebookError unless ``cb`` was fitted on ``arch``'s model."""
    cb.check_model(arch.n_layers, arch.n_kv_heads, arch.head_dim)
    if not probe_matches(cb.probe, model_probe(arch)):
        raise CodebookError(
            f"A2ATS codebook {source} was fitted for a different model "
            f"(fingerprint {cb.meta.get('fingerprint', '?')}); run `kvrag calibrate a2ats` for this model"
        )
    return cb
