"""``kvlink``: positional re-encoding + link tokens after every cached document (KVLink, 2025).

Each cached document keeps its own, locally-encoded K/V (re-rotated to its global position, as
every kvrag policy does). After the n-th cached document, ``K`` *link tokens* are inserted: they
are computed at query time like plain tokens, so with ordinary causal attention they see every
earlier document, link token and template token, while the documents themselves are not
recomputed. That is exactly the paper's link-token attention map at inference (its Figure 2,
right): the documents' rows keep local attention because their cached K/V came from a pass over
the document alone.

Link tokens only help a model fine-tuned to use them:

* **trained** mode: the model was loaded with a KVLink adapter (``KVRag(kvlink_adapter=...)``
  or :func:`kvrag.policies.kvlink.adapter.apply_adapter`), which carries the trained link embeddings
  ``[max_docs, K, E]`` (the paper's per-position ``link<n>-<k>`` tokens) and possibly a merged
  LoRA that gives the model — and thus every cached chunk — a new fingerprint.
* **untrained** mode: no fine-tuning; link embeddings are the mean input embedding (the usual
  initialisation of a new token). With ``link_tokens=0`` this is the paper's "PromptCache +
  re-encoding" baseline, which its Table 1 puts far below full prefill (MuSiQue 1.4% vs 13.8%).

The adapter travels *with the model object* (attribute ``kvrag_kvlink``) rather than with the
policy, because the policy interface never sees the model handle, and because a LoRA adapter
changes the model for every policy: chunks must be precomputed by the adapted model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvrag.checks import check_int
from kvrag.layout.state import CACHED
from kvrag.policies.base import Policy, param
from kvrag.policies.cacheblend import CacheBlend, CacheBlendParams
from kvrag.policies.epic import Epic, EpicParams
from kvrag.policies.registry import register

#: Attribute of an adapted HF model that holds its ``KVLinkAdapter`` (set by
#: ``kvrag.policies.kvlink.adapter.apply_adapter``).
ADAPTER_ATTR = "kvrag_kvlink"
MODES = ("auto", "trained", "untrained")
UNTRAINED_LINK_TOKENS = 5  # KVLink5, the paper's best variant
MAX_LINK_TOKENS = 64


@dataclass
class KVLinkParams:
    link_tokens: int | None = param(
        None,
        "link tokens after each cached document (paper: 0, 1 or 5); None = the adapter's "
        "count in trained mode, 5 (KVLink5) in untrained mode; 0 = re-encoding only",
    )
    mode: str = param(
        "auto",
        "'trained': use the KVLink adapter the model was loaded with (error if none); "
        "'untrained': mean-embedding link tokens, no fine-tuning (far below full prefill); "
        "'auto': trained if the model carries an adapter, else untrained",
    )
    recompute_ratio: float = param(
        0.0,
        "links + recompute: also recompute this fraction of the cached tokens, chosen as "
        "cacheblend chooses them (value deviation at check_layers); 0 = links only (the paper)",
    )
    check_layers: tuple = param((1,), "layers where deviation is measured (with recompute_ratio > 0)")
    deviation: str = param(
        "value",
        "with recompute_ratio > 0, what ranks the cached tokens, as cacheblend's deviation: 'value' "
        "(V deviation at check_layers) or 'attention' (layer 0's attention output, own passage vs "
        "whole prompt; cheaper)",
    )
    k_head: int = param(
        0,
        "links + EPIC: also recompute the first k_head tokens of every cached document at every "
        "layer, as epic chooses them (static: no check layer); 0 = none. Not with recompute_ratio",
    )

    def __post_init__(self) -> None:
        k = self.link_tokens
        if k is not None:
            k = check_int("link_tokens (None: the adapter's)", k, 0)
            if k > MAX_LINK_TOKENS:
                raise ValueError(f"link_tokens must be in [0, {MAX_LINK_TOKENS}], got {k}")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        # Checked (and normalised) by cacheblend's own parameters, which run the selection.
        blend = CacheBlendParams(
            recompute_ratio=self.recompute_ratio, check_layers=self.check_layers, deviation=self.deviation
        )
        self.recompute_ratio, self.check_layers = blend.recompute_ratio, blend.check_layers
        self.k_head = EpicParams(k_head=self.k_head).k_head
        if self.k_head and self.recompute_ratio:
            raise ValueError(
                f"k_head={self.k_head} and recompute_ratio={self.recompute_ratio}: pick one way to "
                "choose the recomputed tokens (epic's static heads or cacheblend's deviation)"
            )


def mean_embedding(arch) -> torch.Tensor:
    """The mean input embedding [E] (the matrix's mean row, scaled as ``Arch.embed`` scales
    a row: Gemma, Granite): the untrained link token."""
    return arch.body.embed_tokens.weight.detach().float().mean(dim=0) * arch.input_scale()


@register
class KVLink(Policy):
    name = "kvlink"
    summary = (
        "re-encoded cached documents + K link tokens after each, computed at query time "
        "(trained mode needs a KVLink adapter: kvrag train kvlink)"
    )
    Params = KVLinkParams
    setup = "trained mode needs a KVLink model: kvrag train kvlink (untrained mode runs as is)"

    def __init__(self, **params) -> None:
        super().__init__(**params)
        self._mean_cache: tuple | None = None
        p = self.params
        # Links + recompute: the link tokens are computed tokens like the question, so
        # cacheblend's selection (which keeps every non-cached row and ranks only cached ones)
        # and epic's (which adds cached heads to the non-cached rows) compose with them unchanged.
        self._recompute: Policy | None = None
        if p.recompute_ratio > 0:
            self._recompute = CacheBlend(
                recompute_ratio=p.recompute_ratio, check_layers=p.check_layers, deviation=p.deviation
            )
        elif p.k_head > 0:
            self._recompute = Epic(k_head=p.k_head)

    def check_model(self, arch) -> None:
        if self._recompute is not None:
            self._recompute.check_model(arch)

    def initial_active(self, state):
        return super().initial_active(state) if self._recompute is None else self._recompute.initial_active(state)

    def select(self, layer, state, q, k, v):
        return None if self._recompute is None else self._recompute.select(layer, state, q, k, v)

    def rows_fixed_after(self) -> int | None:
        return -1 if self._recompute is None else self._recompute.rows_fixed_after()

    def adapter(self, arch):
        """The ``KVLinkAdapter`` the model carries, or None."""
        return getattr(arch.model, ADAPTER_ATTR, None)

    def resolved_mode(self, arch) -> str:
        """'trained' or 'untrained' for this model (raises ValueError if 'trained' is impossible)."""
        adapter = self.adapter(arch)
        mode = self.params.mode
        if mode == "auto":
            # An explicit link count the adapter was not trained with asks for the untrained
            # variant (e.g. link_tokens=0: the paper's re-encoding-only baseline).
            k = self.params.link_tokens
            fits = adapter is not None and (k is None or k == adapter.link_tokens)
            return "trained" if fits else "untrained"
        if mode == "trained" and adapter is None:
            raise ValueError(
                "kvlink mode='trained' needs a model loaded with a KVLink adapter "
                "(KVRag(..., kvlink_adapter='auto' or a directory), or kvrag.policies.kvlink.adapter.apply_adapter); "
                "train one with `kvrag train kvlink`, or use mode='untrained'"
            )
        return mode

    def link_embeddings(self, arch, doc_index: int) -> torch.Tensor:
        """Embeddings [K, E] of the link tokens after the ``doc_index``-th cached document."""
        if self.resolved_mode(arch) == "trained":
            adapter = self.adapter(arch)
            k = self.params.link_tokens
            if k is not None and k != adapter.link_tokens:
                raise ValueError(
                    f"link_tokens={k} but the loaded KVLink adapter was trained with "
                    f"{adapter.link_tokens} link tokens per document; leave link_tokens unset"
                )
            return adapter.links_for(doc_index)
        k = self.params.link_tokens
        k = UNTRAINED_LINK_TOKENS if k is None else k
        weight = arch.body.embed_tokens.weight
        # The mean over a 49k x E matrix costs ~10 ms: remember it per weight tensor version.
        tag = (id(weight), weight._version)
        if self._mean_cache is None or self._mean_cache[0] != tag:
            self._mean_cache = (tag, mean_embedding(arch))
        return self._mean_cache[1].to(arch.dtype).unsqueeze(0).expand(k, -1).clone()

    def insertions(self, layout, arch) -> dict[int, torch.Tensor]:
        out: dict[int, torch.Tensor] = {}
        n_doc = 0
        for i, piece in enumerate(layout.pieces):
            if piece.kind != CACHED:
                continue
            emb = self.link_embeddings(arch, n_doc)
            n_doc += 1
            if emb.shape[0]:
                out[i] = emb
        return out
