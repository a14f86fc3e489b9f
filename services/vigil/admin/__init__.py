"""What operator commands share above the ledger and the bus: a command's ledger connection
(:mod:`vigil.admin.connection`) and the commands that set up the ledger and the topics
(``vigil migrate``, ``vigil topics``: :mod:`vigil.admin.commands`).

Not in :mod:`vigil.ledger` because both read the settings through :mod:`vigil.service`, which
sits above the ledger and the bus (docs/architecture.md, "Layers").
"""
