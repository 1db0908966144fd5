"""Routing quality, simulated: a multi-turn agent trace over N workers with prefix caches.

Sessions of a few agent kinds share a long system prompt (tools included), each turn re-sends
the whole history plus a new tool result or user message, and answers are short. Some clients
send `x-session-affinity`. Every policy of the router (the real classes, with the router's own
load model and prefix index) places the same trace; each simulated worker keeps a true LRU
prefix cache of bounded size and serves with a speed that drops as it fills up.

Reported per policy: cache-hit ratio (cached prompt tokens / prompt tokens), load imbalance
(max/mean over workers of the tokens each had to compute, and the mean over time of max/mean
in-flight tokens), and simulated TTFT.

    python scripts/router_sim.py [--workers 8] [--sessions 400] [--out sim.json]
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
import statistics
from collections import OrderedDict
from dataclasses import dataclass, field

from hearth.kv.prefix_keys import page_keys, root_key
from hearth.router.policies import BalanceConfig, RouteRequest, make_policy
from hearth.router.workers import WorkerPool

POLICY_NAMES = [
    "round_robin",
    "random",
    "consistent_hash",
    "token_aware",
    "session_affinity",
    "prefix_aware",
    "default",
]


@dataclass
class Turn:
    session: int
    turn: int
    prompt_tokens: int
    num_keys: int
    output_tokens: int
    think_s: float


@dataclass
class Session:
    start_s: float
    keys: list[bytes]
    header: str | None
    turns: list[Turn] = field(default_factory=list)


def make_trace(args: argparse.Namespace) -> list[Session]:
    rng = random.Random(args.seed)
    root = root_key("sim-model", "bf16/16", None)
    systems = [
        [rng.randrange(50000) for _ in range(rng.randint(1500, 3000))] for _ in range(args.agent_kinds)
    ]
    sessions: list[Session] = []
    start_s = 0.0
    for s in range(args.sessions):
        start_s += rng.expovariate(args.session_rate)
        tokens = list(systems[rng.randrange(args.agent_kinds)])
        header = f"session-{s}" if rng.random() < args.header_fraction else None
        turns: list[Turn] = []
        for t in range(rng.randint(4, 16)):
            tokens += [rng.randrange(50000) for _ in range(rng.randint(100, 800))]  # tool result / user
            output_tokens = rng.randint(30, 200)
            turns.append(
                Turn(s, t, len(tokens), len(tokens) // args.page_size, output_tokens, rng.uniform(0.5, 3.0))
            )
            tokens += [rng.randrange(50000) for _ in range(output_tokens)]  # the answer joins the history
        sessions.append(Session(start_s, page_keys(root, tokens, args.page_size), header, turns))
    return sessions


class TrueCache:
    """A worker's real prefix cache: LRU over page keys."""

    def __init__(self, capacity_pages: int) -> None:
        self.capacity_pages = capacity_pages
        self.pages: OrderedDict[bytes, None] = OrderedDict()

    def serve(self, keys: list[bytes]) -> int:
        hit = 0
        for key in keys:
            if key not in self.pages:
                break
            hit += 1
        # Touch the tail first so the head is most recent: leaves go before the prefix they hang on.
        for key in reversed(keys):
            self.pages[key] = None
            self.pages.move_to_end(key)
        while len(self.pages) > self.capacity_pages:
            self.pages.popitem(last=False)
        return hit


