"""One pack of the in-process precomputer: chunk texts prefilled and stored in one
``KVRag.precompute`` call, and, when that call fails, which chunks failed (the culprits are
found by trying alone each chunk the failed call did not store)."""

from __future__ import annotations

__all__ = ["compute_pack"]


def compute_pack(rag, texts: list[str], keys: list[str | None], batch_tokens: int) -> dict[int, Exception]:
    """Precompute ``texts`` (store keys ``keys``) with ``rag``, ``batch_tokens`` tokens per
    forward pass; returns the errors of the chunks that failed, by their index in ``texts``
    (empty: all were stored)."""
    try:
        rag.precompute(texts, batch_tokens=batch_tokens)
        return {}
    except Exception as e:  # noqa: BLE001 - a failing pack is retried chunk by chunk below
        if len(texts) == 1:
            return {0: e}
    # Find the culprit(s): what got stored is done, the rest is tried alone.
    errors: dict[int, Exception] = {}
    for i, (text, key) in enumerate(zip(texts, keys, strict=True)):
        if key in rag.store:
            continue
        try:
            rag.precompute([text], batch_tokens=batch_tokens)
        except Exception as e1:  # noqa: BLE001 - this chunk's own error, handed to its future
            errors[i] = e1
    return errors
