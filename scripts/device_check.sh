#!/usr/bin/env bash
# One short GPU check (run through the device tool when a task has a GPU lent): the Triton kernel tests
# natively on CUDA, then the decode benchmark of a Llama-3-8B-shaped model at batch 1, 8 and 64.
#
# It installs nothing from the network. Packages the device lacks (msgspec, llguidance, xxhash, pyzmq)
# come as wheels carried in device-wheels/, made here beforehand with:
#   pip download --python-version 3.12 --only-binary=:all: --platform manylinux2014_x86_64 \
#       -d device-wheels msgspec llguidance xxhash pyzmq
# and passed to the device tool with carry=["device-wheels"].
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src"
OUT="${OUT:-/tmp/device-check}"
mkdir -p "$OUT"
if [ -d device-wheels ]; then
  python -m pip install -q --no-index --find-links device-wheels msgspec llguidance xxhash pyzmq
fi
nvidia-smi --query-gpu=name,memory.total,clocks.max.memory --format=csv
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
python -m pytest -q -p no:cacheprovider -m triton tests/test_triton_kernels.py tests/test_attention_backends.py \
  2>&1 | tee "$OUT/triton-tests.txt"
python scripts/bench_gpu_decode.py --batch-sizes 1,8,64 --context 1024 --json "$OUT/decode.json" \
  2>&1 | tee "$OUT/decode.txt"
