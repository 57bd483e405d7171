"""The package layout holds: no import cycle anywhere in kvrag/ (type-only and function-level
imports included), data flowing one way between the layers, the public API importable from
``kvrag``, and ``python -m kvrag``."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "kvrag"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in ROOT.rglob("*.py")}


def _imports(path: Path, known: set[str]) -> set[str]:
    """Every kvrag module ``path`` imports, wherever the import statement stands (module
    level, under TYPE_CHECKING, inside a function). ``from a import b`` names module ``a.b``
    when that is a module, else ``a``. The parent packages Python imports on the way are not
    edges: they are not what the code asks for."""
    me = _module_name(path)
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


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {m: _imports(p, set(mods)) for m, p in mods.items()}


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


def test_the_walker_sees_every_kind_of_import(tmp_path):
    """The cycle check is only as good as its import walk: a type-only import and one inside a
    function both count."""
    src = tmp_path / "kvrag" / "a.py"
    src.parent.mkdir()
    src.write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from kvrag.b import X\n"
        "def f():\n    import kvrag.c\n    from kvrag import d\n",
        encoding="utf-8",
    )
    global ROOT
    saved, ROOT = ROOT, tmp_path / "kvrag"
    try:
        assert _imports(src, {"kvrag.a", "kvrag.b", "kvrag.c", "kvrag.d"}) == {"kvrag.b", "kvrag.c", "kvrag.d"}
        assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    finally:
        ROOT = saved


def test_no_import_cycle_in_kvrag():
    cycle = _find_cycle(_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


# Which layer may import which: the facade on top, then ingestion and the query path, the
# policies (called by the fusion engine through their hooks), the store, and the leaves.
FORBIDDEN = {
    "kvrag.query": ("kvrag.engine", "kvrag.precompute", "kvrag.frameworks", "kvrag.cli", "kvrag.bench"),
    "kvrag.store": (
        "kvrag.engine",
        "kvrag.precompute",
        "kvrag.query",
        "kvrag.policies",
        "kvrag.model",
        "kvrag.arch",
        "kvrag.frameworks",
    ),
    "kvrag.policies": (
        "kvrag.engine",
        "kvrag.precompute",
        "kvrag.query.fusion",
        "kvrag.query.lookup",
        "kvrag.query.decode",
        "kvrag.frameworks",
        "kvrag.store",
    ),
    "kvrag.precompute.ingest": (
        "kvrag.engine",
        "kvrag.precompute.local",
        "kvrag.precompute.redis_queue",
        "kvrag.precompute.worker",
        "kvrag.query.fusion",
        "kvrag.query.lookup",
        "kvrag.query.decode",
        "kvrag.frameworks",
    ),
    "kvrag.precompute": ("kvrag.engine", "kvrag.frameworks"),
    # The serving scheduler sits on the facade; the HTTP layer and the CLI sit on it.
    "kvrag.serve.scheduler": ("kvrag.cli", "kvrag.frameworks", "kvrag.bench"),
    # The Redis queue works through a KVRag's ingestor and store it is handed, never above them.
    "kvrag.precompute.redis_queue": (
        "kvrag.engine",
        "kvrag.precompute.local",
        "kvrag.precompute.worker",
        "kvrag.query",
        "kvrag.policies",
        "kvrag.frameworks",
    ),
    "kvrag.precompute.worker": ("kvrag.engine", "kvrag.precompute.local", "kvrag.query", "kvrag.policies"),
    # The benchmark's driver runs the scenarios, which measure through Measure: never the reverse.
    "kvrag.bench.scenarios": ("kvrag.bench.runner",),
    "kvrag.bench.measure": ("kvrag.bench.runner", "kvrag.bench.scenarios"),
    # The shared defaults are read by the CLI before torch loads: they import nothing of kvrag.
    "kvrag.defaults": ("kvrag",),
    "kvrag.paths": ("kvrag",),
}


def test_only_the_cli_imports_the_server():
    """``kvrag.serve`` (the HTTP server, on FastAPI) sits beside the CLI, above the facade: the
    library never reaches it, so ``import kvrag`` stays free of any web framework."""
    graph = _graph()
    bad = sorted(
        (m, n)
        for m, deps in graph.items()
        if not (m.startswith("kvrag.serve") or m.startswith("kvrag.cli"))
        for n in deps
        if n == "kvrag.serve" or n.startswith("kvrag.serve.")
    )
    assert not bad, f"modules below the server import it: {bad}"


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_data_flows_one_way(layer):
    graph = _graph()
    bad = sorted(
        (m, n)
        for m, deps in graph.items()
        if m == layer or m.startswith(layer + ".")
        for n in deps
        if any(n == f or n.startswith(f + ".") for f in FORBIDDEN[layer])
    )
    assert not bad, f"{layer} reaches back up: {bad}"


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
    """``import kvrag`` (and so ``kvrag --version``) stays light: torch loads with the first
    name that needs it."""
    code = "import sys, kvrag; assert 'torch' not in sys.modules, 'torch loaded'; print(kvrag.__version__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


def test_the_scheduler_loads_no_web_framework():
    code = (
        "import sys, kvrag, kvrag.engine\n"
        "assert not any(m.startswith('kvrag.serve') for m in sys.modules), 'kvrag.serve loaded'\n"
        "import kvrag.serve.scheduler\n"
        "web = sorted(m for m in ('fastapi', 'starlette', 'uvicorn', 'aiohttp', 'flask') if m in sys.modules)\n"
        "assert not web, web\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr
