#!/usr/bin/env bash
# KV integrity on vs off, side by side, alternating (the machine is shared and noisy): `hearth bench offline`
# and `hearth bench serve` at c1 and c16. Usage: scripts/bench_kv_integrity.sh OUT_DIR [PAIRS] [MODEL]
# Env: OFFLINE_ARGS, SERVE_C16_ARGS, SERVE_C1_ARGS override the sizes (defaults: docs/benchmarks.md's runs).
set -euo pipefail
out=${1:?OUT_DIR}; pairs=${2:-3}; model=${3:-/tmp/bench-models/llama-tiny-rand}
mkdir -p "$out"
hearth=(python -m hearth.cli)
offline=${OFFLINE_ARGS:---num-prompts 64 --input-len 128 --output-len 128 --prompts-file /tmp/bench-models/prompts_64x128.json}
c16=${SERVE_C16_ARGS:---num-prompts 64 --max-concurrency 16}
c1=${SERVE_C1_ARGS:---num-prompts 16 --max-concurrency 1}
serve_once() {  # $1 = on|off, $2 = pair
    local port=$((17400 + RANDOM % 500))
    "${hearth[@]}" serve --model "$model" --port "$port" --max-model-len 2048 --kv-integrity "$1" \
        > "$out/serve-$1-$2.log" 2>&1 &
    local pid=$!
    for _ in $(seq 600); do curl -sf "http://127.0.0.1:$port/health" > /dev/null && break; sleep 1; done
    for conc in c16 c1; do
        local args=$c16; [ "$conc" = c1 ] && args=$c1
        "${hearth[@]}" bench serve --base-url "http://127.0.0.1:$port" --model "$(basename "$model")" \
            --tokenizer "$model" --workload random --random-input-len 256 --random-output-len 64 --ignore-eos \
            --no-plots --no-progress $args --result-dir "$out/serve-$conc-$1-$2" --label "$1" \
            > "$out/serve-$conc-$1-$2.txt" 2>&1
    done
    kill "$pid"; wait "$pid" || true
}
for pair in $(seq "$pairs"); do
    order="on off"; [ $((pair % 2)) -eq 0 ] && order="off on"
    for mode in $order; do
        "${hearth[@]}" bench offline --model "$model" $offline --kv-integrity "$mode" \
            --output-json "$out/offline-$mode-$pair.json" > "$out/offline-$mode-$pair.txt" 2>&1
        serve_once "$mode" "$pair"
    done
done
echo "done: $out"
