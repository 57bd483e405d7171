"""``kvrag cache stats|gc|push|plan|clear``: inspect and maintain a KV store, and size one for a corpus."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvrag.cli._options import HOME_HELP, MODEL_HELP
from kvrag.defaults import DEFAULT_COMPUTE_DTYPE, DEFAULT_SHARED_PREFIX, STORAGE_DTYPES
from kvrag.errors import StoreError
from kvrag.paths import default_store_dir

# The store records its size limit in SQLite, whose INTEGER is a signed 64-bit number.
MAX_SIZE = 2**63 - 1


def parse_size(text: str) -> int:
    """'512M', '16G', '1.5GiB', '1000000' -> bytes (binary units: ``humanfriendly``), 1 .. ``MAX_SIZE``."""
    import humanfriendly

    try:
        n = humanfriendly.parse_size(str(text), binary=True)
    except humanfriendly.InvalidSize:
        raise ValueError(f"bad size {text!r}: use a number of bytes or e.g. 512M, 16G") from None
    if n <= 0:
        raise ValueError(f"size must be positive, got {text!r}")
    if n > MAX_SIZE:
        raise ValueError(f"size {text!r} is too large: at most {MAX_SIZE} bytes (8 EiB)")
    return int(n)


def human(n: int) -> str:
    """Bytes for people: '22.5 KiB', '517 MiB' (``humanfriendly``, binary units)."""
    import humanfriendly

    return humanfriendly.format_size(n, binary=True)


def register(sub) -> None:
    p = sub.add_parser(
        "cache",
        help="KV store maintenance: stats, gc, push, plan, clear",
        description="Inspect and maintain a kvrag KV store, and size one for a corpus (no model is loaded "
        "except by `plan --measure`).",
    )
    cmds = p.add_subparsers(dest="cache_command", metavar="ACTION", required=True)

    def common(q):
        q.add_argument(
            "store_dir",
            nargs="?",
            metavar="DIR",
            default=None,
            help="the store directory: a KVRag's cache_dir (default: $KVRAG_HOME/store)",
        )
        q.add_argument("--cache-dir", default=None, help="the same as DIR")
        q.add_argument("--json", action="store_true", help="print one JSON object instead of text")

    s = cmds.add_parser("stats", help="entries, bytes on disk, size limit; with --shared: the Redis tier and queue")
    common(s)
    s.add_argument(
        "--shared",
        default=None,
        metavar="URL",
        help="also report the shared Redis tier (redis://host:6379/0, redis+cluster://host:6379): listed "
        "chunks, memory, "
        "and every precompute stream: its backlog, the oldest job's age, its workers (live and gone) and "
        "the command that serves a stream no live worker does",
    )
    s.add_argument(
        "--prefix",
        default=DEFAULT_SHARED_PREFIX,
        help=f"key prefix of the shared store (default {DEFAULT_SHARED_PREFIX})",
    )
    s.set_defaults(func=run_stats)
    g = cmds.add_parser("gc", help="evict to the size limit, repair the text index; --verify checks every blob")
    common(g)
    g.add_argument(
        "--size-limit",
        default=None,
        help="evict least-recently-used entries down to this size (e.g. 2G) and record it "
        "as the store's limit; default: the limit recorded in the store",
    )
    g.add_argument(
        "--verify",
        action="store_true",
        help="also load and checksum every blob (slow on big stores); corrupt ones are deleted",
    )
    g.set_defaults(func=run_gc)
    u = cmds.add_parser(
        "push",
        help="copy the local entries the shared Redis tier lacks up to it",
        description="Copy every entry of a local store that the shared tier lacks up to it (each "
        "read verified): to seed a shared tier from a single-process store, or after a "
        "Redis outage that outlived the replica that stored chunks locally meanwhile.",
    )
    common(u)
    u.add_argument(
        "--shared",
        required=True,
        metavar="URL",
        help="the shared Redis tier (redis://host:6379/0, redis+cluster://host:6379)",
    )
    u.add_argument(
        "--prefix",
        default=DEFAULT_SHARED_PREFIX,
        help=f"key prefix of the shared store (default {DEFAULT_SHARED_PREFIX})",
    )
    u.set_defaults(func=run_push)
    plan = cmds.add_parser(
        "plan",
        help="a corpus's bytes per storage format, chunks per GB, what fits the size limit, precompute time",
        description="Size a corpus of N chunks of T tokens for a model, in every storage format: K/V bytes per "
        "token, bytes per chunk and for the corpus, chunks per GB and how many fit in the store's size limit "
        "(recorded in the store at DIR if there is one, else --size-limit or a new store's default). The model's "
        "config is enough (no weights are loaded) unless --measure times its precompute.",
    )
    common(plan)
    plan.add_argument("--chunks", type=_count, required=True, metavar="N", help="chunks in the corpus")
    plan.add_argument("--tokens", type=_count, required=True, metavar="T", help="tokens per chunk")
    shape = plan.add_mutually_exclusive_group()
    shape.add_argument("--model", metavar="MODEL", default=None, help=MODEL_HELP)
    shape.add_argument(
        "--shape",
        type=_shape,
        metavar="L,HKV,D",
        default=None,
        help="a model's K/V shape instead of a model: layers, KV heads, head dim (e.g. 32,8,128 for an 8B Llama)",
    )
    plan.add_argument(
        "--storage-dtype",
        action="append",
        choices=STORAGE_DTYPES,
        default=None,
        help="a storage format to plan for (repeat for several; default: every format)",
    )
    plan.add_argument(
        "--size-limit",
        default=None,
        help="the store size to fit the corpus in (e.g. 64G); default: the limit recorded in the store, else a "
        "new store's (16 GiB)",
    )
    plan.add_argument(
        "--measure",
        action="store_true",
        help="load the model and time the precompute of one pack of chunks (random token ids): the chunk "
        "prefill, then the encode and write of each format into a temporary store",
    )
    plan.add_argument(
        "--dtype",
        default=DEFAULT_COMPUTE_DTYPE,
        help=f"compute dtype for --measure (default {DEFAULT_COMPUTE_DTYPE})",
    )
    plan.add_argument("--device", default="cpu", help="torch device for --measure (default cpu)")
    plan.add_argument("--home", metavar="DIR", default=None, help=HOME_HELP)
    plan.set_defaults(func=run_plan)
    c = cmds.add_parser("clear", help="delete every entry (all models)")
    common(c)
    c.add_argument("-y", "--yes", action="store_true", help="do not ask for confirmation")
    c.set_defaults(func=run_clear)


def _store_dir(args) -> str | None:
    if args.store_dir and args.cache_dir and args.store_dir != args.cache_dir:
        raise StoreError(f"two store directories given ({args.store_dir} and --cache-dir {args.cache_dir}); pass one")
    return args.store_dir or args.cache_dir


def find_stores(root: Path, depth: int = 3) -> list[Path]:
    """kvrag KV stores (directories holding ``blobs/``) under ``root``, ``depth`` levels down at
    most, hidden directories included (``.kvrag``); for the hint when no store was named."""
    found, level = [], [root]
    for _ in range(depth):
        nxt = []
        for d in level:
            try:
                subs = sorted(p for p in d.iterdir() if p.is_dir() and not p.is_symlink())
            except OSError:
                continue
            for p in subs:
                if (p / "blobs").is_dir():
                    found.append(p)
                elif p.name not in ("blobs", "node_modules", ".git", ".venv", "__pycache__"):
                    nxt.append(p)
        level = nxt
    return found


def open_existing_store(cache_dir: str | None, size_limit: int | None = None, option: str = "--cache-dir"):
    """The existing DiskStore in ``cache_dir`` (None: the default one); a StoreError naming the
    problem, never a new empty store, if there is none. ``option``: the flag that named it."""
    from kvrag.store import open_store

    directory = Path(cache_dir).expanduser() if cache_dir else default_store_dir()
    if not directory.exists():
        hint = ""
        if not cache_dir:
            here = [str(p.relative_to(Path.cwd())) for p in find_stores(Path.cwd())]
            hint = (
                f"; KV stores under this directory: {', '.join(here)} (pass one, e.g. kvrag cache stats {here[0]})"
                if here
                else f"; pass the store's directory with {option} (the cache_dir of your KVRag; kvrag demo and "
                f"bench use a temporary store unless given --cache-dir)"
            )
        raise StoreError(f"no KV store at {directory} (the directory does not exist){hint}")
    if not directory.is_dir():
        raise StoreError(f"{directory} is not a directory")
    if not (directory / "blobs").is_dir():
        raise StoreError(f"{directory} is not a kvrag KV store (no blobs/ inside)")
    try:
        return open_store(directory, size_limit=size_limit)
    except OSError as e:
        raise StoreError(f"cannot open the KV store at {directory}: {e}") from e


def _emit(args, record: dict, lines: list[str]) -> None:
    if args.json:
        print(json.dumps(record, sort_keys=True))
    else:
        print("\n".join(lines))


def run_stats(args) -> int:
    rec, lines = {}, []
    store_dir = _store_dir(args)
    if args.shared is None or store_dir is not None:
        from kvrag.store.kv_format import formats_held

        with open_existing_store(store_dir) as store:
            st = store.stats()
            formats = formats_held([fp for _, fp in store.listed().values()])
        rec = {k: st[k] for k in ("directory", "entries", "bytes", "size_limit")}
        rec["formats"] = formats
        lines = [
            f"store       {rec['directory']}",
            f"entries     {rec['entries']}",
            f"on disk     {human(rec['bytes'])} ({rec['bytes']} bytes)",
            f"size limit  {human(rec['size_limit'])} (recorded in the store, enforced after each write; "
            "`kvrag cache gc --size-limit` to change)",
        ]
        for name, f in formats.items():
            ratio = f" ({f['vs_float16']:.3g}x float16's bytes per token)" if "vs_float16" in f else ""
            lines.append(f"format      {name}: {f['entries']} entries{ratio}")
    if args.shared is not None:
        rec["shared"] = shared_stats(args.shared, args.prefix)
        sh = rec["shared"]
        if not sh.get("reachable", True):
            raise StoreError(f"the shared store {sh['url']} is unreachable")
        lines += [
            f"shared      {sh['url']} (prefix {sh['prefix']})",
            f"  listed    {sh['listed']} chunks",
            f"  memory    {human(sh['used_memory'] or 0)} used, maxmemory "
            f"{human(sh['maxmemory']) if sh['maxmemory'] else 'unlimited'}, policy {sh['maxmemory_policy']}",
        ]
        if "queues_error" in sh:
            lines.append(f"  queues    not readable: {sh['queues_error']}")
        for q in sh.get("queues", []):
            lines += queue_lines(q)
    _emit(args, rec, lines)
    return 0


def queue_lines(q: dict) -> list[str]:
    """One precompute stream (``RedisQueue.stats()``) as text: its backlog, the oldest job's
    age, its workers (live: a heartbeat in the last ``LIVE_S`` seconds) and, when jobs wait
    with no live worker, the command that serves it."""
    age = q["oldest_age_s"]
    oldest = "" if age is None else f", oldest {age:.0f} s old"
    live = q["live_workers"]
    gone = {n: a for n, a in q["workers"].items() if n not in live}
    workers = f"{len(live)} live worker(s)" + (f" ({', '.join(live)})" if live else "")
    if gone:
        workers += "; gone: " + ", ".join(f"{n} (last seen {a:.0f} s ago)" for n, a in gone.items())
    lines = [
        f"  queue     {q['stream']}",
        f"    backlog   {q['queued']} not done ({q['pending']} in a worker){oldest}; "
        f"{q['done']} done, {q['failed']} failed, {q['unserved']} wait(s) gave up unserved",
        f"    consumers {workers}",
    ]
    if q["queued"] and not live:
        cmd = q["worker_command"] or "a kvrag worker with the replicas' model, dtype and KVLink adapter"
        lines.append(f"    NO LIVE WORKER serves these jobs: run `{cmd}` (docs/deploy.md)")
    return lines


def shared_stats(url: str, prefix: str) -> dict:
    """The shared tier's listing and memory, and every precompute queue under ``prefix``."""
    from kvrag.precompute.redis_queue import queue_stats
    from kvrag.store import open_shared

    store = open_shared(url, prefix=prefix)
    try:
        st = store.stats()
        keep = ("url", "prefix", "listed", "used_memory", "maxmemory", "maxmemory_policy", "reachable")
        out = {k: st[k] for k in keep if k in st}
        if out.get("reachable") is False:
            return out
        import redis

        from kvrag.store.redis_connection import error_cause

        try:
            out["queues"] = queue_stats(store)
        except redis.RedisError as e:  # an error reply (a queue key of another type, ...): said, not raised
            out["queues_error"] = f"{error_cause(e)}: {e}"
        return out
    finally:
        store.close()


