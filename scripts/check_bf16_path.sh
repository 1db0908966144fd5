#!/usr/bin/env bash
# The checks of issue 11's bf16 path on a CPU with bf16 math (avx512_bf16 / amx_bf16): the CPU and its
# flags, the correctness tests of the prepacked bf16 linear (they skip on AVX2-only CPUs), and the
# interleaved timing of F.linear bf16 vs the prepacked weight. Needs a python with torch (and pytest).
#   scripts/check_bf16_path.sh [PYTHON]
set -uo pipefail
py=${1:-python3}
cd "$(dirname "$0")/.."
lscpu | grep -E 'Model name|^CPU\(s\)|Thread|Socket'
grep -o -w -E 'avx2|avx512f|avx512bw|avx512_bf16|avx512_fp16|amx_bf16|amx_tile' /proc/cpuinfo | sort | uniq -c
"$py" -c 'import torch; print("torch", torch.__version__, torch.backends.cpu.get_cpu_capability(), "onednn bf16", torch.ops.mkldnn._is_mkldnn_bf16_supported())' || exit 1
export PYTHONPATH=$PWD/src
if "$py" -c 'import pytest' 2>/dev/null; then
  "$py" -m pytest -q -p no:cacheprovider tests/test_cpu_capability.py 2>&1 | tail -15
else
  echo "no pytest here"
fi
taskset -c 0-1 "$py" scripts/bench_bf16_linear.py --threads 2 --min-time-s 0.1
"$py" scripts/bench_bf16_linear.py --threads 8 --min-time-s 0.1 --rows 1 64
