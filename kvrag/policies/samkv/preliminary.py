"""SamKV's preliminary pass (paper §3.1, steps 1-2): the prompt's own tokens against the
compressed cache and every document's local tokens against their own document, through every
layer in one batch, giving the generic query, the documents' local queries and the attention
the recomputation ranks by.

Shapes: ``N`` prompt tokens, ``R`` rows run, ``L`` layers, ``H`` query heads, ``Hkv`` KV heads,
``D`` head dim, ``Dd`` documents.
"""

from __future__ import annotations

import torch


def prelim_pass(
    arch,
    ids: torch.Tensor,
    rows: torch.Tensor,
    mask: torch.Tensor,
    keys,
    values,
    positions: torch.Tensor,
    stable: list[int],
    cos_sin,
    n_write: int,
    n_query: int,
    member: torch.Tensor,
):
    """Steps 1-2 in one pass: run ``rows`` [R] (token ids ``ids`` [R]) through every layer, row
    r attending to the keys ``mask`` [R, N] lets it see in ``keys``/``values`` (per layer
    [Hkv, N, D], keys rotated to ``positions`` [N]); cos_sin: the rows' RoPE tables [R, D].
    The prompt's own tokens (against the compressed cache) and every document's local rows
    (against their own document) share one batch, so the layers' ops do not grow with the
    number of documents.

    Three groups of rows, in this order: ``rows[:n_write]`` are the prompt's own tokens,
    computed here: their fresh K/V are written into keys/values at their rows before being
    attended (the caller must let no local row see them, and must not need those rows'
    previous contents); of these the last ``n_query`` are the question; ``rows[n_write:]`` are
    cached local rows, which read their context's cached K/V. member [Dd, R - n_write]: each
    document's averaging weights over the local rows.

    Returns q_que [L, H, D] (mean rotated Q of the question rows), q_loc [Dd, L, H, D]
    (``member``'s means of the local rows' rotated Q), query_attn [N] (attention the question
    rows pay to each key relative to uniform over the keys each row sees, mean over heads and
    rows) and context_attn [N] (attention each key gets from the local rows that see it, same
    normalization, mean over those rows), both averaged over the ``stable`` layers; float32, on
    the model's device."""
    L, n = arch.n_layers, mask.shape[1]
    n_loc = rows.numel() - n_write
    probe = n_write - n_query  # question + local rows: a contiguous tail, sliced without a copy
    pos_r = positions[rows]
    hidden = arch.embed(ids)
    qs = []
    query_attn = torch.zeros(n, device=mask.device)
    context_attn = torch.zeros(n, device=mask.device)
    # The mask and its row / column counts, made once per sliding-window size, not per layer.
    by_window: dict = {}
    for layer in range(L):
        q, k, v, _ = arch.qkv(layer, hidden, cos_sin)
        qs.append(q)
        keys_l, vals_l = keys[layer], values[layer]
        if n_write:
            keys_l[:, rows[:n_write]] = k[:, :n_write]
            vals_l[:, rows[:n_write]] = v[:, :n_write]
        w = arch.windows[layer]
        if w not in by_window:
            lm = arch.windowed(layer, mask, pos_r, positions)
            seen = lm[probe:]
            # Relative to uniform over the keys each row sees at this layer (its sliding window,
            # if any); a key is seen only by its own document's local rows in that window.
            by_window[w] = (lm, seen.sum(1, keepdim=True).float(), seen[n_query:].float().sum(0).clamp(min=1))
        lm, visible, hits = by_window[w]
        if layer in stable:
            probs = arch.attention_probs(q[:, probe:], keys_l, lm[probe:]).mean(0) * visible  # [P, N]
            if n_query:
                query_attn += probs[:n_query].mean(0) / len(stable)
            if n_loc:
                context_attn += probs[n_query:].sum(0) / hits / len(stable)
        if layer < L - 1:  # the last layer's output is never used, only its q
            hidden = arch.attend(layer, hidden, q, keys_l, vals_l, lm)
    q_all = torch.stack(qs).float()  # [L, H, R, D]
    q_que = q_all[:, :, probe:n_write].mean(2)
    q_loc = torch.einsum("dr,lhrk->dlhk", member, q_all[:, :, n_write:])
    return q_que, q_loc, query_attn, context_attn
