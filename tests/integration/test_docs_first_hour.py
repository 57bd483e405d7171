"""What a newcomer reads and runs first: the README's promises and the quickstart's
LlamaIndex / LangChain snippets, run as written, twice in a row."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_readme_says_what_the_default_model_costs_on_disk():
    readme = (ROOT / "README.md").read_text()
    setup = readme.split("## Set-up", 1)[1].split("##", 1)[0]
    block = re.search(r"```bash\n(.*?)```", setup, re.S).group(1)
    assert [line.split("#")[0].strip() for line in block.strip().splitlines()] == [
        "bash scripts/demo.sh",
        "bash scripts/test.sh",
    ]  # exactly the two set-up commands
    for fact in ("Q4_1", "517 MB", "~/.cache/kvrag", "KVRAG_HOME", "XDG_CACHE_HOME", "delete"):
        assert fact in readme, fact


@pytest.mark.real
def test_readme_size_and_place_of_the_converted_model_are_true():
    from kvrag.model import ModelHandle
    from kvrag.paths import default_home

    h = ModelHandle.load()
    weights = Path(h.load_info["weights_dir"])
    assert weights.parent == default_home() / "models"
    size = sum(f.stat().st_size for f in weights.iterdir())
    assert abs(size / 1e6 - 517) < 0.05 * 517 or abs(size / 2**20 - 517) < 0.05 * 517, size


def snippet(heading: str) -> str:
    """The first python block under ``### heading`` in docs/quickstart.md."""
    doc = (ROOT / "docs" / "quickstart.md").read_text()
    section = doc.split(f"### {heading}\n", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


# What the test reads after the snippet ran: the documents stored, and the first query's hits.
CHECKS = {
    "LlamaIndex": "print('DOCS', collection.count()); "
    "print('HIT', llm.last_stats.chunks_hit, llm.last_stats.cached_tokens)",
    "LangChain": "print('DOCS', len(store.get()['ids'])); "
    "print('HIT', llm.last_stats.chunks_hit, llm.last_stats.cached_tokens)",
}


@pytest.mark.real
@pytest.mark.parametrize("framework", ["LlamaIndex", "LangChain"])
def test_quickstart_snippet_runs_twice_with_the_same_documents_and_hits(framework, tmp_path):
    code = snippet(framework) + "\n" + CHECKS[framework] + "\n"
    (tmp_path / "snippet.py").write_text(code)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "ANONYMIZED_TELEMETRY": "False"}
    runs = []
    for _ in range(2):
        r = subprocess.run(
            [sys.executable, "snippet.py"], cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env
        )
        assert r.returncode == 0, r.stderr[-3000:]
        out = dict(line.split(" ", 1) for line in r.stdout.splitlines() if line.startswith(("DOCS ", "HIT ")))
        runs.append(out)
    assert runs[0]["DOCS"] == runs[1]["DOCS"] == "3"  # idempotent: no duplicates on the re-run
    for out in runs:
        chunks_hit, cached = map(int, out["HIT"].split())
        assert chunks_hit >= 1 and cached > 0, out  # the first query of each run hits the cache
