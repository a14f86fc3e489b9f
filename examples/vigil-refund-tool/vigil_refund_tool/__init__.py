"""The demo's ``refund`` action tool, as a tool package: vigil loads :func:`tool` through the
``vigil.tools`` entry point named ``refund`` (this package's pyproject.toml).

``refund`` stands in for a payment provider's refund call. It "makes" a refund by recording
it in the ledger's ``refunds`` table keyed by the call's idempotency key, the way a real
provider honours an ``Idempotency-Key`` header: a second call with the same key (a
duplicate approval, a retried run) finds the first record and refunds nothing more.
"""

from __future__ import annotations

import logging
import re
from decimal import Decimal, InvalidOperation
from typing import Any

from vigil.agent.settings import AgentSettings, Permission
from vigil.agent.tools import ActionTool, CallContext, ToolOutput
from vigil.ledger import agent as ledger_agent
from vigil.ledger.db import connect_async

log = logging.getLogger(__name__)

_ORDER_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
# A demo refund above this is refused outright: no approval makes it sensible.
MAX_REFUND = Decimal("10000")


def _amount(value: Any) -> Decimal | None:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        return None
    try:
        amount = Decimal(str(value))
    except InvalidOperation:
        return None
    return amount.quantize(Decimal("0.01")) if amount.is_finite() else None


class RefundTool(ActionTool):
    name = "refund"
    description = (
        "Refund an order (amount in the order's currency). The user normally has to approve a "
        "refund: the call pauses until they answer, and its result tells you what they decided."
    )
    input_schema = {
        "type": "object",
        "properties": {
            "order_id": {"type": "string", "description": "The order to refund."},
            "amount": {"type": "number", "exclusiveMinimum": 0, "description": "How much to refund."},
            "reason": {"type": "string", "description": "Why, in a few words."},
        },
        "required": ["order_id", "amount"],
        "additionalProperties": False,
    }
    default_permission = Permission.ASK

    def __init__(self, dsn: str, auto_limit: float):
        self.dsn = dsn
        self.auto_limit = Decimal(str(auto_limit))

    def check(self, args: dict[str, Any]) -> str | None:
        if not isinstance(args.get("order_id"), str) or not _ORDER_ID.match(args["order_id"]):
            return "order_id must be 1-64 letters, digits, '-' or '_'"
        amount = _amount(args.get("amount"))
        if amount is None or amount <= 0:
            return "amount must be a positive number"
        if amount > MAX_REFUND:
            return f"refunds above {MAX_REFUND} are not made by the agent"
        reason = args.get("reason")
        if reason is not None and (not isinstance(reason, str) or len(reason) > 500):
            return "reason must be a string of at most 500 characters"
        return None

    def risk(self, args: dict[str, Any]) -> str | None:
        amount = _amount(args.get("amount"))
        if amount is not None and amount > self.auto_limit:
            return f"a refund of {amount} is above the unattended limit of {self.auto_limit}"
        return None

    def describe(self, args: dict[str, Any]) -> str:
        line = f"refund {_amount(args.get('amount'))} for order {args.get('order_id')}"
        return line + (f" ({args['reason']})" if args.get("reason") else "")

    async def run(self, args: dict[str, Any], call: CallContext) -> ToolOutput:
        refusal = self.check(args)
        if refusal is not None:
            return ToolOutput(f"Not refunded: {refusal}.", True)
        amount = _amount(args["amount"])
        assert amount is not None  # check() refused anything else
        async with await connect_async(self.dsn, autocommit=True) as conn:
            row = await ledger_agent.record_refund(
                conn,
                idempotency_key=call.idempotency_key,
                user_id=call.user_id,
                order_id=args["order_id"],
                amount=amount,
                reason=args.get("reason"),
            )
            repeated = row is None
            if repeated:
                row = await ledger_agent.get_refund(conn, call.idempotency_key)
        if row is None or row.user_id != call.user_id:
            return ToolOutput("Not refunded: the idempotency key belongs to another refund.", True)
        if (row.order_id, row.amount) != (args["order_id"], amount):
            return ToolOutput(
                f"Not refunded: this call's key already refunded {row.amount} for order {row.order_id}.", True
            )
        log.info("refund %s recorded%s", row.id, " earlier (repeat call, nothing more refunded)" if repeated else "")
        if repeated:
            return ToolOutput(
                f"Refund {row.id} of {row.amount} for order {row.order_id} was already made "
                "for this request; nothing more was refunded."
            )
        return ToolOutput(f"Refund {row.id} made: {row.amount} for order {row.order_id}.")


def tool(settings: AgentSettings) -> RefundTool:
    """The entry point: vigil calls it once at start-up with the worker's agent settings."""
    return RefundTool(settings.dsn, settings.refund_auto_limit)
