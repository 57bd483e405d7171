"""The package layout holds: the layers of kvrag/ are declared below, bottom to top, and an import
walk (type-only and function-level imports included) finds no cycle and no module importing one
of a higher layer or a sibling group of its own, in kvrag/ and in the integration packages; the
public API is importable from ``kvrag``, and ``python -m kvrag`` runs."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ROOT = REPO / "kvrag"
# The integration packages: their package folder and the folder their module names start from.
INTEGRATIONS = {
    REPO / "integrations" / "llama-index-llms-kvrag" / "llama_index" / "llms" / "kvrag": (
        REPO / "integrations" / "llama-index-llms-kvrag"
    ),
    REPO / "integrations" / "langchain-kvrag" / "langchain_kvrag": REPO / "integrations" / "langchain-kvrag",
}

# The layers of kvrag/, bottom to top; each is a list of sibling groups. A module may import the
# modules of its own group and of every lower layer: never a sibling group of its layer, nor
# anything above. A name stands for that module and, for a package, every module under it;
# ``kvrag`` alone is the package's own ``__init__`` (the public API).
LAYERS: list[list[tuple[str, ...]]] = [
    # Leaves, importing nothing of kvrag: the errors, the torch-free defaults the CLI reads before
    # torch loads, the kvrag home, the packaged data files.
    [("kvrag.errors",), ("kvrag.defaults",), ("kvrag.paths",), ("kvrag.data",)],
    # Argument checks, bounds derived from a model, output paths.
    [("kvrag.checks", "kvrag.limits", "kvrag.outpaths")],
    # The store tiers (the model's fingerprint digests read the store's key rule).
    [("kvrag.store",)],
    # The model: one decoder layer (Arch), loading, the chunk prefill, tiny test models.
    [("kvrag.arch", "kvrag.model", "kvrag.chunk", "kvrag.testing")],
    # What the policies read: a prompt's layout and the fusion state; the QA examples.
    [("kvrag.layout",), ("kvrag.qa",)],
    # The policies, called by the fusion engine through their hooks.
    [("kvrag.policies",)],
    # The query engine (lookup, fusion, decode) and ingestion, side by side.
    [("kvrag.query",), ("kvrag.precompute",)],
    # The facade and the public API.
    [("kvrag.engine", "kvrag")],
    # On the facade: what the framework adapters share; the serving scheduler and the
    # per-token log-probabilities it records (no web framework).
    [("kvrag.frameworks",), ("kvrag.serve.scheduler", "kvrag.serve.ticket", "kvrag.serve.logprobs")],
    # The HTTP server on the scheduler; the benchmark.
    [("kvrag.serve",), ("kvrag.bench",)],
    # The console command.
    [("kvrag.cli", "kvrag.__main__")],
]

# The in-process precompute queue: the Precomputer and the modules only it uses.
# (packs.py, one pack computed with each chunk retried alone when it fails, is the rule both
# queues share: the in-process queue and the Redis workers import it.)
IN_PROCESS_QUEUE = (
    "kvrag.precompute.local",
    "kvrag.precompute.progress",
    "kvrag.precompute.worker_threads",
)

# Finer rules inside a layer, where its groups are coarser than the data flow.
FORBIDDEN = {
    # One ingestion computation under the queues that run it.
    "kvrag.precompute.ingest": (*IN_PROCESS_QUEUE, "kvrag.precompute.redis_queue", "kvrag.precompute.worker"),
    # The Redis queue and its workers work through the KVRag's ingestor and store they are
    # handed, never the policies or the in-process queue.
    "kvrag.precompute.redis_queue": (*IN_PROCESS_QUEUE, "kvrag.precompute.worker", "kvrag.policies"),
    "kvrag.precompute.worker": (*IN_PROCESS_QUEUE, "kvrag.policies"),
    # Policies get their chunks' entries from the fusion state, never from a store.
    "kvrag.policies": ("kvrag.store",),
    # The benchmark's driver runs the scenarios, which measure through Measure: never the reverse.
    "kvrag.bench.scenarios": ("kvrag.bench.runner",),
    "kvrag.bench.measure": ("kvrag.bench.runner", "kvrag.bench.scenarios"),
}

#: What the integration packages may import: the layers up to the facade and the adapters' core.
INTEGRATIONS_TOP = "kvrag.engine"
INTEGRATIONS_ALSO = ("kvrag.frameworks",)


def _module_name(path: Path, base: Path) -> str:
    parts = path.relative_to(base).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules(pkg: Path, base: Path) -> dict[str, Path]:
    return {_module_name(p, base): p for p in pkg.rglob("*.py")}


def _imports(path: Path, me: str, known: set[str]) -> set[str]:
    """Every module of ``known`` the module ``me`` (at ``path``) imports, wherever the import
    statement stands (module level, under TYPE_CHECKING, inside a function). ``from a import b``
    names module ``a.b`` when that is a module, else ``a``. The parent packages Python imports
    on the way are not edges: they are not what the code asks for."""
    is_pkg = path.name == "__init__.py"
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative import
                pkg = me.split(".") if is_pkg else me.split(".")[:-1]
                pkg = pkg[: len(pkg) - (node.level - 1)]
                base = ".".join([*pkg, base] if base else pkg)
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        out.update(n for n in names if n in known and n != me)
    return out


def _graph(with_integrations: bool = False) -> dict[str, set[str]]:
    """Module -> the modules it imports, over kvrag/ (and the integration packages)."""
    mods = _modules(ROOT, REPO)
    if with_integrations:
        for pkg, base in INTEGRATIONS.items():
            mods.update(_modules(pkg, base))
    known = set(mods)
    return {m: _imports(p, m, known) for m, p in mods.items()}


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return stack[stack.index(n) :] + [n]
            if n not in state and (c := visit(n)):
                return c
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (c := visit(m)):
            return c
    return None


def _covers(name: str, module: str) -> bool:
    return module == name or (name != "kvrag" and module.startswith(name + "."))


def _place(module: str) -> tuple[int, int] | None:
    """(layer, group) of ``module``: the group naming it most closely (``kvrag.serve.scheduler``
    before ``kvrag.serve``); None when no group names it."""
    best: tuple[int, tuple[int, int]] | None = None
    for li, layer in enumerate(LAYERS):
        for gi, group in enumerate(layer):
            for name in group:
                if _covers(name, module) and (best is None or len(name) > best[0]):
                    best = (len(name), (li, gi))
    return best[1] if best else None


def _upward(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """The imports that break the layers: to a higher layer, to a sibling group, or one the
    finer rules forbid."""
    bad = []
    for m, deps in graph.items():
        here = _place(m)
        for n in deps:
            there = _place(n)
            if here is None or there is None:
                continue  # test_every_module_has_a_layer names these
            sibling = there[0] == here[0] and there[1] != here[1]
            finer = any(_covers(low, m) and any(_covers(f, n) for f in high) for low, high in FORBIDDEN.items())
            if there[0] > here[0] or sibling or finer:
                bad.append((m, n))
    return sorted(bad)


def test_the_walker_sees_every_kind_of_import(tmp_path):
    """The checks are only as good as the import walk: a type-only import, one inside a
    function and a relative one all count."""
    src = tmp_path / "kvrag" / "a.py"
    src.parent.mkdir()
    src.write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from kvrag.b import X\n"
        "def f():\n    import kvrag.c\n    from kvrag import d\n    from . import e\n",
        encoding="utf-8",
    )
    known = {"kvrag.a", "kvrag.b", "kvrag.c", "kvrag.d", "kvrag.e"}
    assert _imports(src, _module_name(src, tmp_path), known) == {"kvrag.b", "kvrag.c", "kvrag.d", "kvrag.e"}
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_the_layer_check_catches_each_kind_of_arrow_back_up():
    """Up a layer (policies -> the benchmark, training pulling in its generator), to a sibling
    (the scheduler -> the framework adapters), against a finer rule, and the package's own
    ``__init__`` (the public API) above everything it re-exports."""
    assert _upward({"kvrag.policies.kvlink.data": {"kvrag.bench.synthetic"}}) == [
        ("kvrag.policies.kvlink.data", "kvrag.bench.synthetic")
    ]
    assert _upward({"kvrag.serve.scheduler": {"kvrag.frameworks.options"}}) != []
    assert _upward({"kvrag.precompute.worker": {"kvrag.policies.base"}}) != []
    assert _upward({"kvrag.layout.state": {"kvrag.policies.base"}}) != []
    assert _upward({"kvrag.policies.kvlink.train": {"kvrag"}}) != []
    assert _upward({"kvrag.query.fusion": {"kvrag.policies.base", "kvrag.layout.state"}}) == []
    assert _place("kvrag.serve.scheduler") != _place("kvrag.serve.app")


def test_every_module_has_a_layer():
    """A new module is placed in ``LAYERS`` (and each name there names something)."""
    mods = set(_modules(ROOT, REPO))
    assert not sorted(m for m in mods if _place(m) is None), "modules in no layer"
    names = [n for layer in LAYERS for group in layer for n in group]
    assert len(names) == len(set(names))
    assert not [n for n in names if not any(_covers(n, m) for m in mods)], "layer names naming no module"


def test_no_import_cycle():
    cycle = _find_cycle(_graph(with_integrations=True))
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_data_flows_one_way():
    bad = _upward(_graph())
    assert not bad, "imports reaching back up: " + ", ".join(f"{m} -> {n}" for m, n in bad)


def test_the_integrations_import_only_the_library_and_the_adapters_core():
    """The integration packages sit on ``kvrag.frameworks`` and the public API: never on the
    server's modules (the hooks' ``server=`` client is ``kvrag.frameworks.ServerChunks``), the
    benchmark or the CLI."""
    top = _place(INTEGRATIONS_TOP)
    assert top is not None
    graph = _graph(with_integrations=True)
    seen, bad = set(), []
    for m, deps in graph.items():
        if m.split(".")[0] == "kvrag":
            continue
        for n in deps:
            if n.split(".")[0] != "kvrag":
                continue
            seen.add(n)
            there = _place(n)
            if there is None or (there[0] > top[0] and not any(_covers(a, n) for a in INTEGRATIONS_ALSO)):
                bad.append((m, n))
    assert {"kvrag.engine", "kvrag.frameworks"} <= seen  # the walk reached both packages
    assert not bad, f"integrations import above the facade: {sorted(bad)}"


def test_the_fusion_engine_names_no_policy():
    src = (ROOT / "query" / "fusion.py").read_text(encoding="utf-8")
    from kvrag.policies import policy_names

    named = [p for p in policy_names() if f'"{p}"' in src or f"'{p}'" in src]
    assert not named, f"kvrag.query.fusion names policies {named}"


def test_core_imports_no_framework():
    for path in ROOT.rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            mods = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            for m in mods:
                assert not m.startswith(("llama_index", "langchain")), f"{path} imports {m}"


def test_public_api_from_the_package():
    import kvrag
    from kvrag import KVRag, Precomputer, StoreError
    from kvrag.engine import KVRag as engine_KVRag
    from kvrag.errors import KVRagError

    assert KVRag is engine_KVRag and issubclass(StoreError, KVRagError)
    assert Precomputer.__module__ == "kvrag.precompute.local"
    assert set(kvrag.__all__) <= set(dir(kvrag)) and "KVRag" in kvrag.__all__
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        kvrag.Nope  # noqa: B018


def test_python_dash_m_kvrag():
    out = subprocess.run([sys.executable, "-m", "kvrag", "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "usage: kvrag" in out.stdout and "policies" in out.stdout


def test_import_kvrag_does_not_load_torch():
    """``import kvrag`` (and so ``kvrag --version``) stays light: torch, and the hooks' HTTP
    client, load with the first name that needs them."""
    code = (
        "import sys, kvrag\n"
        "loaded = [m for m in ('torch', 'httpx') if m in sys.modules]\n"
        "assert not loaded, loaded\n"
        "print(kvrag.__version__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


WEB = "('fastapi', 'starlette', 'uvicorn', 'aiohttp', 'flask')"


def test_the_scheduler_loads_no_web_framework():
    code = (
        "import sys, kvrag, kvrag.engine\n"
        "assert not any(m.startswith('kvrag.serve') for m in sys.modules), 'kvrag.serve loaded'\n"
        "import kvrag.serve.scheduler\n"
        f"web = sorted(m for m in {WEB} if m in sys.modules)\n"
        "assert not web, web\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr


def test_the_adapters_core_loads_no_server():
    """``kvrag.frameworks`` (what the integrations import, the hooks' ``server=`` client
    included) loads neither the server's modules nor a web framework."""
    code = (
        "import sys, kvrag.frameworks as fw\n"
        "assert not any(m.startswith('kvrag.serve') for m in sys.modules), 'kvrag.serve loaded'\n"
        f"web = sorted(m for m in {WEB} if m in sys.modules)\n"
        "assert not web, web\n"
        "fw.hook_target('KVPrecompute', server='http://127.0.0.1:9')\n"
        "assert not any(m.startswith('kvrag.serve') for m in sys.modules), 'kvrag.serve loaded'\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr


def test_the_server_client_imports_httpx_when_used():
    """The hooks' ``ServerChunks`` imports httpx inside the calls that need it, not with its
    module: a pipeline without a server never needs it installed."""
    tree = ast.parse((ROOT / "frameworks" / "server_chunks.py").read_text(encoding="utf-8"))

    def httpx_imports(nodes) -> int:
        return sum(isinstance(n, ast.Import) and any(a.name == "httpx" for a in n.names) for n in nodes)

    assert httpx_imports(tree.body) == 0
    assert httpx_imports(ast.walk(tree)) > 0
