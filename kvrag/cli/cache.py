"""``kvrag cache stats|gc|clear``: inspect and maintain a KV store without loading a model."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from kvrag.defaults import DEFAULT_SHARED_PREFIX
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
        help="KV store maintenance: stats, gc, push, clear",
        description="Inspect and maintain a kvrag KV store (no model is loaded).",
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
