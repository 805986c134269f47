#!/usr/bin/env bash
# The main job on the embedded default: set up .venv, then RL-train the quickstart LoopLM on CPU
# (the model itself is pretrained on first use, ~5 min on 2 cores, and cached in ~/.cache/rltt).
# Each run gets its own runs/quickstart-DATE directory. Extra arguments are recipe overrides,
# e.g.  bash scripts/quickstart.sh train.steps=20
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup_env.sh" dev
cd "$ROOT"
exec rltt train recipes/quickstart.yaml "logging.run_dir=runs/quickstart-$(date +%Y%m%d-%H%M%S)" "$@"
