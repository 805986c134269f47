#!/usr/bin/env bash
# Build the carry for bench/gpu_check on the lent GPU machine: wheels for Python 3.12 on x86-64
# of DeepSpeed and what it needs that the device image lacks. The image has Python 3.12, torch
# 2.11.0+cu130, triton 3.6.0, transformers 5.17.0, einops, msgpack, ninja, numpy, packaging, psutil,
# py-cpuinfo and tqdm, but no DeepSpeed, Ray or vLLM, no pydantic and no hjson, and it cannot fetch
# anything. The wheels go to .gpu_bundle/ (gitignored), at most 64 MiB in all (the device tool's
# limit on what travels); the device command (bench/RESULTS.md, "GPU check") carries that folder.
#
#   bash bench/gpu_bundle.sh            # PYTHON=python3 by default; any Python with pip will do
#
# DeepSpeed is published as an sdist only: it is built here into a pure-Python wheel without its
# ops (DS_BUILD_OPS=0, the default; built in an isolated environment without torch, so no op is
# pre-compiled). rltt's DeepSpeed config asks for torch's AdamW ("torch_adam": true), so ZeRO-2 on
# CUDA loads no DeepSpeed op: nothing has to JIT-compile on the device.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${GPU_BUNDLE_DIR:-$ROOT/.gpu_bundle}"
PYTHON="${PYTHON:-python3}"
LIMIT_MIB=64

# one version of each (two versions of one package stop the device's install); pydantic pins its core
DEEPSPEED=deepspeed==0.19.8
BINARY=(pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
        typing-extensions==4.16.0 hjson==3.1.0)

rm -rf "$OUT"
mkdir -p "$OUT"
echo "gpu_bundle: building the $DEEPSPEED wheel (pure Python, ops JIT) into $OUT"
DS_BUILD_OPS=0 "$PYTHON" -m pip wheel -q --no-deps --no-binary deepspeed -w "$OUT" "$DEEPSPEED"
echo "gpu_bundle: downloading ${BINARY[*]} for CPython 3.12 manylinux x86-64"
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$OUT" "${BINARY[@]}"

count=$(find "$OUT" -name '*.whl' | wc -l)
expected=$((1 + ${#BINARY[@]}))
if [ "$count" -ne "$expected" ]; then
    echo "gpu_bundle: expected $expected wheels, found $count in $OUT" >&2
    exit 1
fi
bytes=$(du -sb "$OUT" | cut -f1)
ls -l "$OUT"
echo "gpu_bundle: $count wheels, $((bytes / 1024)) KiB in $OUT"
if [ "$bytes" -gt $((LIMIT_MIB * 1024 * 1024)) ]; then
    echo "gpu_bundle: $OUT is over $LIMIT_MIB MiB" >&2
    exit 1
fi
