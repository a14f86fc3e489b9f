"""What the operator commands (:mod:`vigil.ops`) and the console share above the ledger and
the bus: a command's ledger connection (:mod:`vigil.admin.connection`) and the reader of
every shard (:mod:`vigil.admin.shards`).

Not in :mod:`vigil.ledger` because both read the settings through :mod:`vigil.service`, which
sits above the ledger and the bus (docs/architecture.md, "Layers").
"""
