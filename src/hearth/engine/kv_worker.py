"""The worker half of the KV connectors, on every rank: it moves this rank's shard of the pages the engine
core's scheduler halves decided on (`hearth.contracts.kv_ops`), through the pool's `PageIO`.

- Tiers: this rank's own tier stack (host RAM, a `rank{N}` directory of `--kv-disk-dir`, the shared store);
  a rank files its shard under `PageLayout.shard_key(key)` (the key plus this rank's layers and KV heads),
  in blobs tagged with the layout, so no rank ever reads another's shard.
- PD transfer: this rank's own transport. Decode: every rank listens (rank r on `--kv-transfer-port + r`,
  or a free port) and the server advertises the ranks' endpoints comma-separated; prefill: rank r sends its
  shard to the decode server's rank r (same TP and PP sizes on both sides).

`apply(kv_ops)` runs before the step's forward, on the worker's thread (the only thread that writes the
pool, besides transports writing pages of open receives): the ops in order, then what finished since
(loaded pages written into the pool, transport events). `report(kv_ops)` after the step hands the events
to rank 0: in one process as they are, across ranks by a gather on the control group in the steps that
ask for it (`KVOps.report`, set by rank 0 while anything is in flight, so every rank takes part).
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass

import msgspec
import torch

from hearth.contracts.kv_ops import (
    CancelLoad,
    KVEvent,
    KVOps,
    PeerClose,
    PeerListen,
    PeerReceive,
    PeerSend,
    TierLoad,
    TierSave,
    TierSpill,
)
from hearth.engine.config import EngineConfig
from hearth.kv.page_io import PageIO, PageLayout, Scales
from hearth.kv.pool import KVLayout
from hearth.kv.tiers import PageSpec, TierStack, build_tiers
from hearth.kv_transfer import make_transport
from hearth.kv_transfer.auth import SECRET_ENV, SECRET_FILE_ENV, deployment_secret, read_secret
from hearth.kv_transfer.base import KVTransport, ReceiveSpec, SendSpec, TransferEvent
from hearth.kv_transfer.pool_pages import PoolPageSource, PoolSink, TensorPageSource
from hearth.model.config import ModelConfig
from hearth.parallel.state import parallel_state

logger = logging.getLogger("hearth.engine")

_events_encoder = msgspec.msgpack.Encoder()
_events_decoder = msgspec.msgpack.Decoder(list[KVEvent])


@dataclass(frozen=True)
class PeerRanks:
    """A decode server's transfer endpoints, one per rank, and its parallel layout."""

    endpoints: list[str]
    tp_size: int
    pp_size: int

    def describe(self) -> str:
        if len(self.endpoints) == 1 and self.tp_size == self.pp_size == 1:
            return self.endpoints[0]
        return ",".join(self.endpoints) + f";tp{self.tp_size}pp{self.pp_size}"

    @staticmethod
    def parse(text: str) -> PeerRanks:
        endpoints, _, layout = text.partition(";")
        parts = [part for part in endpoints.split(",") if part]
        match = re.fullmatch(r"tp(\d+)pp(\d+)", layout)
        if match is None:  # a single endpoint (one rank)
            return PeerRanks(parts, len(parts), 1)
        return PeerRanks(parts, int(match[1]), int(match[2]))


