"""The parallelism options (`ParallelOptions`, a part of `EngineConfig`): how many ranks, over how many hosts,
and how a pipeline is cut. Torch-free."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from hearth.contracts.options import int_list, option
from hearth.parallel.topology import ParallelConfig

_option = functools.partial(option, group="parallel")


@dataclass(frozen=True)
class ParallelOptions:
    """Ranks = tensor x pipeline parallel size, over `nnodes` hosts (`hearth.parallel`, `hearth.engine.ranks`)."""

    tensor_parallel_size: int = _option(
        1, flags=("--tensor-parallel-size", "-tp"), type=int, help="ranks that split every layer (by heads)"
    )
    pipeline_parallel_size: int = _option(
        1,
        flags=("--pipeline-parallel-size", "-pp"),
        type=int,
        help="pipeline stages (ranks holding consecutive layers)",
    )
    expert_parallel: bool = _option(
        False,
        flags=("--expert-parallel", "--enable-expert-parallel"),
        action="store_true",
        help="MoE models: each tensor-parallel rank holds whole experts (a 1/N share of them) instead of a "
        "slice of each",
    )
    nnodes: int = _option(1, type=int, help="hosts the ranks span (as torchrun)")
    node_rank: int = _option(0, type=int, help="this host's index; node 0 serves the API")
    master_addr: str = _option("127.0.0.1", help="node 0's address for the rendezvous")
    master_port: int | None = _option(  # None on one node: a free port is picked
        None, type=int, help="node 0's rendezvous port (default on one node: a free one)"
    )
    # Pipeline parallelism (hearth.engine.ranks.microbatch, hearth.engine.ranks.pipeline): micro-batches per
    # step (0: auto, 2 x stages; 1: none), and the layers per stage (None: balanced by the cost model).
    pipeline_micro_batches: int = _option(
        0,
        type=int,
        help="micro-batches a step is cut into so pipeline stages overlap (0: 2 x stages; 1: none)",
    )
    pipeline_stage_layers: tuple[int, ...] | None = _option(
        None,
        type=int_list,
        help="layers per pipeline stage, e.g. 30,31 (default: balanced by a cost model measured at start)",
    )

    def _check_parallel_options(self) -> None:
        ParallelConfig(
            self.tensor_parallel_size,
            self.pipeline_parallel_size,
            self.expert_parallel,
            self.nnodes,
            self.node_rank,
        )
        if self.nnodes > 1 and self.master_port is None:
            raise ValueError(
                "with nnodes > 1, master_port (and master_addr) must name node 0's rendezvous port"
            )
        if self.pipeline_micro_batches < 0:
            raise ValueError("pipeline_micro_batches must be >= 0 (0: auto)")
        if self.pipeline_stage_layers is not None:
            layers = tuple(self.pipeline_stage_layers)
            if len(layers) != self.pipeline_parallel_size or min(layers) < 1:
                raise ValueError(
                    f"pipeline_stage_layers needs one layer count >= 1 per stage "
                    f"({self.pipeline_parallel_size}), got {list(layers)}"
                )
            object.__setattr__(self, "pipeline_stage_layers", layers)
