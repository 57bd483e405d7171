#!/usr/bin/env bash
# Set up (idempotent) and run the demo; extra arguments go to `kvrag demo`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
HF_HUB_OFFLINE=1 exec .venv/bin/kvrag demo "$@"
