"""The scheduler halves of the KV connectors (rank 0, in the engine core): `tiers` (host RAM, disk, a shared
store) and `peer` (PD transfer). They decide what moves; `hearth.engine.kv_worker` moves it on every rank."""
