"""The operator console: server-rendered pages over the ledger (``vigil console``)."""
