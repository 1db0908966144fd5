"""The shape of a parallel deployment: how many ranks, which node runs which, which layers each
pipeline stage holds. Plain Python (no process groups), so the engine core can size the KV cache and
tests can check the arithmetic without starting a rank.

Ranks are numbered TP-innermost (`rank = pp_rank * tp_size + tp_rank`) and handed to nodes in
consecutive blocks, so a TP group (an all-reduce per attention and per MLP block) stays on one node
whenever a node holds a whole stage, and only the pipeline's point-to-point sends cross nodes.
Expert parallelism reuses the TP group: with `--expert-parallel` each TP rank holds a slice of the
experts instead of a slice of every expert (ep_size = tp_size).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # this module stays torch-free: EngineConfig checks its sizes with it
    from hearth.parallel.state import ParallelState


@dataclass(frozen=True)
class ParallelConfig:
    tp_size: int = 1
    pp_size: int = 1
    expert_parallel: bool = False
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500

    def __post_init__(self) -> None:
        if self.tp_size < 1 or self.pp_size < 1:
            raise ValueError("tensor_parallel_size and pipeline_parallel_size must be >= 1")
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in 0..nnodes-1 (nnodes={self.nnodes}), got {self.node_rank}")
        if self.world_size % self.nnodes:
            raise ValueError(
                f"{self.world_size} ranks (tensor x pipeline parallel size) do not split evenly over "
                f"{self.nnodes} nodes"
            )

    @classmethod
    def from_engine_config(cls, config: object) -> ParallelConfig:
        """The parallel options of an EngineConfig (`master_port` must be set by then)."""
        return cls(
            tp_size=config.tensor_parallel_size,  # type: ignore[attr-defined]
            pp_size=config.pipeline_parallel_size,  # type: ignore[attr-defined]
            expert_parallel=config.expert_parallel,  # type: ignore[attr-defined]
            nnodes=config.nnodes,  # type: ignore[attr-defined]
            node_rank=config.node_rank,  # type: ignore[attr-defined]
            master_addr=config.master_addr,  # type: ignore[attr-defined]
            master_port=config.master_port or 0,  # type: ignore[attr-defined]
        )

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def is_parallel(self) -> bool:
        return self.world_size > 1

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nnodes

    @property
    def local_ranks(self) -> range:
        """The global ranks this node runs (node 0's first one is the engine core's own)."""
        start = self.node_rank * self.ranks_per_node
        return range(start, start + self.ranks_per_node)

    def state_of(self, rank: int) -> ParallelState:
        from hearth.parallel.state import ParallelState

        pp_rank, tp_rank = divmod(rank, self.tp_size)
        ep_size = self.tp_size if self.expert_parallel else 1
        return ParallelState(
            tp_rank=tp_rank,
            tp_size=self.tp_size,
            pp_rank=pp_rank,
            pp_size=self.pp_size,
            ep_rank=tp_rank if self.expert_parallel else 0,
            ep_size=ep_size,
        )


def rank_kv_heads(num_kv_heads: int, tp_size: int) -> int:
    """KV heads one TP rank holds: its share, or one (replicated) when there are fewer heads than ranks."""
    return max(1, num_kv_heads // tp_size)


def split_layers(
    costs: Sequence[float], num_stages: int, first_extra: float = 0.0, last_extra: float = 0.0
) -> list[range]:
    """Contiguous stages of layers whose largest total cost is the smallest possible (the pipeline runs
    at the pace of its slowest stage). `first_extra` / `last_extra` are what the first stage (the
    embedding) and the last (final norm and LM head) carry besides their layers. Every stage gets at
    least one layer. Exact dynamic programme: O(stages x layers^2), nothing for real layer counts."""
    num_layers = len(costs)
    if not 1 <= num_stages <= num_layers:
        raise ValueError(
            f"{num_stages} pipeline stages need at least as many layers; the model has {num_layers}"
        )
    prefix = [0.0]
    for cost in costs:
        prefix.append(prefix[-1] + cost)

    def stage_cost(start: int, end: int, stage: int) -> float:
        extra = (first_extra if stage == 0 else 0.0) + (last_extra if stage == num_stages - 1 else 0.0)
        return prefix[end] - prefix[start] + extra

    inf = float("inf")
    # best[s][e]: the smallest max-stage cost placing layers [0, e) on stages 0..s-1; cut[s][e] the last start.
    best = [[inf] * (num_layers + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (num_layers + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, num_stages + 1):
        for e in range(s, num_layers - (num_stages - s) + 1):
            for start in range(s - 1, e):
                value = max(best[s - 1][start], stage_cost(start, e, s - 1))
                if value < best[s][e]:
                    best[s][e], cut[s][e] = value, start
    stages: list[range] = []
    end = num_layers
    for s in range(num_stages, 0, -1):
        start = cut[s][end]
        stages.append(range(start, end))
        end = start
    return stages[::-1]