class KVWorker:
    """One rank's KV movement. `tiers`/`transport` are None when not configured."""

    def __init__(self, config: EngineConfig, io: PageIO, layout_tag: str, rank: int, world_size: int) -> None:
        self.io = io
        self.rank = rank
        self.world_size = world_size
        state = parallel_state()
        self.tp_size, self.pp_size = state.tp_size, state.pp_size
        self._send_parts: dict[str, list[KVEvent]] = {}  # transfer id -> answers of its part sends so far
        self._num_send_parts: dict[str, int] = {}
        self.tiers: TierStack | None = None
        self.transport: KVTransport | None = None
        self._events: list[KVEvent] = []
        self._tier_loads: set[str] = set()
        self._receives: dict[str, str] = {}  # transfer id -> request id
        self._sends: dict[str, str] = {}
        if config.kv_tiers_enabled and config.enable_prefix_caching:
            disk_dir = config.kv_disk_dir
            if disk_dir and world_size > 1:
                disk_dir = os.path.join(disk_dir, f"rank{rank}")  # each rank its own index and budget
            spec = PageSpec(f"{layout_tag}/{io.layout.describe()}", io.layout)
            # The deployment secret keys the MACs of stored blobs (kv/tiers/blob_auth.py); a rank's blobs
            # are filed and sealed under its shard key, so a blob never passes for another rank's shard.
            secret = read_secret(SECRET_ENV, SECRET_FILE_ENV)
            tiers = build_tiers(
                spec,
                config.kv_offload_memory_gib,
                disk_dir,
                config.kv_disk_size_gib,
                config.kv_store,
                secret.encode() if secret else None,
            )
            self.tiers = TierStack(tiers, io)
            if rank == 0:
                logger.info("KV tiers below the device: %s", ", ".join(tier.name for tier in tiers))
        if config.role != "mixed":
            self.transport = make_transport(
                config.kv_transfer, io.layout, deployment_secret(), config.kv_transfer_timeout_s, PoolSink(io)
            )

    # ---- rank 0's scheduler halves ask these of rank 0's own shard (same process) ----------------

    def tier_lookup(self, keys: list[bytes]) -> int:
        """How many leading pages rank 0's tiers hold (a hint: a load lands only what every rank has)."""
        assert self.tiers is not None
        return self.tiers.lookup([self.io.layout.shard_key(key) for key in keys])

    @property
    def wakeup_fd(self) -> int | None:
        return self.transport.wakeup_fd if self.transport is not None else None

    # ---- each step ------------------------------------------------------------------------------

    def apply(self, kv_ops: KVOps) -> None:
        for op in kv_ops.ops:
            if isinstance(op, TierSpill):
                if self.tiers is not None:
                    self.tiers.on_evict(self.io.layout.shard_key(op.key), op.page_id)
            elif isinstance(op, TierSave):
                if self.tiers is not None:
                    self.tiers.write_back([self.io.layout.shard_key(k) for k in op.keys], op.page_ids)
            elif isinstance(op, TierLoad):
                self._start_tier_load(op)
            elif isinstance(op, CancelLoad):
                if op.request_id in self._tier_loads and self.tiers is not None:
                    self._tier_loads.discard(op.request_id)
                    self.tiers.cancel(op.request_id)  # the pool is written only in apply: nothing lands now
            elif isinstance(op, PeerReceive):
                self._receive(op)
            elif isinstance(op, PeerClose):
                if self.transport is not None:
                    self._receives.pop(op.transfer_id, None)
                    self.transport.close_receive(op.transfer_id)  # no write lands after this returns
            elif isinstance(op, PeerSend):
                self._send(op)
            elif isinstance(op, PeerListen):
                self._listen(op)
        self._harvest()

    def report(self, kv_ops: KVOps) -> list[KVEvent]:
        """This step's events: on rank 0 every rank's (when the step asks), elsewhere none (sent to rank 0)."""
        if self.world_size == 1:
            events, self._events = self._events, []
            return events
        if not kv_ops.report:
            return []  # kept until a step gathers them
        from hearth.parallel.channel import gather_bytes

        events, self._events = self._events, []
        gathered = gather_bytes(_events_encoder.encode(events))
        if gathered is None:
            return []
        return [event for data in gathered for event in _events_decoder.decode(data)]

    def close(self) -> None:
        if self.tiers is not None:
            self.tiers.close()
        if self.transport is not None:
            self.transport.close()

    # ---- tiers ----------------------------------------------------------------------------------

    def _start_tier_load(self, op: TierLoad) -> None:
        if self.tiers is None:
            self._events.append(KVEvent("loaded", self.rank, op.request_id, ok=False, detail="no tiers here"))
            return
        self._tier_loads.add(op.request_id)
        self.tiers.start_load(op.request_id, [self.io.layout.shard_key(k) for k in op.keys], op.page_ids)

    # ---- PD transfer ----------------------------------------------------------------------------

    def _listen(self, op: PeerListen) -> None:
        if self.transport is None:
            return
        port = op.port + self.rank if op.port else 0
        endpoint = self.transport.listen(op.host, port)
        self._events.append(KVEvent("listening", self.rank, detail=endpoint))

    def _receive(self, op: PeerReceive) -> None:
        if self.transport is None:
            self._events.append(KVEvent("received", self.rank, op.request_id, op.transfer_id, ok=False))
            return
        self._receives[op.transfer_id] = op.request_id
        self.transport.open_receive(
            ReceiveSpec(op.transfer_id, op.first_page, list(op.page_ids), op.end_token, op.prompt_hash)
        )

    def _send(self, op: PeerSend) -> None:
        peer = PeerRanks.parse(op.endpoint)
        if self.transport is None:
            self._send_failed(op, "this server has no KV transport")
        elif self._same_layout(peer):  # rank r sends its shard to the decode server's rank r
            self._sends[op.transfer_id] = op.request_id
            source = PoolPageSource(self.io, list(op.page_ids))
            self.transport.send(
                SendSpec(op.transfer_id, peer.endpoints[self.rank], source, op.num_tokens, op.prompt_hash)
            )
        elif self.pp_size == 1 and peer.pp_size == 1 and len(peer.endpoints) == peer.tp_size:
            self._send_resharded(op, peer)
        else:
            self._send_failed(
                op,
                f"pipeline-parallel layouts must match for PD transfer (this server pp {self.pp_size}, the decode "
                f"server pp {peer.pp_size})",
            )

    def _same_layout(self, peer: PeerRanks) -> bool:
        same_sizes = (peer.tp_size, peer.pp_size) == (self.tp_size, self.pp_size)
        return same_sizes and len(peer.endpoints) == self.world_size

    def _send_failed(self, op: PeerSend, detail: str) -> None:
        logger.warning("KV transfer %s not sent: %s", op.transfer_id, detail)
        self._events.append(
            KVEvent("sent", self.rank, op.request_id, op.transfer_id, ok=False, detail=detail)
        )
        if self.rank == 0 and self.transport is not None:  # the decode ranks give up at once and recompute
            for endpoint in PeerRanks.parse(op.endpoint).endpoints:
                self._num_send_parts[op.transfer_id] = self._num_send_parts.get(op.transfer_id, 0) + 1
                empty = TensorPageSource(self.io.read([]), self.io.scales)
                self.transport.send(SendSpec(f"{op.transfer_id}", endpoint, empty, 0, op.prompt_hash))
            self._sends[op.transfer_id] = ""  # their answers are not reported again

    def _send_resharded(self, op: PeerSend, peer: PeerRanks) -> None:
        """Tensor-parallel sizes differ: rank 0 assembles every page's heads (a gather over the ranks, in
        this same op on every rank) and sends each decode rank the heads it holds."""
        layout = self.io.layout
        gather = layout.kind != "latent" and self.tp_size > 1  # a latent is whole on every rank: rank 0's
        pages: torch.Tensor | None = None
        scales = self.io.scales
        if gather or self.rank == 0:
            pages = self.io.read(list(op.page_ids))
        if gather:
            pages, scales = _gather_heads(pages, scales, layout)
        if self.rank != 0:
            self._events.append(
                KVEvent("sent", self.rank, op.request_id, op.transfer_id, num_pages=len(op.page_ids))
            )
            return
        assert self.transport is not None and pages is not None
        total = layout.model_kv_heads
        self._sends[op.transfer_id] = op.request_id
        self._num_send_parts[op.transfer_id] = peer.tp_size
        for index, endpoint in enumerate(peer.endpoints):
            first = index * total // peer.tp_size if layout.kind != "latent" else 0
            count = max(1, total // peer.tp_size) if layout.kind != "latent" else 1
            part = pages[:, :, :, :, first : first + count].contiguous()
            part_scales = (
                None
                if scales is None
                else (scales[0][:, first : first + count], scales[1][:, first : first + count])
            )
            part_layout = msgspec.structs.replace(
                layout, num_kv_heads=count, first_kv_head=first, total_kv_heads=total
            )
            self.transport.send(
                SendSpec(
                    op.transfer_id,
                    endpoint,
                    TensorPageSource(part, part_scales),
                    op.num_tokens,
                    op.prompt_hash,
                    layout=part_layout,
                )
            )

    # ---- what finished ----------------------------------------------------------------------------

    def _combine_parts(self, event: TransferEvent) -> TransferEvent | None:
        """One transfer sent in parts (one per decode rank): its answer once every part answered."""
        parts = self._send_parts.setdefault(event.transfer_id, [])
        parts.append(event)
        if len(parts) < self._num_send_parts[event.transfer_id]:
            return None
        del self._send_parts[event.transfer_id], self._num_send_parts[event.transfer_id]
        failed = [part for part in parts if not part.ok]
        if failed:
            return failed[0]
        return TransferEvent(event.transfer_id, "sent", True, num_pages=parts[0].num_pages)

    def _harvest(self) -> None:
        if self.tiers is not None and self._tier_loads:
            for request_id, num_pages, num_store_pages in self.tiers.poll_by_source():
                if request_id in self._tier_loads:
                    self._tier_loads.discard(request_id)
                    self._events.append(
                        KVEvent(
                            "loaded",
                            self.rank,
                            request_id,
                            num_pages=num_pages,
                            num_store_pages=num_store_pages,
                        )
                    )
        if self.transport is None:
            return
        for event in self.transport.events():
            if event.kind == "sent" and event.transfer_id in self._num_send_parts:
                event = self._combine_parts(event)
                if event is None:
                    continue  # more parts to come
            table = self._receives if event.kind == "received" else self._sends
            request_id = table.pop(event.transfer_id, None)
            if not request_id:
                continue  # closed meanwhile, or already answered
            self._events.append(
                KVEvent(
                    event.kind,
                    self.rank,
                    request_id,
                    event.transfer_id,
                    event.ok,
                    event.num_pages,
                    event.detail,
                )
            )


def _gather_heads(
    pages: torch.Tensor, scales: Scales | None, layout: PageLayout
) -> tuple[torch.Tensor | None, Scales | None]:
    """Every TP rank's heads of the same pages, on rank 0 (None elsewhere): `[n, layers, planes, page_size,
    model_kv_heads, head_dim]`, and the scales `[layers, model_kv_heads]` likewise. A collective."""
    import torch.distributed as dist

    from hearth.parallel.groups import control_group

    group = control_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = pages.contiguous().view(torch.uint8)
    shards = [torch.empty_like(mine) for _ in range(world)] if rank == 0 else None
    dist.gather(mine, shards, dst=0, group=group)
    scale_shards = None
    if scales is not None:
        both = torch.stack(scales).float().contiguous()
        scale_shards = [torch.empty_like(both) for _ in range(world)] if rank == 0 else None
        dist.gather(both, scale_shards, dst=0, group=group)
    if rank != 0:
        return None, None
    assert shards is not None
    total, local = layout.model_kv_heads, layout.num_kv_heads
    full = torch.empty((*pages.shape[:4], total, pages.shape[5]), dtype=pages.dtype)
    full_scales = torch.empty((2, layout.num_layers, total)) if scales is not None else None
    for tp_rank, shard in enumerate(shards):
        first = tp_rank * total // world  # replicated heads (fewer than ranks) land on themselves
        full.view(torch.uint8)[:, :, :, :, first : first + local].copy_(shard)
        if full_scales is not None and scale_shards is not None:
            full_scales[:, :, first : first + local] = scale_shards[tp_rank]
    return full, None if full_scales is None else (full_scales[0], full_scales[1])


def rank_page_layout(layout: KVLayout, model_config: ModelConfig, stage: range) -> PageLayout:
    """Where this rank's pool sits in the model's KV: its stage's layers and its TP rank's KV heads (with
    more ranks than KV heads, a head is replicated on consecutive ranks; an MLA latent is whole everywhere)."""
    state = parallel_state()
    total_heads = 1 if layout.kind == "latent" else model_config.num_kv_heads
    first_head = 0
    if layout.kind != "latent" and state.tp_size > 1:
        first_head = state.tp_rank * total_heads // state.tp_size
    return PageLayout.of(
        layout,
        first_layer=stage.start,
        total_layers=model_config.num_layers,
        first_kv_head=first_head,
        total_kv_heads=total_heads,
    )


def build_kv_worker(
    config: EngineConfig, io: PageIO, layout_tag: str, rank: int, world_size: int
) -> KVWorker | None:
    """The worker half when this server moves KV (tiers or a PD role), else None."""
    tiers = config.kv_tiers_enabled and config.enable_prefix_caching
    if not tiers and config.role == "mixed":
        return None
    return KVWorker(config, io, layout_tag, rank, world_size)
