"""KV operations a step carries to every rank's worker half of the KV connectors, and the KV events the
workers report back (`StepInput.kv_ops`, `StepOutput.kv_events`). Torch-free msgspec structs.

The engine core (rank 0) decides what moves: which pages load from a tier or arrive from a peer, which
are saved, spilled or sent. Each rank's worker moves its own shard of those pages (its KV heads, its
stage's layers) and reports per operation; rank 0 merges the ranks' events (a load is done when every
rank's shard is in: the pages that arrived are the fewest any rank got). Ops run in order, before the
step's forward, so a page saved or spilled here is read before this step overwrites it, and a cancelled
load writes nothing after its cancel.
"""

from __future__ import annotations

import msgspec


class TierLoad(msgspec.Struct, tag=True, array_like=True):
    """Read the pages named by `keys` from the tiers into `page_ids` (leading pages; stop at a miss)."""

    request_id: str
    keys: list[bytes]
    page_ids: list[int]


class TierSave(msgspec.Struct, tag=True, array_like=True):
    """Copy these pages out now and queue them for the tiers below the host that lack them
    (a finished request's full pages: write-back)."""

    keys: list[bytes]
    page_ids: list[int]


class TierSpill(msgspec.Struct, tag=True, array_like=True):
    """A cached device page is about to be reused: copy it into host RAM, or queue it for the tiers below."""

    key: bytes
    page_id: int


class CancelLoad(msgspec.Struct, tag=True, array_like=True):
    """The request ended: no page of its load (tier or peer) may land after this op."""

    request_id: str


class PeerListen(msgspec.Struct, tag=True, array_like=True):
    """Decode role, once at start: listen for senders (`port` 0: any free port on ranks but rank 0's)."""

    host: str
    port: int


class PeerReceive(msgspec.Struct, tag=True, array_like=True):
    """Decode role: pages of transfer `transfer_id` may be written into `page_ids` from now on."""

    request_id: str
    transfer_id: str
    first_page: int  # the request's page index of page_ids[0]
    page_ids: list[int]
    end_token: int
    prompt_hash: int


class PeerClose(msgspec.Struct, tag=True, array_like=True):
    """Decode role: nothing more is wanted for `transfer_id` (a sender that comes later is told so)."""

    transfer_id: str


class PeerSend(msgspec.Struct, tag=True, array_like=True):
    """Prefill role: send these pages' KV (each rank its shard) to the decode server's rank endpoints."""

    request_id: str
    transfer_id: str
    endpoint: str  # the decode server's endpoints, one per rank, comma-separated
    page_ids: list[int]
    num_tokens: int  # 0: tell the receiver to give up (the request failed)
    prompt_hash: int


KVOp = TierLoad | TierSave | TierSpill | CancelLoad | PeerListen | PeerReceive | PeerClose | PeerSend


class KVOps(msgspec.Struct, array_like=True, omit_defaults=True):
    """A step's KV operations. `report`: every rank reports its events this step (rank 0 sets it while
    anything is in flight, so all ranks take part in the same gather)."""

    ops: list[KVOp] = []
    report: bool = False


class KVEvent(msgspec.Struct, array_like=True, omit_defaults=True):
    """One rank's answer to an op. `kind`: "loaded" (tier), "received" / "sent" (peer), "listening".
    `num_pages`: leading pages in place (loaded, received) or sent; `ok` False: failed (recompute)."""

    kind: str
    rank: int
    request_id: str = ""
    transfer_id: str = ""
    ok: bool = True
    num_pages: int = 0
    detail: str = ""  # "listening": the endpoint; a failure: why
    num_store_pages: int = 0  # "loaded": of `num_pages`, those a shared store served (usage reports them)
