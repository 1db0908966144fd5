"""Rank 0's per-step cost of driving the ranks: its Python time per decode step and the bytes it sends the
other ranks per step (issue 25's goal), on a batch of equal requests in steady decode.

    PYTHONPATH=src python scripts/profile_step_overhead.py [--tp 2] [--batch 64] [--model models/demo]

Per steady decode step (every request past its prompt), medians over the steps:
- `step_ms`: `Engine.step()` on rank 0, wall;
- `forward_ms`: the model's forward on rank 0 (its shard's compute and the collectives with the other ranks);
- `host_ms` = step - forward: rank 0's Python time around the model (schedule, build and send the step, the
  worker's preparation, sampling, outputs) -- the goal's "Python time per decode step"; `host_cpu_ms`: the
  same in the main thread's CPU time (steadier on a shared machine: time spent descheduled is left out);
- `build_ms`: building the step message; `send_ms`: encoding and publishing it (executor minus its worker);
- `step_bytes`: the encoded step message rank 0 publishes (each other rank receives these bytes).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import time
from collections.abc import Callable
from typing import Any


def timed(record: list[float], fn: Callable[..., Any], cpu: list[float] | None = None) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start, start_cpu = time.perf_counter(), time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            record.append(time.perf_counter() - start)
            if cpu is not None:
                cpu.append(time.thread_time() - start_cpu)

    return wrapper


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="models/demo")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=96)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--penalties", action="store_true", help="every request with a repetition penalty")
    parser.add_argument("--profile", action="store_true", help="cProfile the steady steps (top functions)")
    parser.add_argument("--parts", action="store_true", help="CPU ms per step of each part of rank 0's step")
    args = parser.parse_args()

    from hearth.engine.llm import LLM
    from hearth.engine.sampling_params import SamplingParams

    llm = LLM(args.model, device="cpu", tensor_parallel_size=args.tp, kv_cache_memory_gib=0.25)
    engine = llm.engine
    from hearth.ops import cpu_kernels

    cpu_kernels.paged_decode_attention_kernel(wait=True)  # measure the kernels, not the background build
    executor = engine.worker
    worker = getattr(executor, "worker", executor)  # rank 0's own Worker
    steps: list[float] = []
    forwards: list[float] = []
    forwards_cpu: list[float] = []
    steps_cpu: list[float] = []
    builds: list[float] = []
    executes: list[float] = []
    inner_executes: list[float] = []
    sent_bytes: list[int] = []
    steady = [False]

    model = worker.model
    model.forward = timed(forwards, model.forward, forwards_cpu)
    builder = engine.step_inputs
    builder.build = timed(builds, builder.build)
    if executor is not worker:
        executor.execute = timed(executes, executor.execute)
        worker.execute = timed(inner_executes, worker.execute)
        channel = executor.channel
        publish = channel.publish

        def counting_publish(data: bytes) -> None:
            sent_bytes.append(len(data))
            publish(data)

        channel.publish = counting_publish
    parts: dict[str, list[float]] = {}
    if args.parts:
        targets = {
            "schedule": (engine.scheduler, "schedule"),
            "build": (engine.step_inputs, "build"),
            "process_outputs": (engine, "_process_outputs"),
            "sample": (worker, "_sample"),
            "prepare": (worker.attention, "prepare"),
            "tag_check": (worker.page_tag_check, "check"),
            "engine_step": (engine, "step"),
            "worker_execute": (worker, "execute"),
            "forward_one": (worker, "_forward_one"),
        }
        if hasattr(worker, "batch"):
            targets["apply"] = (worker.batch, "apply")
            targets["flatten"] = (worker.batch, "flatten")
        for name, (owner, attr) in targets.items():
            parts[name] = []
            setattr(owner, attr, timed([], getattr(owner, attr), parts[name]))
    step = engine.step
    marks: list[tuple[int, int, int, int, int, int]] = []  # list lengths before each steady step

    def marked_step() -> Any:
        running = engine.scheduler.running
        steady[0] = (
            len(running) == args.batch
            and not engine.scheduler.waiting
            and all(r.num_computed_tokens >= r.num_prompt_tokens for r in running)
        )
        if steady[0] and profiler is not None:
            profiler.enable()
        before = (len(steps), len(forwards), len(builds), len(executes), len(inner_executes), len(sent_bytes))
        start, start_cpu = time.perf_counter(), time.thread_time()
        out = step()
        steps.append(time.perf_counter() - start)
        steps_cpu.append(time.thread_time() - start_cpu)
        if profiler is not None:
            profiler.disable()
        if steady[0] and len(forwards) == before[1] + 1:
            marks.append(before)
        return out

    engine.step = marked_step
    profiler = cProfile.Profile() if args.profile else None
    prompts = [[(7 * i + j) % 500 + 3 for j in range(args.prompt_tokens)] for i in range(args.batch)]
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=0.0,
        ignore_eos=True,
        repetition_penalty=1.1 if args.penalties else 1.0,
    )
    llm.generate(prompts[:4], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))  # warm up
    marks.clear()
    llm.generate(prompts, params)

    def median_ms(values: list[float], index: int) -> float | None:
        picked = [values[m[index]] for m in marks if m[index] < len(values)]
        return round(statistics.median(picked) * 1e3, 4) if picked else None

    host = [steps[m[0]] - forwards[m[1]] for m in marks]
    host_cpu = [steps_cpu[m[0]] - forwards_cpu[m[1]] for m in marks]
    send = [executes[m[3]] - inner_executes[m[4]] for m in marks if m[3] < len(executes)]
    report = {
        "model": args.model,
        "tp": args.tp,
        "batch": args.batch,
        "steady_decode_steps": len(marks),
        "step_ms": median_ms(steps, 0),
        "forward_ms": median_ms(forwards, 1),
        "host_ms": round(statistics.median(host) * 1e3, 4),
        "host_cpu_ms": round(statistics.median(host_cpu) * 1e3, 4),
        "build_ms": median_ms(builds, 2),
        "send_ms": round(statistics.median(send) * 1e3, 4) if send else None,
        "step_bytes": statistics.median([sent_bytes[m[5]] for m in marks]) if sent_bytes else None,
    }
    if args.parts:
        num_calls = len(steps)
        report["parts_cpu_ms"] = {
            name: round(statistics.median(values[-len(marks) :]) * 1e3, 4)
            for name, values in parts.items()
            if values
        }
        del num_calls
    print(json.dumps(report), flush=True)
    if profiler is not None:
        pstats.Stats(profiler).sort_stats("cumulative").print_stats("hearth|zmq|msgspec", 45)
    shutdown = getattr(executor, "shutdown", None)
    if shutdown is not None:
        shutdown()


if __name__ == "__main__":
    main()
