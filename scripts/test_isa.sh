#!/usr/bin/env bash
# The exactness-sensitive tests (engine, replay, learner parity, row records, LoRA) again under the CPU
# code paths this machine does not pick by itself: ATen's portable kernels with MKL limited to SSE4.2 on
# every machine, and AVX2 where the CPU has more (AVX-512). A test whose expectation holds on one
# instruction set only fails here (docs/design.md §3.8). Usage: bash scripts/test_isa.sh [pytest args]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup_env.sh" all
cd "$ROOT"
# the Triton tests run in Triton's interpreter (NumPy), which neither variable steers
TESTS=(tests/rollout tests/learner tests/orchestration/test_row_records.py tests/model/test_adapters.py
       tests/model/test_packing.py --ignore=tests/rollout/test_triton_attention.py
       --ignore=tests/rollout/test_triton_capture.py -m "not heavy")
lane() {
  echo "== ISA lane: $*"
  env "$@" python -m pytest -q -p no:cacheprovider "${TESTS[@]}" "${EXTRA[@]}"
}
EXTRA=("$@")
lane MKL_ENABLE_INSTRUCTIONS=SSE4_2 ATEN_CPU_CAPABILITY=default
widest="$(python -c 'import torch; print(torch.backends.cpu.get_cpu_capability())')"
if [ "$widest" = "AVX512" ]; then
  lane MKL_ENABLE_INSTRUCTIONS=AVX2 ATEN_CPU_CAPABILITY=avx2
fi
