#!/bin/bash
# Serve c16/c1 A/B between two checkouts of Hearth (docs/benchmarks.md, "Session 7 as a whole"):
#
#     git worktree add /tmp/base 5ffc1ec && scripts/ab_serve_session.sh /tmp/base . [ROUNDS]
#
# Each round starts the base's server, then the head's, on the demo model; waits for its CPU kernels; warms
# up; runs `hearth bench serve` (random 256 in / 64 out) at concurrency 16 and 1 with the head's load
# generator; stops it. Results under $OUT (default /tmp/ab). Needs `hearth` on PATH (the project's venv).
set -u
base=$(cd "$1" && pwd); head=$(cd "$2" && pwd); rounds=${3:-2}
out=${OUT:-/tmp/ab}; mkdir -p "$out"
bench() { # port tokenizer-dir args...
  local port=$1 tokenizer=$2; shift 2
  PYTHONPATH=$head/src hearth bench serve --base-url "http://127.0.0.1:$port" --model demo \
    --tokenizer "$tokenizer" --endpoint completions --workload random --random-input-len 256 \
    --random-output-len 64 --ignore-eos "$@"
}
run() { # name dir port round
  local name=$1 dir=$2 port=$3 round=$4
  PYTHONPATH=$dir/src hearth serve --model "$dir/models/demo" --port "$port" > "$out/$name-$round.log" 2>&1 &
  local pid=$!
  for _ in $(seq 1 240); do curl -sf "http://127.0.0.1:$port/health" > /dev/null && break; sleep 1; done
  bench "$port" "$dir/models/demo" --num-prompts 32 --max-concurrency 16 > /dev/null 2>&1  # warm-up
  # Older checkouts build their kernels in the background after "ready": wait for them.
  for _ in $(seq 1 300); do grep -q 'CPU kernels ready' "$out/$name-$round.log" && break; sleep 1; done
  for c in 16 1; do
    local n=$(( c == 16 ? 64 : 12 ))
    bench "$port" "$dir/models/demo" --num-prompts "$n" --max-concurrency "$c" \
      --result-dir "$out/$name-c$c-$round" --no-plots --no-progress > "$out/$name-c$c-$round.txt" 2>&1
  done
  kill "$pid"; wait "$pid" 2> /dev/null
}
for r in $(seq 1 "$rounds"); do
  run base "$base" 18101 "$r"
  run head "$head" 18102 "$r"
done
grep -H 'output tokens/s' "$out"/*-c*-*.txt