def run_push(args) -> int:
    from kvrag.store import open_shared
    from kvrag.store.redis_connection import SharedStoreDown, redact
    from kvrag.store.tiered import push_missing

    with open_existing_store(_store_dir(args)) as store:
        far = open_shared(args.shared, prefix=args.prefix)
        try:
            listed = store.listed()
            try:
                res = push_missing(store, far, listed)
            except SharedStoreDown as e:
                raise StoreError(f"{e}; nothing more pushed (run it again when the shared tier answers)") from None
        finally:
            far.close()
    rec = {**res, "listed": len(listed), "directory": str(store.directory), "shared": redact(args.shared)}
    _emit(
        args,
        rec,
        [
            f"local       {rec['directory']} ({rec['listed']} entries)",
            f"shared      {rec['shared']} (prefix {args.prefix})",
            f"pushed      {res['pushed']}",
            f"present     {res['present']} (already in the shared tier)",
            f"unreadable  {res['unreadable']} (local entries that failed verification: not pushed)",
        ],
    )
    return 0


def run_gc(args) -> int:
    try:
        limit = parse_size(args.size_limit) if args.size_limit else None
    except ValueError as e:
        raise StoreError(str(e)) from None
    with open_existing_store(_store_dir(args), limit) as store:
        try:
            res = store.gc(verify=args.verify)
        except OSError as e:
            raise StoreError(f"gc failed in {store.directory}: {e}") from e
        st = store.stats()
    rec = {**res, "bytes": st["bytes"], "size_limit": st["size_limit"]}
    _emit(
        args,
        rec,
        [
            f"evicted          {res['evicted']}",
            f"index dropped    {res['index_dropped']}",
            f"re-indexed       {res['reindexed']}",
            f"corrupt deleted  {res['corrupt']}" + ("" if args.verify else " (not checked: use --verify)"),
            f"check warnings   {res.get('check_warnings', 0)}"
            + ("" if args.verify else " (not checked: use --verify)"),
            f"entries          {res['entries']} ({human(st['bytes'])})",
        ],
    )
    return 0


