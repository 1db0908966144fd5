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
python - "$out" <<'PY'
# Ratios on/off of the medians over the pairs (throughput: on/off, > 1 is faster with integrity on;
# p99: on/off, > 1 is slower with it on). The goal: throughput ratio >= 0.995, p99 ratio <= 1.005.
import glob, json, os, statistics, sys
out = sys.argv[1]
def med(pattern, key):
    values = [json.load(open(f))[key] for f in sorted(glob.glob(os.path.join(out, pattern)))]
    return statistics.median(values) if values else float("nan")
rows = [("offline", "offline-{}-*.json", "output_throughput_tok_s", None)]
for conc in ("c16", "c1"):
    rows.append((f"serve {conc}", f"serve-{conc}-{{}}-*/{{}}.json", "output_throughput", ("p99_tpot_ms", "p99_e2el_ms")))
print(f"load average now {os.getloadavg()[0]:.1f}")
for name, pattern, throughput, p99s in rows:
    on, off = (med(pattern.format(m, m), throughput) for m in ("on", "off"))
    line = f"{name}: throughput on {on:.1f} / off {off:.1f} = {on / off:.4f}"
    for key in p99s or ():
        p_on, p_off = (med(pattern.format(m, m), key) for m in ("on", "off"))
        line += f"; {key} on {p_on:.2f} / off {p_off:.2f} = {p_on / p_off:.4f}"
    print(line)
PY
echo "done: $out"
