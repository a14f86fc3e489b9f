"""Every state a ledger row can be in, mirrored from the CHECK constraints in schema.sql.

tests/test_states.py reads the constraints from a real database and fails if these enums
and the schema disagree. Beside each state: which service moves rows out of it.
"""

from __future__ import annotations

from enum import StrEnum


class EventStatus(StrEnum):
    PENDING = "pending"  # worker: claim -> running, or -> dead when attempts are exhausted
    RUNNING = "running"  # worker: finish -> done/pending; takeover -> pending
    DONE = "done"  # terminal
    DEAD = "dead"  # operator: `vigil dead retry` -> pending


class RunOutcome(StrEnum):
    MESSAGE = "message"  # the agent sent something through the outbox
    NOTHING = "nothing"  # the quiet default
    DEFERRED = "deferred"  # a tool call waits for approval
    FAILED = "failed"  # the agent failed; events back to pending with a backoff


class OutboxStatus(StrEnum):
    PENDING = "pending"  # dispatcher: -> sending (delivery id fixed before the send)
    SENDING = "sending"  # dispatcher: -> delivered | pending (retry) | dead; re-sent once its lease ends
    DELIVERED = "delivered"  # terminal
    DEAD = "dead"  # operator only


class TimerKind(StrEnum):
    FOLLOWUP = "followup"
    SCHEDULE = "schedule"
    APPROVAL_EXPIRY = "approval_expiry"


class CatchUp(StrEnum):
    COALESCE = "coalesce"
    EACH = "each"
    SKIP = "skip"


class OnExpiry(StrEnum):
    DENY = "deny"
    ESCALATE = "escalate"
    APPROVE = "approve"


class ApprovalAnswer(StrEnum):
    YES = "yes"
    NO = "no"
    EXPIRED = "expired"


class AnsweredVia(StrEnum):
    """The path a stored approval answer came by (``approvals.answered_via``; the expiry's is NULL)."""

    API = "api"  # POST /v1/approvals/{id} with the token
    CHAT = "chat"  # a clear yes or no replying to the question (in_reply_to or session_id)
    ACTION = "action"  # a signed single-use action URL from the delivery (a chat app's button)
    OPERATOR = "operator"  # vigil approvals deny


class SessionState(StrEnum):
    OPEN = "open"  # worker: a run resumes it, or closes it past the size budget
    WAITING = "waiting"  # worker: the approval answer or expiry resumes it
    CLOSED = "closed"  # terminal


class TaskStatus(StrEnum):
    QUEUED = "queued"  # worker: claim -> running; owner: cancel -> cancelled; reaper: -> timed_out
    RUNNING = "running"  # holder: -> succeeded | failed | cancelled; reaper: -> queued | lost | timed_out
    SUCCEEDED = "succeeded"  # terminal
    FAILED = "failed"  # terminal
    CANCELLED = "cancelled"  # terminal
    TIMED_OUT = "timed_out"  # terminal
    LOST = "lost"  # terminal: its holders kept dying, attempts exhausted


class MoveState(StrEnum):
    """``shard_moves.state``: a partition's move between shards (vigil.ledger.shardmove)."""

    COPYING = "copying"  # `vigil shards move`: fenced, copied and verified -> flipped
    FLIPPED = "flipped"  # `vigil shards move`: the source's rows deleted -> done
    DONE = "done"  # terminal; the partition's next move starts the row again


TASK_TERMINAL = frozenset(
    {TaskStatus.SUCCEEDED, TaskStatus.FAILED, TaskStatus.CANCELLED, TaskStatus.TIMED_OUT, TaskStatus.LOST}
)


class ChannelType(StrEnum):
    WEBHOOK = "webhook"
    KAFKA = "kafka"
    LOG = "log"


class HookProvider(StrEnum):
    GITHUB = "github"
    STRIPE = "stripe"
    STANDARD_WEBHOOKS = "standard-webhooks"


class Scope(StrEnum):
    """What an API token may do (``api_tokens.scopes``); see :func:`vigil.ingest.auth.permits`."""

    EVENTS = "events"  # POST /v1/events
    MESSAGES = "messages"  # POST /v1/users/{user}/messages
    TIMERS = "timers"  # /v1/users/{user}/timers
    APPROVALS = "approvals"  # answering approvals on a person's behalf (operator consoles)
    ADMIN = "admin"  # operator routes


# constraint name -> enum it mirrors; the test walks this map.
CHECKED = {
    "events_status_valid": EventStatus,
    "runs_outcome_valid": RunOutcome,
    "outbox_status_valid": OutboxStatus,
    "timers_kind_valid": TimerKind,
    "timers_catch_up_valid": CatchUp,
    "approvals_on_expiry_valid": OnExpiry,
    "approvals_answer_valid": ApprovalAnswer,
    "approvals_answered_via_valid": AnsweredVia,
    "sessions_state_valid": SessionState,
    "shard_moves_state_valid": MoveState,
    "channels_type_valid": ChannelType,
    "outbox_channel_valid": ChannelType,
    "hooks_provider_valid": HookProvider,
    "tasks_status_valid": TaskStatus,
    "api_tokens_scopes_valid": Scope,
}
