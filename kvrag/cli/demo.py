"""``kvrag demo``: ingest a small corpus, ask questions, compare answers and TTFT per policy."""

from __future__ import annotations

import json
import tempfile
import time
from importlib import resources
from pathlib import Path

from kvrag.cli._options import MODEL_HELP
from kvrag.defaults import AUTO_POLICY
from kvrag.errors import KVRagError

#: ``auto`` is the model's own default (what ``KVRag()`` runs), shown with the reason it was chosen.
DEFAULT_POLICIES = "full_prefill,auto,naive_reuse,cacheblend"


def register(sub) -> None:
    p = sub.add_parser(
        "demo",
        help="ingest a demo corpus, ask questions, print answers and TTFT per policy",
        description="Ingest a corpus (default: kvrag's demo corpus), precompute its chunks' KV, "
        "ask its questions under each policy and print the answers with TTFT, "
        "against full prefill (no reuse).",
    )
    p.add_argument("--model", default=None, help=MODEL_HELP)
    p.add_argument("--cache-dir", default=None, help="KV store directory (default: a fresh temporary one)")
    p.add_argument(
        "--corpus",
        default=None,
        help="JSON object with instruction (optional), documents and questions (non-empty lists of strings)",
    )
    p.add_argument(
        "--policies",
        default=DEFAULT_POLICIES,
        help=f"comma-separated policy names, auto = the model's default (default: {DEFAULT_POLICIES})",
    )
    p.add_argument("--max-new-tokens", type=int, default=24, help="answer length cap (>= 1; default 24)")
    p.set_defaults(func=run)


def load_corpus(path: str | None) -> dict:
    """The demo corpus (``path``, default the packaged one), checked: a JSON object with a
    non-empty ``documents`` and ``questions`` list of non-empty strings and an optional
    ``instruction`` string. Raises KVRagError naming the problem."""
    if not path:
        return json.loads(resources.files("kvrag.data").joinpath("demo_corpus.json").read_text(encoding="utf-8"))
    p = Path(path).expanduser()
    if not p.exists():
        raise KVRagError(f"--corpus {path}: file not found")
    if not p.is_file():
        raise KVRagError(f"--corpus {path}: not a file")
    try:
        corpus = json.loads(p.read_text(encoding="utf-8"))
    except OSError as e:
        raise KVRagError(f"--corpus {path}: cannot read it: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise KVRagError(f"--corpus {path}: not UTF-8 text ({e.reason})") from None
    except json.JSONDecodeError as e:
        raise KVRagError(f"--corpus {path}: not valid JSON ({e})") from None
    if not isinstance(corpus, dict):
        raise KVRagError(
            f"--corpus {path}: expected a JSON object with 'documents' and 'questions', got a {type(corpus).__name__}"
        )
    for key in ("documents", "questions"):
        if key not in corpus:
            raise KVRagError(f"--corpus {path}: no {key!r} (a non-empty list of strings)")
        v = corpus[key]
        if not isinstance(v, list) or not v or not all(isinstance(x, str) and x.strip() for x in v):
            raise KVRagError(f"--corpus {path}: {key!r} must be a non-empty list of non-empty strings")
    if corpus.get("instruction") is not None and not isinstance(corpus["instruction"], str):
        raise KVRagError(f"--corpus {path}: 'instruction' must be a string")
    return corpus


def parse_policies(text: str) -> list[str]:
    """Comma-separated policy names (or ``auto``), checked against the registry; duplicates
    dropped (order kept)."""
    from kvrag.policies import policy_names

    policies = list(dict.fromkeys(p.strip() for p in text.split(",") if p.strip()))
    if not policies:
        raise KVRagError(f"--policies {text!r}: no policy named; give e.g. {DEFAULT_POLICIES}")
    unknown = [p for p in policies if p not in policy_names() and p != AUTO_POLICY]
    if unknown:
        raise KVRagError(
            f"--policies: unknown {', '.join(map(repr, unknown))}; registered: {', '.join(policy_names())}"
        )
    return policies


def run(args) -> int:
    from kvrag.outpaths import check_dir

    # Every check before the model load: a typo must not cost one.
    if args.max_new_tokens < 1:
        raise KVRagError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    corpus = load_corpus(args.corpus)
    policies = parse_policies(args.policies)
    if args.cache_dir is not None:
        check_dir(args.cache_dir, "--cache-dir")
    tmp = None
    cache_dir = args.cache_dir
    if cache_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="kvrag-demo-")
        cache_dir = tmp.name
    try:
        return _run(args, corpus, policies, cache_dir)
    finally:
        if tmp is not None:
            tmp.cleanup()


