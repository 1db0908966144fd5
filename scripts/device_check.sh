#!/usr/bin/env bash
# One short GPU check (run through the device tool when a task has a GPU lent): at most 9 minutes with
# every part at its limit, about 6 as measured. Each part has its own time limit and its output goes to
# $OUT, so one part failing or running long does not lose the others:
#   1. decode of a Llama-3-8B-shaped model at batch 1, 8, 64, eager and on CUDA graphs (tok/s, achieved
#      bandwidth vs copy, graph capture time and memory, graph overhead, graph vs eager logits, and the KV
#      integrity check's share of a step);
#   2. a Qwen3-30B-A3B-shaped MoE: the fused MoE op's two forms, and Hearth (graphs, and eager) vs
#      transformers end to end;
#   3. the decode graphs' and overlap scheduling's own tests, overlap on/off A/B on the demo model, then
#      engine correctness tests (transformers as the oracle) with the engine on CUDA, graphs and
#      overlap on (the defaults there);
#   4. the Triton kernel tests natively on CUDA.
#
# It installs nothing from the network. Packages the device lacks come as wheels carried in .whl/
# (ignored by git), made here beforehand with (Python 3.12 wheels):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl \
#       msgspec llguidance pyzmq fastapi starlette pydantic pydantic_core uvicorn httptools redis \
#       annotated-types typing-inspection annotated-doc
# and passed to the device tool with carry=[".whl"].
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/device-check}"
mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site:$PWD/src"
else
  export PYTHONPATH="$PWD/src"
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.max.memory --format=csv
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"

SECONDS=0
echo "== 1. dense decode, eager and CUDA graphs"
timeout 100 python3 scripts/bench_gpu_decode.py --batch-sizes 1,8,64 --context 1024 --json "$OUT/decode.json" \
  --profile "$OUT/decode-profile.txt" \
  2>&1 | tee "$OUT/decode.txt"
echo "== 2. MoE  [${SECONDS}s]"
timeout 100 python3 scripts/bench_gpu_moe.py --json "$OUT/moe.json" 2>&1 | grep -v -E "Loading weights|Writing model" \
  | tee "$OUT/moe.txt"
echo "== 3. decode graph tests, then engine tests on CUDA (decode graphs on)  [${SECONDS}s]"
timeout 90 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short tests/test_cuda_graphs.py \
  tests/test_overlap.py 2>&1 | tee "$OUT/graph-tests.txt" | tail -15
timeout 50 python3 scripts/bench_overlap.py --device cuda --batch-sizes 1,8,32 --output-len 64 \
  2>&1 | tee "$OUT/overlap.txt" | tail -5
timeout 160 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short --durations=5 tests/test_engine_correctness.py \
  tests/test_kv_fp8_engine.py tests/test_moe_models.py 2>&1 | tee "$OUT/engine-tests.txt" | tail -25
echo "== 4. Triton kernel tests  [${SECONDS}s]"
timeout 45 python3 -m pytest -q -p no:cacheprovider -m triton tests/test_triton_kernels.py \
  tests/test_attention_backends.py 2>&1 | tee "$OUT/triton-tests.txt" | tail -15
echo "== summary  [${SECONDS}s]"
tail -5 "$OUT/decode.txt"; tail -5 "$OUT/moe.txt"; tail -1 "$OUT/graph-tests.txt"; tail -1 "$OUT/engine-tests.txt"; tail -1 "$OUT/triton-tests.txt"
