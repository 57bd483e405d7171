"""``kvrag serve``: an OpenAI-compatible HTTP server that reuses chunk caches (docs/serve.md).

Registering imports neither torch nor the web stack: they load when the command runs.
"""

from __future__ import annotations

import logging
import os
import signal
import threading

from kvrag.cli._options import MODEL_HELP
from kvrag.defaults import (
    AUTO_POLICY,
    COMPILE_CHOICES,
    DECODE_WEIGHTS,
    DEFAULT_COMPILE,
    DEFAULT_SERVE_DECODE_WEIGHTS,
)
from kvrag.errors import KVRagError

API_KEY_ENV = "KVRAG_API_KEY"


def register(sub) -> None:
    p = sub.add_parser(
        "serve",
        help="serve the model over an OpenAI-compatible HTTP API, reusing chunk caches",
        description="Answer /v1/chat/completions and /v1/completions (OpenAI's wire format) with "
        "kvrag: the retrieved chunks found in each prompt are served from their caches and fused "
        "under the reuse policy. Chunks are ingested with POST /v1/chunks or by any process "
        "sharing the store (docs/serve.md).",
    )
    p.add_argument("--model", default=None, help=MODEL_HELP)
    p.add_argument("--served-model-name", default=None, help="the model id /v1/models lists (default: from --model)")
    p.add_argument("--cache-dir", default=None, help="KV store directory (default: $KVRAG_HOME/store)")
    p.add_argument(
        "--shared",
        default=None,
        metavar="URL",
        help="a shared Redis tier behind the local store, e.g. redis://host:6379/0: replicas with the same "
        "URL and --shared-prefix share chunks (docs/deploy.md)",
    )
    p.add_argument("--shared-prefix", default="kvrag:", help="key prefix in the shared store (default kvrag:)")
    p.add_argument(
        "--precompute-via",
        choices=("local", "queue"),
        default="local",
        help="queue: chunks posted to /v1/chunks go to `kvrag worker` processes through the shared Redis "
        "(needs --shared); local (default): computed in this process, in the background",
    )
    p.add_argument(
        "--policy",
        default=AUTO_POLICY,
        help="default reuse policy (requests may name another); auto: the model's own default, "
        "chosen from its held-out benchmarks (see kvrag policies)",
    )
    p.add_argument(
        "--param",
        action="append",
        default=[],
        metavar="POLICY.KEY=VALUE",
        help="a hyper-parameter of --policy, e.g. cacheblend.recompute_ratio=0.2 (repeatable; JSON values)",
    )
    p.add_argument("--device", default="cpu", help="torch device (cpu, cuda, cuda:1, ...)")
    p.add_argument("--dtype", default="float32", help="compute dtype (float32, bfloat16, float16)")
    p.add_argument(
        "--compile",
        choices=COMPILE_CHOICES,
        default=DEFAULT_COMPILE,
        help="decode through the compiled step (torch.compile; built at start, /ready waits for it): "
        "auto (default) = on, off = op by op (docs/serve.md)",
    )
    p.add_argument(
        "--decode-weights",
        choices=DECODE_WEIGHTS,
        default=DEFAULT_SERVE_DECODE_WEIGHTS,
        help="what a float32 model's one-row (decode) products read: its float32 weights or half-precision "
        "copies; auto (default) = the format this machine measures fastest (docs/serve.md)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads (default: torch's, one per core); on a CPU shared with other work, "
        "fewer threads than cores avoids OpenMP threads spinning against each other",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0: any free port)")
    p.add_argument(
        "--api-key",
        default=None,
        help=f"require Authorization: Bearer KEY on /v1 (default ${API_KEY_ENV} if set; none: open)",
    )
    p.add_argument("--max-concurrency", type=int, default=8, help="requests decoding at once (default 8)")
    p.add_argument("--max-queue", type=int, default=64, help="requests waiting beyond those; past it: 503 (default 64)")
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="on SIGTERM: stop admitting (503, /ready false) and let the requests in flight finish for up to "
        "this long, then end the rest and exit 0 (default 30; a second SIGTERM ends the drain at once)",
    )
    p.add_argument("--log-level", default="info", help="uvicorn's log level (default info)")
    p.add_argument(
        "--embedding-model",
        default=None,
        metavar="PATH_OR_NAME",
        help="a sentence-transformers model (a folder, or a name in the local Hugging Face cache) that "
        "answers POST /v1/embeddings, on --device; without it that endpoint answers 404",
    )
    p.set_defaults(func=run)


def policy_params(policy: str, items: list[str]) -> dict:
    """``--param POLICY.KEY=VALUE`` items (as ``kvrag bench`` takes them) for ``policy``."""
    from kvrag.cli.bench import parse_params

    params = parse_params(items)
    other = sorted(set(params) - {policy})
    if other:
        raise KVRagError(f"--param names {', '.join(other)}, not --policy {policy}: a request picks its own policy")
    return params.get(policy, {})