def _run(args, corpus: dict, policies: list[str], cache_dir: str) -> int:
    from kvrag.engine import KVRag
    from kvrag.layout.prompt import DEFAULT_INSTRUCTION, rag_prompt
    from kvrag.policies.model_defaults import default_policy

    print("loading model ...", flush=True)
    # The reference runs on the base model; each policy runs as a user gets it by naming it.
    rag = KVRag(args.model, cache_dir=cache_dir, policy="full_prefill")
    default = default_policy(rag.handle)
    print(f"default policy of this model: {default.label} -- {default.why}", flush=True)
    # (label, policy, parameters) per row: auto shows as the setting it resolves to.
    rows: dict[str, tuple[str, dict]] = {}
    for p in policies:
        name, params = (default.policy, default.params) if p == AUTO_POLICY else (p, {})
        label = f"{default.label} (default)" if p == AUTO_POLICY else p
        if all((name, params) != v for v in rows.values()):
            rows[label] = (name, params)
    # kvlink runs as KVRag(policy="kvlink") runs it: with the model's KVLink adapter (a LoRA
    # adapter ships for the default model), i.e. a model copy with chunk caches of its own;
    # without an adapter it is the same model and the same caches.
    rags = {lab: rag for lab in rows}
    for lab, (name, params) in rows.items():
        if name == "kvlink":
            rags[lab] = KVRag(rag.handle, cache_dir=cache_dir, policy="kvlink", **params)
            if rags[lab].handle is not rag.handle:
                print(
                    "kvlink runs trained: the model's KVLink adapter (LoRA + link tokens) on a model copy", flush=True
                )
    docs = corpus["documents"]
    instruction = corpus.get("instruction") or DEFAULT_INSTRUCTION
    t0 = time.perf_counter()
    for r in {id(r): r for r in rags.values()}.values():
        print(
            "chunk KV of the " + ("base model" if r is rag else "KVLink-adapted model (kvlink's own caches)"),
            flush=True,
        )
        r.precompute(docs, progress=True)
    n_tok = sum(len(rag.chunk_ids(d)) for d in docs)
    print(f"ingested {len(docs)} documents ({n_tok} tokens) in {time.perf_counter() - t0:.1f}s\n")
    # Warm-up: the first call pays one-off costs (allocations, kernels) for every policy alike.
    for lab, (name, params) in rows.items():
        prompt = rag_prompt(rag.tokenizer, docs, "warm-up", instruction)
        rags[lab].generate(prompt, policy=name, max_new_tokens=1, **params)
    ttft: dict[str, list[float]] = {lab: [] for lab in rows}
    print(
        "recomputed = share of the cached (token, layer) pairs the policy computed again "
        "(layers before its selection count in full); = full: the same answer as full_prefill\n"
    )
    # full_prefill first: every other answer is compared with its answer.
    order = sorted(rows, key=lambda lab: lab != "full_prefill")
    width = max(13, *map(len, order))
    same = {lab: 0 for lab in rows}
    for q in corpus["questions"]:
        msgs = rag_prompt(rag.tokenizer, docs, q, instruction)
        print(f"Q: {q}")
        reference = None
        for lab in order:
            name, params = rows[lab]
            out = rags[lab].generate(msgs, policy=name, max_new_tokens=args.max_new_tokens, stop=["\n"], **params)
            s, answer = out.stats, out.text.strip()
            ttft[lab].append(s.ttft_s)
            if lab == "full_prefill":
                reference = answer
            agree = reference is not None and lab != "full_prefill" and answer == reference
            same[lab] += agree
            cut = "..." if out.finish_reason == "length" else ""
            print(
                f"  {lab:<{width}} TTFT {s.ttft_s * 1000:7.0f} ms  cached {s.cached_tokens:5d}  "
                f"recomputed {s.recompute_fraction:5.1%}  | {answer!r}{cut}{'  = full' if agree else ''}"
            )
        print()
    base = sorted(ttft.get("full_prefill", []))
    n = len(corpus["questions"])
    print("median TTFT" + (f" (speed-up vs full_prefill; answers equal to full_prefill's, of {n})" if base else ""))
    for lab in order:
        xs = sorted(ttft[lab])
        med = xs[len(xs) // 2]
        ratio = f"  x{base[len(base) // 2] / med:5.1f}" if base and med > 0 else ""
        agreement = f"  same answer {same[lab]}/{n}" if base and lab != "full_prefill" else ""
        print(f"  {lab:<{width}} {med * 1000:7.0f} ms{ratio}{agreement}")
    return 0
