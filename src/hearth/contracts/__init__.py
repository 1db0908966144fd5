"""Layer 1 (DESIGN.md): the typed, torch-free messages that cross processes and ranks.

- `hearth.contracts.step`: `StepInput` (rank 0 -> every worker: per-step deltas against the workers'
  persistent batch) and `StepOutput` (the sampling rank -> rank 0: tokens, integrity failures, drafts).
- `hearth.contracts.kv_ops`: the KV operations rank 0 hands every rank's connector half (`KVOps`) and the
  events they report back (`KVEvent`).
- `hearth.contracts.sampling`: `SamplerParams`, the part of a request's sampling parameters a worker needs.
- `hearth.contracts.registry`: `Registry[T]`, the one type for everything chosen by name (lazy `"module:attr"`
  entries, aliases, metadata) and `UnknownNameError`, which names the choices.
- `hearth.contracts.options`: `option(...)`, a config field that is also a command-line flag, and the
  generator of flags from such fields; `hearth.contracts.cli_common`: the flags every command shares.

Nothing here imports torch or any other Hearth layer: every layer may import this one.
"""
