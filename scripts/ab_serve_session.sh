#!/bin/bash
# Serve c16/c1 A/B between a base worktree and main (session 7, docs/benchmarks.md); edit the paths.
# A/B serve: session start (5ffc1ec) vs main; demo model; c16 and c1; alternating rounds
out=/tmp/ab; mkdir -p $out
run() { # name dir port
  name=$1; dir=$2; port=$3; round=$4
  cd $dir
  PYTHONPATH=$dir/src /work/venv/bin/hearth serve --model $dir/models/demo --port $port > $out/$name-$round.log 2>&1 &
  pid=$!
  for i in $(seq 1 240); do curl -sf http://127.0.0.1:$port/health >/dev/null && break; sleep 1; done
  sleep 2
  # warm-up (the base builds its kernels in the background after ready)
  PYTHONPATH=$dir/src /work/venv/bin/hearth bench serve --base-url http://127.0.0.1:$port --model demo --tokenizer $dir/models/demo --endpoint completions --workload random --random-input-len 256 --random-output-len 64 --ignore-eos --num-prompts 32 --max-concurrency 16 > /dev/null 2>&1
  for i in $(seq 1 300); do grep -q 'CPU kernels ready\|kernels.*ready' $out/$name-$round.log && break; sleep 1; done
  for c in 16 1; do
    n=$(( c == 16 ? 64 : 12 ))
    PYTHONPATH=/work/main/src /work/venv/bin/hearth bench serve --base-url http://127.0.0.1:$port --model demo --tokenizer $dir/models/demo --endpoint completions --workload random --random-input-len 256 --random-output-len 64 --ignore-eos --num-prompts $n --max-concurrency $c --result-dir $out/$name-c$c-$round --no-plots --no-progress > $out/$name-c$c-$round.txt 2>&1
  done
  kill $pid; wait $pid 2>/dev/null
}
for r in 1 2; do
  run base /work/wt/base 18101 $r
  run main /work/main 18102 $r
done
echo AB_DONE