def run_clear(args) -> int:
    with open_existing_store(_store_dir(args)) as store:
        n = store.stats()["entries"]
        if not args.yes:
            if not sys.stdin.isatty():
                raise StoreError(
                    f"refusing to clear {n} entries in {store.directory} without --yes (stdin is not a terminal)"
                )
            try:
                answer = input(f"delete all {n} entries in {store.directory}? [y/N] ")
            except (EOFError, KeyboardInterrupt):  # Ctrl-D / Ctrl-C at the prompt: a "no"
                print()
                answer = ""
            if answer.strip().lower() not in ("y", "yes"):
                print("aborted")
                return 1
        try:
            store.clear()
        except OSError as e:
            raise StoreError(f"cannot clear {store.directory}: {e}") from e
    _emit(args, {"cleared": n, "directory": str(store.directory)}, [f"cleared {n} entries from {store.directory}"])
    return 0


# ---- plan ------------------------------------------------------------------------------------
# A chunk's bytes beyond its K/V: its token ids, int64 each (kvrag.store.blob).
ID_BYTES = 8


def _count(text: str) -> int:
    """argparse type: a positive integer (a count of chunks or tokens)."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return n


def _shape(text: str) -> tuple[int, int, int]:
    """argparse type: 'L,HKV,D' -> (layers, KV heads, head dim), each a positive integer."""
    parts = text.split(",")
    if len(parts) != 3:
        raise argparse.ArgumentTypeError(f"must be LAYERS,KV_HEADS,HEAD_DIM (e.g. 32,8,128), got {text!r}")
    L, H, D = (_count(x.strip()) for x in parts)
    return L, H, D


def plan_corpus(
    chunks: int, tokens: int, shape: tuple[int, int, int], formats: list[str], size_limit: int
) -> dict[str, dict[str, float | int]]:
    """Per storage format, for ``chunks`` chunks of ``tokens`` tokens of a model whose stored
    token holds K/V of ``shape`` (layers, KV heads, head dim): ``kv_bytes_per_token`` (at this
    chunk length: a packed format's key scales are per group of tokens), ``bytes_per_chunk``
    (K/V and token ids; the header, which holds the chunk's text, and the store's SQLite row come
    on top), ``total_bytes``, ``chunks_per_gb`` (whole chunks in 10^9 bytes) and ``chunks_fit`` of the corpus in
    ``size_limit`` bytes, ``fraction_fit``."""
    from kvrag.store.kv_format import bytes_per_token

    out: dict[str, dict[str, float | int]] = {}
    for f in formats:
        per_token = bytes_per_token(f, *shape, tokens=tokens)
        per_chunk = round(per_token * tokens) + ID_BYTES * tokens
        fit = min(chunks, size_limit // per_chunk)
        out[f] = {
            "kv_bytes_per_token": round(per_token, 2),
            "bytes_per_chunk": per_chunk,
            "total_bytes": per_chunk * chunks,
            "chunks_per_gb": 10**9 // per_chunk,
            "chunks_fit": fit,
            "fraction_fit": fit / chunks,
        }
    return out


def _plan_limit(args) -> tuple[int, str]:
    """(bytes, where they come from): --size-limit, else the limit recorded in the store named
    (or the default store), else a new store's default."""
    from kvrag.store.disk import DEFAULT_SIZE_LIMIT

    if args.size_limit:
        try:
            return parse_size(args.size_limit), "--size-limit"
        except ValueError as e:
            raise StoreError(str(e)) from None
    named = _store_dir(args)
    directory = Path(named).expanduser() if named else default_store_dir()
    if (directory / "blobs").is_dir():
        with open_existing_store(str(directory)) as store:
            return store.size_limit, f"recorded in the store {directory}"
    return DEFAULT_SIZE_LIMIT, f"a new store's default: no store at {directory}"


def measure_precompute(args, tokens: int, formats: list[str]) -> dict:
    """Load the model and time one pack of ``tokens``-token chunks of random ids as ingestion
    packs them (``DEFAULT_BATCH_TOKENS`` a pass): the chunk prefill after one warm-up pass, then,
    per format, each chunk's encode and write into a temporary store (``Ingestor.put``).
    Seconds per chunk; ``store_s_per_chunk`` per format."""
    import tempfile
    import time

    import torch

    from kvrag.chunk import compute_chunk_kv, pack
    from kvrag.defaults import DEFAULT_BATCH_TOKENS
    from kvrag.layout.segment import Segmenter
    from kvrag.model import ModelHandle
    from kvrag.precompute.ingest import Ingestor, cache_fingerprint, resolve_anchor
    from kvrag.store import open_store
    from kvrag.store.kv_format import format_fingerprint

    handle = ModelHandle.load(args.model, dtype=args.dtype, device=args.device, cache_dir=args.home)
    anchor = resolve_anchor(handle, "auto")
    if tokens + len(anchor) > handle.max_context:
        raise ValueError(f"--tokens {tokens} does not fit the model's context ({handle.max_context} tokens)")
    n = len(next(pack([tokens] * (DEFAULT_BATCH_TOKENS // tokens + 1), DEFAULT_BATCH_TOKENS)))
    gen = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, handle.config.vocab_size, (tokens,), generator=gen).tolist() for _ in range(n)]

    def synced() -> float:
        if handle.device.type == "cuda":
            torch.cuda.synchronize(handle.device)
        return time.perf_counter()

    compute_chunk_kv(handle.arch, ids, anchor)  # warm-up: first-call allocations and kernel choices
    t0 = synced()
    kvs = compute_chunk_kv(handle.arch, ids, anchor)
    compute_s = (synced() - t0) / n
    store_s: dict[str, float] = {}
    fingerprint = cache_fingerprint(handle.fingerprint, anchor)
    with tempfile.TemporaryDirectory(prefix="kvrag-plan-") as tmp:
        for f in formats:
            with open_store(Path(tmp) / f) as store:
                ing = Ingestor(
                    handle,
                    handle.arch,
                    store,
                    Segmenter(),
                    anchor=anchor,
                    fingerprint=format_fingerprint(fingerprint, f),
                    storage_dtype=f,
                )
                t0 = synced()
                for j, (i, (k, v)) in enumerate(zip(ids, kvs)):
                    ing.put(ing.key(i), f"chunk {j}", i, k, v)
                store_s[f] = (synced() - t0) / n
    return {
        "measured": True,
        "model": handle.source,
        "device": str(handle.device),
        "dtype": str(handle.dtype).removeprefix("torch."),
        "pack_chunks": n,
        "compute_s_per_chunk": compute_s,
        "store_s_per_chunk": store_s,
    }


def run_plan(args) -> int:
    formats = list(dict.fromkeys(args.storage_dtype or STORAGE_DTYPES))
    if args.measure and args.shape is not None:
        raise StoreError(
            "--measure times a model's precompute: pass --model (or nothing: the default model), not --shape"
        )
    if args.shape is not None:
        shape, source, context = args.shape, "--shape", None
    else:
        from kvrag.model.config import kv_shape, load_config

        config, source = load_config(args.model, args.home)
        shape, context = kv_shape(config), getattr(config, "max_position_embeddings", None)
    if isinstance(context, int) and args.tokens > context:
        raise StoreError(
            f"--tokens {args.tokens}: a chunk cannot be longer than the model's context ({context} tokens)"
        )
    from kvrag.store.kv_format import recommended_format

    limit, limit_from = _plan_limit(args)
    planned = plan_corpus(args.chunks, args.tokens, shape, formats, limit)
    pick = recommended_format({f: float(r["fraction_fit"]) for f, r in planned.items()})
    rec = {
        "chunks": args.chunks,
        "tokens": args.tokens,
        "model": {"source": source, "layers": shape[0], "kv_heads": shape[1], "head_dim": shape[2]},
        "size_limit": limit,
        "size_limit_from": limit_from,
        "formats": planned,
        "recommended": None if pick is None else {"format": pick[0], "why": pick[1]},
        "precompute": measure_precompute(args, args.tokens, formats) if args.measure else {"measured": False},
    }
    _emit(args, rec, plan_lines(rec))
    return 0


def plan_lines(rec: dict) -> list[str]:
    """``kvrag cache plan``'s record as text: the corpus, the model's shape, the limit, a table
    per format and the precompute time (or why there is none)."""
    m, pre = rec["model"], rec["precompute"]
    measured = pre["measured"]
    lines = [
        f"corpus      {rec['chunks']:,} chunks x {rec['tokens']:,} tokens ({rec['chunks'] * rec['tokens']:,} tokens)",
        f"model       {m['source']}: {m['layers']} layers x {m['kv_heads']} KV heads x head dim {m['head_dim']}",
        f"size limit  {human(rec['size_limit'])} ({rec['size_limit_from']})",
        "",
    ]
    head = ["format", "K/V B/token", "B/chunk", "corpus", "chunks/GB", "fit in limit"]
    if measured:
        head += ["precompute/chunk", "corpus precompute"]
    rows = [head]
    for f, r in rec["formats"].items():
        row = [
            f,
            f"{r['kv_bytes_per_token']:,.0f}",
            human(r["bytes_per_chunk"]),
            human(r["total_bytes"]),
            f"{r['chunks_per_gb']:,}",
            f"{r['chunks_fit']:,} ({100 * r['fraction_fit']:.3g}%)",
        ]
        if measured:
            s = pre["compute_s_per_chunk"] + pre["store_s_per_chunk"][f]
            row += [f"{s * 1e3:,.1f} ms", _duration(s * rec["chunks"])]
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    for r in rows:
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
    lines += [
        "",
        "B/chunk: K/V and token ids; each chunk's header (its text and metadata) and SQLite row come on top.",
    ]
    if rec["recommended"] is not None:
        pick = rec["recommended"]
        lines.append(f"recommended {pick['format']}: {pick['why']} (--storage-dtype; docs/cache.md, Which format)")
    if measured:
        lines.append(
            f"precompute  measured on {pre['device']} ({pre['dtype']}): one pack of {pre['pack_chunks']} chunks "
            f"of random ids, prefill {pre['compute_s_per_chunk'] * 1e3:,.1f} ms/chunk + each format's encode "
            "and write to a temporary store; one run, no other load accounted for"
        )
    else:
        lines.append("precompute  not measured (--measure loads the model and times one pack of chunks)")
    return lines


def _duration(seconds: float) -> str:
    """'42 s', '3.5 min', '7.2 h', '3.1 days'."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.1f} min"
    if seconds < 48 * 3600:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} days"
