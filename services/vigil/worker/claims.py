"""The claim rules live in :mod:`vigil.ledger.claims` (with ``ledger/queries/claims.sql``).
Re-exported here for the runner and the tests that import them from the worker."""

from vigil.ledger.claims import Claim, DeadEvent, alone_due, claim, claim_alone, claim_more, mark_dead

__all__ = ["Claim", "DeadEvent", "alone_due", "claim", "claim_alone", "claim_more", "mark_dead"]