def simulate(policy_name: str, trace: list[Session], args: argparse.Namespace) -> dict[str, float]:
    pool = WorkerPool(prefix_blocks=args.cache_tokens // args.page_size)
    workers = [pool.add(f"http://sim-{i}:8000") for i in range(args.workers)]
    caches = {w.url: TrueCache(args.cache_tokens // args.page_size) for w in workers}
    computed = {w.url: 0 for w in workers}
    policy = make_policy(
        policy_name, BalanceConfig(abs_tokens=args.balance_abs_tokens, min_prefix_match_tokens=256)
    )
    events: list[tuple[float, int, str, object]] = []
    seq = 0

    def push(time_s: float, kind: str, data: object) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(events, (time_s, seq, kind, data))

    for session in trace:
        push(session.start_s, "arrive", session.turns[0])
    prompt_total = cached_total = 0
    ttfts: list[float] = []
    imbalance_samples: list[float] = []
    while events:
        now_s, _, kind, data = heapq.heappop(events)
        if kind == "arrive":
            turn = data
            assert isinstance(turn, Turn)
            session = trace[turn.session]
            keys = session.keys[: turn.num_keys]
            request = RouteRequest(turn.prompt_tokens, keys, args.page_size, session.header)
            decision = policy.choose(request, workers)
            worker = decision.worker
            estimate = min(worker.prefix.match_blocks(keys) * args.page_size, turn.prompt_tokens)
            worker.prefix.insert(keys)
            cached = min(caches[worker.url].serve(keys) * args.page_size, turn.prompt_tokens)
            prompt_total += turn.prompt_tokens
            cached_total += cached
            uncached = turn.prompt_tokens - cached
            computed[worker.url] += uncached + turn.output_tokens
            loads = [w.load.prefill_tokens + w.load.decode_tokens for w in workers]
            if sum(loads):
                imbalance_samples.append(max(loads) / (sum(loads) / len(loads)))
            # A worker slows down as its in-flight tokens grow (shared compute and memory bandwidth).
            slowdown = (
                1.0 + (worker.load.prefill_tokens + worker.load.decode_tokens) / args.worker_tokens_capacity
            )
            ticket = worker.start(turn.prompt_tokens - estimate, turn.prompt_tokens)
            ttft_s = (uncached / args.prefill_tps + 0.01) * slowdown
            ttfts.append(ttft_s)
            push(now_s + ttft_s, "first", ticket)
            push(now_s + ttft_s + turn.output_tokens * args.tpot_s * slowdown, "finish", (ticket, turn))
        elif kind == "first":
            ticket = data
            ticket.worker.first_token(ticket)  # type: ignore[attr-defined]
        else:
            ticket, turn = data  # type: ignore[misc]
            ticket.worker.finish(ticket)
            session = trace[turn.session]
            if turn.turn + 1 < len(session.turns):
                push(now_s + turn.think_s, "arrive", session.turns[turn.turn + 1])
    work = list(computed.values())
    ttfts.sort()
    return {
        "cache_hit_ratio": cached_total / prompt_total,
        "work_imbalance": max(work) / statistics.mean(work),
        "inflight_imbalance": statistics.mean(imbalance_samples),
        "ttft_p50_s": ttfts[len(ttfts) // 2],
        "ttft_p99_s": ttfts[int(len(ttfts) * 0.99)],
        "requests": len(ttfts),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--sessions", type=int, default=400)
    parser.add_argument("--session-rate", type=float, default=4.0, help="new sessions per second")
    parser.add_argument("--agent-kinds", type=int, default=4)
    parser.add_argument("--header-fraction", type=float, default=0.5)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--cache-tokens", type=int, default=120_000, help="prefix cache per worker")
    parser.add_argument("--prefill-tps", type=float, default=20_000.0)
    parser.add_argument("--tpot-s", type=float, default=0.02)
    parser.add_argument("--worker-tokens-capacity", type=float, default=200_000.0)
    parser.add_argument("--balance-abs-tokens", type=int, default=8192)
    parser.add_argument("--policies", default=",".join(POLICY_NAMES))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    trace = make_trace(args)
    results = {name: simulate(name, trace, args) for name in args.policies.split(",")}
    print(
        f"{args.workers} workers, {args.sessions} sessions, {args.header_fraction:.0%} with x-session-affinity, "
        f"{args.cache_tokens} cached tokens per worker"
    )
    print(
        "| policy | cache-hit ratio | work imbalance (max/mean) | in-flight imbalance (mean max/mean) "
        "| TTFT p50 (s) | TTFT p99 (s) |"
    )
    print("|---|---|---|---|---|---|")
    for name, r in results.items():
        print(
            f"| {name} | {r['cache_hit_ratio']:.3f} | {r['work_imbalance']:.2f} | {r['inflight_imbalance']:.2f} "
            f"| {r['ttft_p50_s']:.3f} | {r['ttft_p99_s']:.3f} |"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
