#!/usr/bin/env bash
# Set up .venv with every optional part the suite exercises, then run the whole test suite.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup_env.sh" all
cd "$ROOT"
exec python -m pytest -q "$@"
