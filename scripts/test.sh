#!/usr/bin/env bash
# Set up (idempotent) and run the test suite; extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
# Tests never reach a model hub: every model comes from a local file or package.
HF_HUB_OFFLINE=1 exec .venv/bin/python -m pytest -q -ra "$@"
