#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment in .venv and install rltt into it.
# torch 2.13.0 goes in first, so no later requirement can pull a multi-GB CUDA build.
# Usage: source scripts/setup_env.sh [EXTRAS]    (EXTRAS defaults to "dev")
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
EXTRAS="${1:-dev}"
VENV="${RLTT_VENV:-$ROOT/.venv}"
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
# shellcheck disable=SC1091
source "$VENV/bin/activate"
STAMP="$VENV/.rltt-installed-$EXTRAS-$(cat "$ROOT/pyproject.toml" | cksum | cut -d' ' -f1)"
if [ ! -f "$STAMP" ]; then
  python -m pip install -q --upgrade pip
  python -c "import torch, sys; sys.exit(0 if torch.__version__.startswith('2.13.0') else 1)" 2>/dev/null \
    || python -m pip install -q "torch==2.13.0"
  python -m pip install -q -e "$ROOT[$EXTRAS]"
  touch "$STAMP"
fi
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$HOME/.cache/rltt/torch_extensions}"
export RAY_AUTH_MODE="${RAY_AUTH_MODE:-disabled}"
export TOKENIZERS_PARALLELISM="${TOKENIZERS_PARALLELISM:-false}"
export HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}"