def run(args) -> int:
    # Every check before the model load.
    if args.max_concurrency < 1:
        raise KVRagError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    if args.max_queue < 0:
        raise KVRagError(f"--max-queue must be >= 0, got {args.max_queue}")
    if args.threads is not None and args.threads < 1:
        raise KVRagError(f"--threads must be >= 1, got {args.threads}")
    if not args.drain_timeout >= 0:
        raise KVRagError(f"--drain-timeout must be >= 0 seconds, got {args.drain_timeout}")
    if not 0 <= args.port <= 65535:
        raise KVRagError(f"--port must be in [0, 65535], got {args.port}")
    api_key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV) or None
    from kvrag.policies import get_policy

    params = policy_params(args.policy, args.param)
    if args.policy == AUTO_POLICY:
        if params:
            raise KVRagError("--param needs a named --policy: auto chooses the policy per model")
    else:
        get_policy(args.policy, **params)  # an unknown policy or parameter fails before the model load
    if args.precompute_via == "queue" and not args.shared:
        raise KVRagError("--precompute-via queue needs --shared redis://... (where the workers store the chunks)")

    import torch
    import uvicorn

    if args.threads is not None:
        torch.set_num_threads(args.threads)

    from kvrag.engine import KVRag
    from kvrag.precompute import Precomputer
    from kvrag.query.compiled import compile_wanted
    from kvrag.serve.app import create_app
    from kvrag.serve.lifecycle import Lifecycle
    from kvrag.serve.scheduler import Scheduler

    # Loaded first: a model name that does not resolve fails before the long model load.
    embedder = None
    if args.embedding_model:
        from kvrag.serve.serving_embeddings import Embedder

        embedder = Embedder.load(args.embedding_model, device=args.device)
    shared = None
    if args.shared:
        from kvrag.store import open_shared

        shared = open_shared(args.shared, prefix=args.shared_prefix)
    rag = KVRag(
        args.model,
        cache_dir=args.cache_dir,
        policy=args.policy,
        shared=shared,
        precompute_via=args.precompute_via,
        device=args.device,
        dtype=args.dtype,
        compile=compile_wanted(args.compile, torch.device(args.device), serving=True),
        decode_weights=args.decode_weights,
        **params,
    )
    name = args.served_model_name or _model_name(args.model)
    if rag.arch.decode_weights is not None:
        print(f"kvrag serve: decode reads {rag.arch.decode_weights.name} copies of the weights", flush=True)
    with Scheduler(rag, max_concurrency=args.max_concurrency, max_queue=args.max_queue) as scheduler:
        lifecycle = Lifecycle("starting")
        app = create_app(rag, scheduler, model_name=name, api_key=api_key, lifecycle=lifecycle, embedder=embedder)
        print(
            f"kvrag serve: {name} (policy {rag.policy.name}) on http://{args.host}:{args.port}/v1"
            + ("" if api_key is None else " (API key required)"),
            flush=True,
        )
        if rag.policy_default is not None:
            print(f"policy {rag.policy_default.label}: {rag.policy_default.why}", flush=True)
        if embedder is not None:
            print(f"embeddings: {embedder.name} ({embedder.dimensions} dimensions) on /v1/embeddings", flush=True)
        try:
            # Once drained, the connections still open (idle keep-alives, a client stalled
            # mid-request) get a few seconds to close: the exit stays bounded.
            config = uvicorn.Config(
                app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5
            )
            _draining_server(config, rag, scheduler, lifecycle, args.drain_timeout).run()
        finally:
            pc = Precomputer.for_rag(rag, create=False)
            if pc is not None:
                pc.shutdown(wait=False)
    return 0


def _model_name(model: str | None) -> str:
    if not model:
        return "smollm2"
    base = os.path.basename(os.path.normpath(model))
    return base[: -len(".gguf")] if base.endswith(".gguf") else base


def _draining_server_class():
    import uvicorn

    class DrainingServer(uvicorn.Server):
        """uvicorn's server, readied after a warm-up and drained on SIGTERM: the lifecycle turns
        "draining" (``/ready`` and new requests: 503), the requests in flight get up to
        ``drain_s`` seconds, then uvicorn shuts down as usual and the process exits 0. SIGINT
        and a second SIGTERM keep uvicorn's own handling (exit now)."""

        def __init__(self, config, rag, scheduler, lifecycle, drain_s: float):
            super().__init__(config)
            self.rag, self.scheduler, self.lifecycle, self.drain_s = rag, scheduler, lifecycle, drain_s
            self._drain: threading.Thread | None = None

        async def startup(self, sockets=None) -> None:
            await super().startup(sockets)
            threading.Thread(target=self._warm_up, name="kvrag-warm-up", daemon=True).start()

        def _warm_up(self) -> None:
            # The compiled graphs (computed rows, decode step), and the grammar engine's view of the
            # vocabulary (built once, a few hundred ms): the first request pays neither.
            # /ready says 503 until done.
            try:
                if self.rag.compiled is not None or self.rag.fusion.compiled is not None:
                    took = self.rag.warm_up()
                    print(
                        f"kvrag serve: compiled the prefill's computed rows and the decode step in {took:.1f} s",
                        flush=True,
                    )
                self.rag.json_constraint({"type": "object"})
            except Exception:  # a warm-up is an optimization: the server serves without it
                logging.getLogger("kvrag.serve").warning("kvrag serve: warm-up failed", exc_info=True)
            self.lifecycle.mark_ready()

        def handle_exit(self, sig, frame) -> None:
            if sig != signal.SIGTERM or self._drain is not None:
                return super().handle_exit(sig, frame)
            print(f"kvrag serve: SIGTERM: draining (up to {self.drain_s:g} s)", flush=True)

            def drain() -> None:
                self.lifecycle.drain(self.scheduler, self.drain_s)
                self.should_exit = True

            self._drain = threading.Thread(target=drain, name="kvrag-drain", daemon=True)
            self._drain.start()

    return DrainingServer


def _draining_server(config, rag, scheduler, lifecycle, drain_s: float):
    """A uvicorn server for ``kvrag serve`` (its class is built on first use: uvicorn loads
    only when the command runs)."""
    return _draining_server_class()(config, rag, scheduler, lifecycle, drain_s)
