"""A four-passage toy corpus and its RAG prompt, shared by the engine, precompute and serving
tests (tiny random-weight models: the texts matter only as distinct token runs)."""

import torch

DOCS = [
    "The red fox lives in the northern forest and hunts small rodents at dawn.",
    "Mount Kelvar is the tallest peak of the Arden range, at 4,210 metres.",
    "The river Lenne flows from the Varn Mountains to the eastern sea.",
    "Queen Ilsa founded the harbour town of Brisk in the year 1204.",
]


def prompt_for(docs, question="Where does the red fox live?"):
    return "Answer from the passages.\n\n" + "\n\n".join(docs) + f"\n\nQuestion: {question}\nAnswer:"


def hf_greedy(model, ids, n):
    """Plain transformers greedy generation of ``n`` tokens after ``ids`` (on the model's device)."""
    t = torch.tensor([ids], device=model.device)
    with torch.no_grad():
        out = model.generate(t, attention_mask=torch.ones_like(t), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(ids) :].tolist()


def head_tokens(rag, prompt) -> int:
    """Tokens of the rendered ``prompt`` (text or chat messages) before its first cached chunk:
    what the prompt prefix cache serves."""
    from kvrag.layout.state import PLAIN

    pieces, _ = rag.pieces(rag.render(prompt))
    first = next(i for i, p in enumerate(pieces) if p.kind != PLAIN)
    return sum(int(p.token_ids.numel()) for p in pieces[:first])
