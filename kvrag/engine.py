"""``KVRag``: the facade that ties model, store, segmenter, fusion and decoding together.

Integrations (LlamaIndex, LangChain) and the CLI talk to this class only::

    rag = KVRag(cache_dir=".kvrag", policy="cacheblend", recompute_ratio=0.15)
    rag.precompute(chunk_texts)
    out = rag.generate(prompt)          # finds the chunk texts inside the prompt
    print(out.text, out.stats.ttft_s)
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Generator, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvrag.checks import check_int, check_seq, check_token_ids
from kvrag.defaults import (
    AUTO_POLICY,
    DEFAULT_BATCH_TOKENS,
    DEFAULT_CHUNK_ANCHOR,
    DEFAULT_COMPILE,
    DEFAULT_COMPUTE_DTYPE,
    DEFAULT_DECODE_WEIGHTS,
    DEFAULT_PREFIX_CACHE,
    DEFAULT_STORAGE_DTYPE,
)
from kvrag.layout.align import prompt_prefix
from kvrag.layout.prompt import render_prompt
from kvrag.layout.segment import Segmenter
from kvrag.layout.state import CACHED, INSERTED, FusionStats, Layout, Piece
from kvrag.limits import entry_bytes_bound
from kvrag.model import ModelHandle
from kvrag.model.gemv import check_choice as check_decode_weights
from kvrag.paths import default_store_dir
from kvrag.policies import Policy, get_policy
from kvrag.policies.kvlink.adapter import KVLinkAdapter, adapt_model
from kvrag.policies.model_defaults import DefaultPolicy, default_policy
from kvrag.precompute import pending_in_prompt
from kvrag.precompute.ingest import Ingestor, cache_fingerprint, resolve_anchor
from kvrag.query.batch import DecodeArena, DecodeCache, decode_step, warm_up
from kvrag.query.compiled import CompiledRows, CompiledStep, compile_wanted
from kvrag.query.constrain import JsonConstraint
from kvrag.query.decode import SAMPLING_OPTIONS, Decoder, FusedStepper, HFStepper, Sampling, eos_ids
from kvrag.query.fusion import FusionEngine, FusionResult
from kvrag.query.lookup import ChunkLookup, PromptTokens
from kvrag.query.prefix import PrefixCache
from kvrag.store import ChunkStore, open_shared, open_store
from kvrag.store.admission import check_admission
from kvrag.store.factory import check_cache_dir
from kvrag.store.hot import HotCache, hot_device, resolve_budget
from kvrag.store.kv_format import check_format, format_fingerprint, storage_itemsize

log = logging.getLogger("kvrag")


@dataclass
class Generation:
    """A finished generation: text, generated token ids, and what the prefill did."""

    text: str
    token_ids: list[int]
    stats: FusionStats
    prompt_ids: list[int] = field(default_factory=list)
    #: Why decoding ended: "stop" (EOS token or a stop string), "length" (max_new_tokens
    #: reached without either), None if unknown. Recorded by the decoder, not guessed from
    #: the token count: a stop on the last allowed token is still "stop".
    finish_reason: str | None = None


@dataclass
class Prefill:
    """What ``KVRag.prefill`` returns: the prompt's fused (or full) prefill, ready to decode.

    ``logits``: [V], the next-token logits after the last prompt token. ``stepper``: the
    decoder that continues from the prefilled cache (``step(token_ids) -> [n, V]``).
    ``prompt_ids``: the tokenizer's ids of the prompt (inserted link tokens excluded).
    ``t0``: perf_counter when the call arrived (TTFT counts from it)."""

    logits: torch.Tensor
    stepper: HFStepper | FusedStepper
    stats: FusionStats
    prompt_ids: list[int]
    t0: float


@dataclass
class Prepared:
    """A request checked and segmented by ``KVRag.prepare``, ready for ``KVRag.fuse``: the
    policy, the prompt's pieces (``token_ids`` [n_i] each) and the ``layout`` the fused prefill
    runs on (None when the prompt takes the exact full-prefill path). t0/t_ready: perf_counter
    at the start and end of the preparation (chunk reads included)."""

    policy: Policy
    pieces: list[Piece]
    seg_stats: FusionStats
    layout: Layout | None
    t0: float
    t_ready: float
    #: Why no chunk was served, as seen at lookup (not when the warning prints: background
    #: precompute may register chunks meanwhile): chunk texts known to the segmenter, and
    #: texts found in the prompt that a background precomputer still had queued / in flight.
    known: int = 0
    pending: int = 0


class Stream:
    """Iterator of text deltas; ``.stats``/``.text``/``.token_ids`` are complete once exhausted."""

    def __init__(self, gen: Generator[str, None, None]):
        self._gen = gen
        self.text = ""
        self.token_ids: list[int] = []
        self.stats: FusionStats | None = None
        self.prompt_ids: list[int] = []
        self.finish_reason: str | None = None  # "stop" / "length" once exhausted (see Generation)

    def __iter__(self):
        return self

    def __next__(self) -> str:
        return next(self._gen)

    def close(self) -> None:
        """Stop generating now (a reader that went away) and free the decode cache; further
        ``next`` raises StopIteration, and ``stats`` stays None."""
        self._gen.close()

    def generation(self) -> Generation:
        """What the stream produced, as ``generate`` returns it (complete once exhausted)."""
        # ``stats`` is None only for a stream closed before its end, whose generation is partial.
        return Generation(self.text, self.token_ids, self.stats, self.prompt_ids, self.finish_reason)  # type: ignore[arg-type]


class KVRag:
    """Precompute chunk KV caches, then answer prompts by fusing them under a policy.

    model: a ``ModelHandle``, a local HF model directory or ``.gguf`` path, or None for the
    default SmolLM2-135M-Instruct. cache_dir: where the KV store lives. policy/policy_params:
    the default reuse policy (overridable per call); ``"auto"`` (the default): the setting the
    model's held-out benchmarks chose (``kvrag.policies.model_defaults``; CacheBlend for a
    model without such evidence), recorded with its reason in ``policy_default``. storage_dtype: dtype of stored K/V.
    size_limit: bytes of the store's blob cache, recorded in the store; None keeps the limit
    the store already has (16 GiB for a new one). admission: what a full store keeps
    (``kvrag.store.admission``): ``"lru"`` (default) every write, evicting the least recently
    used entries; ``"tinylfu"`` a write only if its chunk was asked for more often than what it
    would evict (docs/cache.md: the better hit rate when the corpus is larger than the store).
    ingest_policies: policies whose per-chunk extras are computed at precompute time (the
    default ``policy`` is one when it has extras: ``KVRag(policy="a2ats")`` stores A2ATS codes).
    kvlink_adapter: ``"auto"`` or a directory: load the model with a KVLink adapter (trained
    link tokens, maybe a LoRA merged into a copy of the model, with its own fingerprint and
    so its own chunk caches). The default ``"default"`` applies the adapter found for this
    model (``$KVRAG_HOME/kvlink/<key>/``, then the one shipped in ``kvrag/assets/kvlink/``)
    when it can be applied without surprise: a *links-only* adapter always (it changes no
    weight, fingerprint or other policy), one with LoRA weights only when ``policy`` is
    ``"kvlink"`` (a KVRag built for KVLink runs the KVLink model; one built for another
    policy keeps the base model, and its per-call ``kvlink`` runs untrained). ``"links"``:
    links-only adapters only. A loaded ``KVLinkAdapter``: that adapter. None: no adapter.
    chunk_anchor: token ids every chunk is precomputed behind (and which are then dropped):
    ``"auto"`` = the model's attention-sink token (``ModelHandle.anchor_ids``: BOS, or the
    chat template's first token), ``"none"`` = chunks read alone from position 0, or a list
    of ids. ``fingerprint`` (the cache's) covers it.
    hot_cache: bytes of served chunk K/V kept in memory on the compute device, least recently
    used dropped first (``kvrag.store.hot``): a chunk served again skips the disk read, checksum
    and host-to-device copy. ``"auto"``: a fifth of the GPU's memory, or 1 GiB on the CPU; 0
    reads every chunk from disk. ``FusionStats.chunks_hot`` counts the chunks it served.
    hot_tier: where the hot tier keeps them: ``"device"`` (the compute device) or ``"host"``
    (host RAM, page-locked beside a CUDA device, copied to it at each query: larger than a
    GPU's share and still no disk read; beside a GPU, ``"auto"`` is a tenth of the machine's RAM).
    prefix_cache: bytes of exact prompt-prefix K/V kept in memory on the compute device
    (``kvrag.query.prefix``): the plain text before a prompt's first cached chunk (system
    prompt, instruction, template header) is computed once and then read by every fused
    prefill that starts with it, exactly. 0 computes it in every prefill.
    ``FusionStats.prefix_tokens`` counts the tokens it served.
    shared: a tier that several replicas share, behind the local store: a Redis URL
    (``redis://[:password@]host:6379/0``, ``rediss://`` for TLS; keys under ``kvrag:``) or a
    ``ChunkStore`` such as ``kvrag.store.redis_store.RedisStore(url, prefix=...)``. Writes go to
    the local store then the shared one; a local miss is read from the shared tier and copied
    to the local store (``kvrag.store.tiered``, docs/deploy.md). None (default): local only,
    no server. precompute_via: ``"local"`` computes chunks in this process; ``"queue"`` (needs
    ``shared`` on Redis) hands them to ``kvrag worker`` processes through a Redis stream
    (``self.queue``, ``kvrag.precompute.redis_queue``): ``precompute`` and the ingestion hooks then return
    once the chunks are queued.
    compile: ``"on"`` decodes through the compiled step (``kvrag.query.compiled``: the whole
    decode step one ``torch.compile`` graph, built at the first answer or ``warm_up()``),
    ``"off"`` op by op; ``"auto"`` (default): on a GPU, not in a CPU process, where the first
    answer would wait a minute or two for the compile (``kvrag serve`` turns it on and warms
    up at start). Models with sliding-window or soft-capped attention and length-dependent
    RoPE decode op by op either way.
    decode_weights: what one-row (decode) products of a float32 model read
    (``kvrag.model.gemv``): ``"float32"`` (default) its own weights; ``"float16"`` /
    ``"bfloat16"`` half-precision copies of the projections and LM head (half the bytes a step
    reads, ~half the projections' memory more; prefill and stored chunks unchanged); ``"auto"``
    the format this machine's one-row products measure fastest (``kvrag serve``'s default)."""

    def __init__(
        self,
        model: ModelHandle | str | None = None,
        *,
        cache_dir: str | os.PathLike | None = None,
        policy: str | Policy = AUTO_POLICY,
        storage_dtype: str = DEFAULT_STORAGE_DTYPE,
        size_limit: int | None = None,
        admission: str = "lru",
        dtype: str = DEFAULT_COMPUTE_DTYPE,
        device: str = "cpu",
        ingest_policies: Sequence[str | Policy] = (),
        query_tokens: int | None = None,
        refresh_s: float = 2.0,
        kvlink_adapter: str | os.PathLike | KVLinkAdapter | None = "default",
        chunk_anchor: str | Sequence[int] = DEFAULT_CHUNK_ANCHOR,
        hot_cache: int | str = "auto",
        hot_tier: str = "device",
        prefix_cache: int = DEFAULT_PREFIX_CACHE,
        shared: str | ChunkStore | None = None,
        precompute_via: str = "local",
        compile: str | bool = DEFAULT_COMPILE,
        decode_weights: str = DEFAULT_DECODE_WEIGHTS,
        **policy_params,
    ) -> None:
        # Bad options fail before a model load, and before the store is opened: opening it
        # records ``size_limit`` in a store other processes may share. ``"auto"`` is resolved
        # once the model is known (its held-out default), so its parameters cannot be checked
        # before: they must come with a named policy.
        auto = isinstance(policy, str) and policy == AUTO_POLICY
        if auto and policy_params:
            raise ValueError(
                f"policy parameters {sorted(policy_params)} need a named policy: the default policy "
                "is chosen per model (policy='auto'), so name the one they are for, e.g. policy='cacheblend'"
            )
        pol = None if auto else get_policy(policy, **policy_params)
        check_cache_dir(cache_dir)
        check_format(storage_dtype)
        check_admission(admission)
        if hot_cache != "auto":
            resolve_budget(hot_cache, torch.device("cpu"))  # a bad value fails before the model load
        hot_device(hot_tier, torch.device("cpu"))  # likewise a bad tier
        check_int("prefix_cache (bytes)", prefix_cache, 0)
        compile_wanted(compile, torch.device(device), serving=False)  # a bad value fails before the model load
        check_decode_weights(decode_weights)
        if query_tokens is not None:
            query_tokens = check_int("query_tokens (the last k prompt tokens are the question)", query_tokens, 1)
        if precompute_via not in ("local", "queue"):
            raise ValueError(f"precompute_via must be 'local' or 'queue', got {precompute_via!r}")
        if precompute_via == "queue" and shared is None:
            raise ValueError(
                "precompute_via='queue' needs a shared store (shared='redis://...') where the workers store the chunks"
            )
        # Built before the model load, so a malformed URL fails at once (no connection is made
        # yet); a single-process kvrag never imports redis.
        far = None if shared is None else open_shared(shared)
        if isinstance(ingest_policies, (str, Policy)):
            ingest_policies = [ingest_policies]
        ingest = [get_policy(p) for p in ingest_policies]
        self.handle = model if isinstance(model, ModelHandle) else ModelHandle.load(model, dtype=dtype, device=device)
        #: What ``policy="auto"`` resolved to and why (None when a policy was named).
        self.policy_default: DefaultPolicy | None = None
        if pol is None:
            self.policy_default = default_policy(self.handle, kvlink_adapter)
            pol = get_policy(self.policy_default.policy, **self.policy_default.params)
            log.info("policy %s: %s", self.policy_default.label, self.policy_default.why)
        if kvlink_adapter is not None:
            self.handle = adapt_model(self.handle, kvlink_adapter, pol.name)
        # One Arch per model: the handle builds it, every component shares it (a copy of it
        # where decode reads half-precision copies of the weights).
        self.arch = self.handle.arch.with_decode_weights(decode_weights)
        pol.check_model(self.arch)  # e.g. a2ats without a codebook: now, not at the first hit
        # The default policy's per-chunk extras (A2ATS codes) are computed at precompute time,
        # with its own configuration (codebook=...): an ingest policy of the same name is it.
        ingest = [pol if q.name == pol.name else q for q in ingest]
        if type(pol).chunk_extras is not Policy.chunk_extras and pol not in ingest:
            ingest.append(pol)
        self.tokenizer = self.handle.tokenizer
        self.anchor = resolve_anchor(self.handle, chunk_anchor)
        # Chunk K/V depend on the anchor they were computed behind: it is part of the cache
        # fingerprint, so a store shared by differently configured instances never mixes them.
        # A packed storage format has keys of its own (``kvrag.store.kv_format``).
        self.fingerprint = format_fingerprint(cache_fingerprint(self.handle.fingerprint, self.anchor), storage_dtype)
        #: The format stored K/V are kept in (``storage_dtype``).
        self.storage_dtype = storage_dtype
        #: The local store's directory (also with a shared tier in front of which it sits).
        self.cache_dir = Path(cache_dir) if cache_dir is not None else default_store_dir()
        self.store: ChunkStore = open_store(self.cache_dir, shared=far, size_limit=size_limit, admission=admission)
        if far is not None and hasattr(far, "limit_entry_bytes"):  # fetch nothing larger than this model writes
            itemsize = storage_itemsize(storage_dtype)
            far.limit_entry_bytes(entry_bytes_bound(self.arch, self.handle.max_context, itemsize))
        self.queue = None
        if far is not None and precompute_via == "queue":
            from kvrag.precompute.redis_queue import RedisQueue
            from kvrag.precompute.worker import worker_command

            self.queue = RedisQueue.for_store(far, self.fingerprint)
            # Said now, not after a wait in vain: a stream no worker serves is never computed.
            self.queue.announce(
                worker_command(
                    self.handle,
                    far,
                    storage_dtype=storage_dtype,
                    ingest_policies=[p.name for p in ingest],
                    chunk_anchor=chunk_anchor,
                )
            )
        hot_at, pin = hot_device(hot_tier, self.handle.device)
        budget = resolve_budget(hot_cache, hot_at, beside_gpu=hot_at != self.handle.device)
        self.hot = HotCache(budget, hot_at, self.handle.dtype, pin=pin)
        self.policy = pol
        self.ingest_policies = ingest
        self.query_tokens = query_tokens
        self.eos = eos_ids(self.handle.model, self.tokenizer)
        self._warned: set[str] = set()  # causes _note_no_reuse warned about (once each)
        # Partial matches: a chunk the framework cut or whose edge whitespace it trimmed is
        # still served for the tokens the prompt shares with it (kvrag.layout.segment). One
        # segmenter for both paths: what ingestion stores, the next query finds.
        self.segmenter = Segmenter(partial=True)
        self.ingestor = Ingestor(
            self.handle,
            self.arch,
            self.store,
            self.segmenter,
            anchor=self.anchor,
            fingerprint=self.fingerprint,
            storage_dtype=storage_dtype,
            policies=ingest,
        )
        self.lookup = ChunkLookup(self.handle, self.store, self.hot, self.segmenter, self.fingerprint, refresh_s)
        self.fusion = FusionEngine(self.arch)
        self.prefixes = PrefixCache(self.handle, prefix_cache)
        #: The compiled decode step (None: decoding runs op by op; see ``compile``).
        self.compiled: CompiledStep | None = None
        if compile_wanted(compile, self.arch.device, serving=False):
            if CompiledRows.supports(self.arch):
                self.fusion.compiled = CompiledRows(self.arch)
            if DecodeArena.supports(self.arch) and CompiledStep.supports(self.arch):
                self.compiled = CompiledStep(self.arch)
            else:
                log.info(
                    "compile: %s prefills and decodes op by op (windowed or soft-capped attention, "
                    "or length-dependent RoPE)",
                    self.handle.config.model_type,
                )

    def warm_up(self) -> float:
        """Build the compiled graphs (the decode step's, the fused prefill's computed rows')
        now rather than at the first answer -> the seconds it took (0 without them)."""
        took = warm_up(self.arch, self.compiled) if self.compiled is not None else 0.0
        if self.fusion.compiled is not None:
            # From layer 0 (the fixed-rows policies), and from where this KVRag's own policy
            # fixes its rows.
            fixed = self.policy.rows_fixed_after()
            for start in sorted({0, 0 if fixed is None else fixed + 1}):
                if start < self.arch.n_layers:
                    took += self.fusion.compiled.warm_up(start)
        return took

    # ---- chunks ----------------------------------------------------------------------
    def chunk_ids(self, text: str) -> list[int]:
        """Token ids of a chunk as the tokenizer spells it inside a prompt (``Ingestor.chunk_ids``)."""
        return self.ingestor.chunk_ids(text)

    def chunk_key(self, text: str) -> str:
        return self.ingestor.key(self.chunk_ids(text))

    def is_cached(self, text: str) -> bool:
        return self.chunk_key(text) in self.store

    def precompute(
        self, texts: Iterable[str], *, batch_tokens: int = DEFAULT_BATCH_TOKENS, progress: bool = False
    ) -> list[str]:
        """Compute and store the KV of every text not cached yet; returns their keys.

        Chunks are packed ``batch_tokens`` at a time (one pass per pack). With
        ``precompute_via="queue"``: the texts not stored yet are queued for ``kvrag worker``
        processes instead (``self.queue.wait(keys)`` waits for them)."""
        if self.queue is not None:
            return self.queue.submit(texts, self.ingestor)
        return self.ingestor.precompute(texts, batch_tokens=batch_tokens, progress=progress)

    # ---- prompts ---------------------------------------------------------------------
    def render(self, prompt: str | Sequence[dict]) -> str:
        """A prompt string, or chat messages rendered with the tokenizer's chat template."""
        return render_prompt(self.tokenizer, prompt)

    def count_tokens(self, prompt: str | Sequence[dict]) -> int:
        """Tokens the model reads for ``prompt`` (a string, or chat messages rendered with the
        chat template), as ``generate`` would read them."""
        text = self.render(prompt)
        return len(prompt_prefix(self.handle, text)) + len(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def tokenize(self, text: str, tokenizer=None, use_cache: bool = True) -> PromptTokens:
        """A prompt string's tokens as the prefill reads them (``ChunkLookup.tokens``: the
        stored ids of the chunks the hot tier holds spliced in, the rest tokenized; BOS ids not
        included), by ``tokenizer`` (a copy of this model's, for a thread of its own: a fast
        tokenizer is not safe to share) or this model's; ``use_cache``: the policy's (False:
        the whole prompt tokenized, nothing looked up). ``prepare(..., prompt_tokens=)`` takes
        them, so a prompt tokenized to be checked is neither tokenized nor segmented again."""
        return self.lookup.tokens(text, tokenizer, use_cache)

    def count_prompt(self, text: str, tokens: PromptTokens) -> int:
        """Tokens the model reads for the prompt string ``text`` of ``tokens``: theirs and the BOS ids."""
        return len(prompt_prefix(self.handle, text)) + len(tokens[0])

    def pieces(
        self, prompt: str, use_cache: bool = True, tokens: PromptTokens | None = None
    ) -> tuple[list[Piece], FusionStats]:
        """The prompt as plain pieces and cached chunks (``kvrag.query.lookup.ChunkLookup.pieces``);
        ``tokens``: the prompt's ``tokenize``, when it was tokenized already."""
        return self.lookup.pieces(prompt, use_cache, tokens)

    def _note_no_reuse(self, prep: Prepared) -> None:
        """Say why a reuse policy got a prompt with no cached chunk, while chunks are cached
        or being computed: the speed-up is lost silently otherwise (chunks still queued for
        background precompute, a framework that rewrites the chunk texts, a store another
        process evicted). Counts are those at lookup time (``_prepare``). A warning the first
        time per KVRag and cause, debug after."""
        if prep.pending:
            # Not a segmentation problem: the chunks are in the prompt, their K/V is not ready.
            self._say_once(
                "pending",
                "no cached chunk served in this prompt: %d chunk text(s) it contains were "
                "still queued or being computed by the background precomputer (%d chunk texts cached "
                "at lookup): computed in full. Call precomputer.wait_until_idle() after ingestion for "
                "the first queries to hit (docs/integrations.md#background-precompute). Said once.",
                prep.pending,
                prep.known,
            )
        elif prep.known:  # (nothing ingested yet: computing in full is the expected path)
            self._say_once(
                "no_reuse",
                "no cached chunk served in this prompt (%d chunk texts cached at lookup; %d "
                "found but unreadable/evicted, %d found but tokenized otherwise): computed in full. "
                "Expected for a prompt without retrieved text (a chat engine's question rewrite); if "
                "it holds retrieved text, see docs/segmentation.md for what breaks a match. Said once.",
                prep.known,
                prep.seg_stats.chunks_missed,
                prep.seg_stats.chunks_unaligned,
            )

    def _note_would_show(self) -> bool:
        """Whether a ``_note_no_reuse`` now would reach a log (a cause not warned yet, or debug)."""
        return not {"pending", "no_reuse"} <= self._warned or log.isEnabledFor(logging.DEBUG)

    def _say_once(self, cause: str, msg: str, *args) -> None:
        """A warning the first time per KVRag and ``cause``, debug after."""
        level = logging.DEBUG if cause in self._warned else logging.WARNING
        self._warned.add(cause)
        log.log(level, msg, *args)

    def _prepare(self, text: str, pol: Policy, t0: float, tokens: PromptTokens | None = None) -> Prepared:
        """Everything of a prefill that can reject the request: the policy against this model,
        tokenization and the context limit, segmentation and chunk reads, the policy's inserted
        tokens (KVLink's link tokens count toward the context too) and its check of the
        layout. ``stream`` runs this at the call, so bad input fails there. ``t0``: perf_counter
        when the request arrived (rendering a chat template counts toward load_s and TTFT)."""
        pol.check_model(self.arch)
        pieces, seg_stats = self.pieces(text, pol.uses_cache, tokens)
        has_cached = any(p.kind == CACHED for p in pieces)
        known = pending = 0
        if pol.uses_cache and not has_cached and self._note_would_show():
            # What _note_no_reuse reports, as it stands now. Scanning the precomputer's queue
            # costs TTFT, so only while the note can still be seen (not yet said, or debug on).
            known, pending = len(self.segmenter), pending_in_prompt(self, text)
        layout = None
        if pol.uses_cache and has_cached:
            pieces = self.prefixes.attach(pieces)
            layout = self.fusion.apply_insertions(pieces, pol, self.query_tokens)
            if layout.n > self.handle.max_context:
                raise ValueError(
                    f"prompt of {layout.n} tokens with the {layout.n - sum(int(p.token_ids.numel()) for p in pieces)} "
                    f"tokens {pol.name} inserts exceeds the model context ({self.handle.max_context})"
                )
            pol.check_layout(layout, self.arch)
        return Prepared(pol, pieces, seg_stats, layout, t0, time.perf_counter(), known, pending)

    @staticmethod
    def _prompt_tokens(prep: Prepared) -> int:
        """Tokens the prefill of ``prep`` fills the context with (inserted ones included)."""
        return prep.layout.n if prep.layout is not None else sum(int(p.token_ids.numel()) for p in prep.pieces)

    def _fuse(self, prep: Prepared):
        """The prefill itself, after ``_prepare``: (logits [V], stepper, stats, prompt ids)."""
        pol, pieces, seg_stats, layout = prep.policy, prep.pieces, prep.seg_stats, prep.layout
        t_fuse = time.perf_counter()
        if layout is None:
            # Invariant: a prompt with no cached chunk takes the exact full-prefill path.
            ids = torch.cat([p.token_ids for p in pieces])
            stepper: HFStepper | FusedStepper = HFStepper(self.handle.model, cache=None, K=[], V=[], next_position=0)
            logits = stepper.step(ids.tolist(), last_only=True)[-1]
            n = int(ids.numel())
            stats = FusionStats(prompt_tokens=n, computed_tokens=n, kept_tokens=n, policy=pol.name)
            prompt_ids = ids.tolist()
        else:
            # Decoding over a thinned cache (SamKV, A3's eviction) on a model with sliding-window
            # layers must window by position: HF's cache windows by slot, and there slot and
            # position no longer agree. kvrag's own layer step does it by position.
            windowed = any(w is not None for w in self.arch.windows)
            own_decode = pol.decode_select is not None or windowed
            res: FusionResult = self.fusion.prefill(layout, pol, keep_state=own_decode)
            stats, logits = res.stats, res.logits
            thinned = res.positions.dim() != 1 or res.positions.numel() != layout.n
            if pol.decode_select is not None or (windowed and thinned):
                stepper = FusedStepper(self.arch, res.K, res.V, res.next_position, pol, res.state, res.positions)
            else:
                stepper = HFStepper(self.handle.model, res.K, res.V, res.next_position)
            # The tokenizer's sequence: inserted (link) tokens have no id and are not part of it.
            prompt_ids = layout.token_ids[layout.kind != INSERTED].tolist()
        if pol.uses_cache and layout is None:
            self._note_no_reuse(prep)
        stats.chunks_hit = sum(p.kind == CACHED for p in pieces)
        stats.add_lookup(seg_stats)
        stats.load_s = prep.t_ready - prep.t0
        if logits.is_cuda:  # kernels run asynchronously: wait for the logits before the clock
            torch.cuda.synchronize(logits.device)
        stats.prefill_s = time.perf_counter() - t_fuse
        return logits, stepper, stats, prompt_ids

    def _call_policy(self, policy: str | Policy | None, policy_params: dict) -> Policy:
        """The policy a call runs: ``policy``, or this KVRag's own when None or ``"auto"``
        (whose parameters ``policy_params`` then update)."""
        if policy is None or (isinstance(policy, str) and policy == AUTO_POLICY):
            return get_policy(self.policy, **policy_params)
        return get_policy(policy, **policy_params)

    def prepare(
        self,
        prompt: str | Sequence[dict],
        policy: str | Policy | None = None,
        *,
        prompt_tokens: PromptTokens | None = None,
        **policy_params,
    ) -> Prepared:
        """The first half of ``prefill``: render, check, segment and read the cached chunks of a
        prompt under ``policy`` (the KVRag's own when None; a ``Policy`` instance is run as is),
        and lay them out; no model forward. Bad input raises here. ``fuse`` runs the prefill on
        the result; measuring the two apart (e.g. counting the fused prefill's ops without the
        chunk reads) is what this is for. ``prompt_tokens``: the rendered prompt's ``tokenize``,
        when the caller tokenized it already (the server's scheduler, which checks it at submit)."""
        t0 = time.perf_counter()
        pol = self._call_policy(policy, policy_params)
        return self._prepare(self.render(prompt), pol, t0, prompt_tokens)

    def fuse(self, prepared: Prepared) -> Prefill:
        """The second half of ``prefill``: the fused (or full) prefill of a ``prepare``d request."""
        logits, stepper, stats, prompt_ids = self._fuse(prepared)
        return Prefill(logits, stepper, stats, prompt_ids, prepared.t0)

    def prefill(
        self,
        prompt: str | Sequence[dict],
        policy: str | Policy | None = None,
        *,
        prompt_tokens: PromptTokens | None = None,
        **policy_params,
    ) -> Prefill:
        """Fused prefill of a prompt under ``policy`` (the KVRag's own when None):
        ``fuse(prepare(prompt, policy, prompt_tokens=prompt_tokens, **policy_params))``."""
        return self.fuse(self.prepare(prompt, policy, prompt_tokens=prompt_tokens, **policy_params))

    def stream(
        self,
        prompt: str | Sequence[dict],
        *,
        policy: str | Policy | None = None,
        sampling: Sampling | None = None,
        **options,
    ) -> Stream:
        """Generate token by token; iterate for text deltas. ``options``: the generation
        options, ``kvrag.query.decode.Sampling``'s fields (``max_new_tokens``, ``temperature``,
        ``top_p``, ``top_k``, ``stop``, ``seed``, ``presence_penalty``, ``frequency_penalty``,
        ``logit_bias``, ``min_tokens``, ``ignore_eos``, ``json_schema``), or a ``Sampling`` of
        them as ``sampling``; any other keyword is a parameter of the policy. An unnamed
        ``max_new_tokens`` is ``DEFAULT_MAX_NEW_TOKENS`` cut to the room the prompt leaves in
        the model's context; a named one that does not fit raises (``Sampling.budget``).

        Bad options, policy parameters and prompts raise here, at the call. TTFT is the work
        from the call to the first sampled token (rendering, segmentation, loading and
        prefill; not the time a lazily read stream waits for its first ``next()``)."""
        if "max_tokens" in options:  # the name most LLM APIs use; not a policy parameter
            raise ValueError("KVRag.generate/stream take max_new_tokens, not max_tokens")
        given = {k: options.pop(k) for k in SAMPLING_OPTIONS & options.keys()}
        if sampling is None:
            sampling = Sampling(**given)
        elif given:
            raise ValueError(f"pass the generation options in sampling= or as keywords, not both: {sorted(given)}")
        sampling.check_vocab(self.handle.config.vocab_size)
        constraint = self.json_constraint(sampling.json_schema) if sampling.json_schema is not None else None
        # Bad policy options and prompts fail at the call, not at the first iteration; the
        # time this takes (rendering a chat template) still counts in TTFT and load_s.
        t_call = time.perf_counter()
        pol = self._call_policy(policy, options)
        prep = self._prepare(self.render(prompt), pol, t_call)
        budget = sampling.budget(self._prompt_tokens(prep), self.handle.max_context)
        prep_s = time.perf_counter() - t_call
        holder: Stream

        def run() -> Generator[str, None, None]:
            # TTFT counts the call's work and this one's, not the wait for the first next().
            t0 = time.perf_counter() - prep_s
            logits, stepper, stats, prompt_ids = self._fuse(prep)
            decoder = Decoder(sampling, budget, self.tokenizer, self.eos, constraint)
            step = self._decoding(stepper, budget)
            del stepper  # decoding through the compiled arena, whose copy of the cache is the one kept
            t_first = None
            while not decoder.done:
                tok = decoder.draw(logits)
                if t_first is None:
                    t_first = time.perf_counter()
                    stats.ttft_s = t_first - t0
                holder.token_ids.append(tok)
                delta = decoder.accept(tok)
                if delta:
                    holder.text += delta
                    yield delta
                if not decoder.done:
                    logits = step(tok)
            tail = decoder.flush()
            if tail:
                holder.text += tail
                yield tail
            stats.new_tokens = len(holder.token_ids)
            stats.decode_s = time.perf_counter() - (t_first or t0)
            holder.finish_reason = decoder.finish_reason
            holder.stats = stats
            holder.prompt_ids = prompt_ids

        holder = Stream(run())
        return holder

    def _decoding(self, stepper: HFStepper | FusedStepper, budget: int):
        """What continues a prefill by one token: ``step(token) -> logits [V]`` — the batched
        decode step over this one request (as ``kvrag serve`` decodes: in a one-request arena
        where the model has one, compiled where there is a compiled step) when the step is
        compiled or reads half-precision weight copies (a transformers forward would read the
        model's own weights), else the prefill's own stepper."""
        if self.compiled is not None or self.arch.decode_weights is not None:
            cache = DecodeCache.from_stepper(self.arch, stepper, spare=budget + 2)
            arena = DecodeArena(self.arch) if DecodeArena.supports(self.arch) else None
            if cache is not None and (arena is None or arena.add(cache)):
                compiled = self.compiled
                return lambda tok: decode_step(self.arch, [cache], [tok], arena, compiled)[0]
        return lambda tok: stepper.step([tok])[-1]

    def json_constraint(self, schema: Mapping[str, Any]) -> JsonConstraint:
        """A matcher holding one reply to a JSON document valid under ``schema`` (ValueError
        names a schema the grammar engine cannot compile)."""
        return JsonConstraint(self.tokenizer, self.handle.config.vocab_size, schema)

    def generate(self, prompt: str | Sequence[dict], **kwargs) -> Generation:
        """Generate a whole answer (see ``stream`` for the options)."""
        s = self.stream(prompt, **kwargs)
        for _ in s:
            pass
        return s.generation()

    @torch.no_grad()
    def continuation_logits(
        self, prompt: str | Sequence[dict], continuation_ids: Sequence[int], *, policy=None, **policy_params
    ) -> tuple[torch.Tensor, FusionStats]:
        """Teacher-forced logits: row 0 predicts ``continuation_ids[0]`` after the prompt,
        row t predicts ``continuation_ids[t]``; shape [1 + T, V] (last row follows the whole
        continuation)."""
        (out,), stats = self.continuations_logits(prompt, [continuation_ids], policy=policy, **policy_params)
        return out, stats

    def continuations_logits(
        self,
        prompt: str | Sequence[dict],
        continuations: Sequence[Sequence[int]],
        *,
        policy=None,
        **policy_params,
    ) -> tuple[list[torch.Tensor], FusionStats]:
        """``continuation_logits`` for several continuations of one prompt: one [1 + T_i, V]
        tensor each. One prefill serves them all when the decoder can rewind its cache (a
        policy with its own decode-time state gets a fresh prefill per continuation)."""
        continuations = [
            self._continuation_ids(i, ids)
            for i, ids in enumerate(check_seq("continuations", continuations, "a sequence of id sequences"))
        ]
        pre = self.prefill(prompt, policy, **policy_params)
        logits, stepper, stats = pre.logits, pre.stepper, pre.stats
        rewindable = isinstance(stepper, HFStepper)
        outs = []
        for i, ids in enumerate(continuations):
            if i and not rewindable:
                pre = self.prefill(prompt, policy, **policy_params)
                logits, stepper, stats = pre.logits, pre.stepper, pre.stats
            point = stepper.checkpoint() if isinstance(stepper, HFStepper) else None
            rows = [logits.unsqueeze(0)]
            if len(ids):
                rows.append(stepper.step(list(ids)))
            outs.append(torch.cat(rows).float())
            if point is not None and isinstance(stepper, HFStepper):
                stepper.rewind(point)
        return outs, stats

    def _continuation_ids(self, i: int, ids) -> list[int]:
        """Continuation ``i`` as a list of token ids of this model; ValueError naming the first
        bad id (a float would be truncated, a negative one would index from the end, one past
        the vocabulary raises IndexError deep in the model)."""
        vocab = self.handle.model.get_input_embeddings().num_embeddings
        return check_token_ids(f"continuation {i}", ids, vocab)
