"""Bounds derived from the model, checked before work whose cost grows with its input: the
largest chunk entry this model can produce (a shared store refuses to fetch a value that
claims more) and the longest text that can still fit in its context (a text longer than
that, in characters, is refused before it is tokenized: tokenizing a 50 MB text costs
gigabytes and tens of seconds just to learn it is too long)."""

from __future__ import annotations

# Generous slack over the computed entry size: extras of future policies, the JSON header
# (the chunk text, escaped) and the safetensors alignment padding.
ENTRY_MARGIN = 2
ENTRY_SLACK_BYTES = 2**24
# Bytes of header per token: its id (int64) and a JSON-escaped text (a token spells at most a
# few dozen characters, each at most 6 bytes escaped).
_HEADER_BYTES_PER_TOKEN = 8 + 6 * 64


def entry_bytes_bound(arch, max_tokens: int, storage_itemsize: int) -> int:
    """An upper bound, with margin, on the bytes of one stored chunk entry of ``arch``'s model:
    keys and values [L, Hkv, T, D] in the storage dtype, per-token extras (up to the same
    again for an A2ATS-like code per layer and head) and the header, for ``T = max_tokens``."""
    kv = 2 * arch.n_layers * arch.n_kv_heads * arch.head_dim * storage_itemsize
    extras = arch.n_layers * arch.n_kv_heads * 8
    per_token = kv + extras + _HEADER_BYTES_PER_TOKEN
    return ENTRY_MARGIN * per_token * max_tokens + ENTRY_SLACK_BYTES


def max_token_chars(tokenizer) -> int:
    """The most characters one token of ``tokenizer`` can stand for (at least 1), from its
    vocabulary: byte-level BPE (one symbol per byte) and SentencePiece (one per character,
    ``▁`` for a space) both spell a token with no fewer symbols than the text it decodes to,
    so a text of more than ``max_token_chars * n`` characters needs more than ``n`` tokens."""
    try:
        vocab = tokenizer.get_vocab()
    except Exception:  # noqa: BLE001 - a tokenizer without a vocabulary listing: no bound by characters
        return 0
    longest = max((len(t) for t in vocab if isinstance(t, str)), default=0)
    # Added tokens (special or not) can be arbitrary strings too: get_vocab includes them.
    return max(1, longest)


def max_chunk_chars(tokenizer, max_tokens: int) -> int | None:
    """Characters beyond which a text certainly exceeds ``max_tokens`` tokens (None: unknown)."""
    per = max_token_chars(tokenizer)
    return per * max_tokens if per else None


def check_chunk_chars(text: str, max_chars: int | None, max_tokens: int) -> None:
    """ChunkError, before any tokenization, for a text longer than ``max_chars`` characters
    (it cannot fit in ``max_tokens`` tokens)."""
    if max_chars is not None and len(text) > max_chars:
        from kvrag.errors import ChunkError

        raise ChunkError(
            f"chunk of {len(text)} characters cannot fit in the model context ({max_tokens} tokens: at most "
            f"{max_chars} characters with this tokenizer); split the document into smaller chunks"
        )
