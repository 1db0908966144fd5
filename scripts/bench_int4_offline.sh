#!/usr/bin/env bash
# INT4 (W4A8, RTN g128 incl. the LM head) vs the BF16 checkpoint on Hearth's best path for it on this CPU
# (float32 compute, bf16 weight copies read by the bf16 skinny kernel up to 16 rows, oneDNN beyond), end to
# end through `hearth bench offline`, alternating A/B per round; prints output tok/s per batch and the ratio.
#
#   TORCH_EXTENSIONS_DIR=/tmp/k scripts/bench_int4_offline.sh [MODEL] [ROUNDS] [THREADS]
#
# Defaults: /tmp/bench-models/llama-tiny-rand, 2 rounds, 1 thread. ~3 min on a quiet 2-core machine.
set -euo pipefail
MODEL=${1:-/tmp/bench-models/llama-tiny-rand}
ROUNDS=${2:-2}
THREADS=${3:-1}
PY=${PYTHON:-python}
OUT=$(mktemp -d)
for batch in 1 4 16; do
  for round in $(seq "$ROUNDS"); do
    for quant in auto int4; do
      $PY -m hearth.cli bench offline --model "$MODEL" --quantization "$quant" --num-prompts $((batch * 2)) \
        --max-num-seqs "$batch" --input-len 32 --output-len 128 --num-threads "$THREADS" \
        --kv-cache-memory 0.25 --output-json "$OUT/b${batch}-${quant}-${round}.json" >/dev/null 2>&1
    done
  done
done
$PY - "$OUT" "$ROUNDS" <<'PY'
import json, statistics, sys
from pathlib import Path
out, rounds = Path(sys.argv[1]), int(sys.argv[2])
print("| batch | BF16 output tok/s | INT4 output tok/s | INT4 / BF16 | peak RSS GiB BF16 / INT4 |")
print("|---|---|---|---|---|")
for batch in (1, 4, 16):
    runs = {q: [json.loads((out / f"b{batch}-{q}-{r}.json").read_text()) for r in range(1, rounds + 1)] for q in ("auto", "int4")}
    tps = {q: max(r["output_throughput_tok_s"] for r in v) for q, v in runs.items()}
    rss = {q: max(r["peak_rss_gib"] for r in v) for q, v in runs.items()}
    print(f"| {batch} | {tps['auto']:.1f} | {tps['int4']:.1f} | {tps['int4'] / tps['auto']:.2f}x | {rss['auto']:.3f} / {rss['int4']:.3f} |")
PY
