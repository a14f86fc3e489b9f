"""The chaos run's clients: users sending chat messages through ingest, one at a time each,
every message retried with its Idempotency-Key until ingest acknowledges it (as a chat client
does), so that what was acknowledged is exactly what the ledger must hold.

Some users play a part (:class:`Cast`): a poison user sends one message with the poison
marker (:data:`POISON`) among its healthy ones; budgeted users run under a profile with a
small daily token budget (vigil_dev.chaos.__main__ creates and assigns it), which some pass
during the run; task users ask for a background task now and then (:data:`TASK`); approval
users run under a profile that asks before every action, and their questions are answered by
:class:`vigil_dev.chaos.approvals.Approver`."""

from __future__ import annotations

import asyncio
import math
import random
import time
from dataclasses import dataclass, field

import httpx

# A refused or unanswered request is sent again after this long (or the server's Retry-After,
# whichever is shorter: the client must keep pressing through a fault to measure it).
RETRY_S = 0.5
REQUEST_TIMEOUT_S = 5.0
# A message holding this is poison: the chaos script answers it with a call that kills the
# worker (vigil_dev.chaos.actions). An event is healthy if its text does not hold it.
POISON = "poison-pill"
# A poison user's poison message is one of its first messages, so that its worker kills (the
# attempts, each a rebalance) happen under load, not in the settling.
POISON_SEQ = (4, 16)
# A message holding this asks for a background task: the chaos script delegates one, whose
# child POSTs to the receiver (vigil_dev.chaos.actions). A task user's every TASK_EVERY-th
# message holds it.
TASK = "delegate-task"
TASK_EVERY = 7


@dataclass(frozen=True)
class Cast:
    """Which users (by number) play which part: every ``every``-th user from ``first`` of
    each part, up to ``count`` of them."""

    poison: frozenset[int] = frozenset()
    budgeted: dict[str, frozenset[int]] = field(default_factory=dict)  # profile -> users
    tasks: frozenset[int] = frozenset()
    approvals: frozenset[int] = frozenset()

    @classmethod
    def pick(cls, users: int, poison: int, budgeted: dict[str, int], tasks: int = 0, approvals: int = 0) -> Cast:
        """Parts spread over the users, none playing two: poison first, then each budget, then
        tasks, then approvals."""
        free = list(range(1, users, 2)) + list(range(0, users, 2))  # odd numbers first: spread out
        parts = []
        for count in (poison, *budgeted.values(), tasks, approvals):
            parts.append(frozenset(free[:count]))
            del free[:count]
        return cls(parts[0], dict(zip(budgeted, parts[1:-2])), parts[-2], parts[-1])

    def budget_of(self, n: int) -> str | None:
        return next((p for p, ns in self.budgeted.items() if n in ns), None)


@dataclass(frozen=True, slots=True)
class Acked:
    user: str
    seq: int
    key: str
    sent_at: float  # wall clock, first attempt
    acked_at: float  # wall clock


@dataclass
class Load:
    url: str
    token: str
    users: int
    rate: float  # messages per second, all users together
    seed: int
    cast: Cast = field(default_factory=Cast)
    acked: list[Acked] = field(default_factory=list)
    refusals: dict[str, int] = field(default_factory=dict)  # status or error kind -> count
    give_up_at: float = math.inf  # monotonic: a message not acknowledged by then is not counted
    _sending: bool = True

    def user_id(self, n: int) -> str:
        return f"chaos-{self.seed}-u{n:03d}"

    def stop_sending(self, give_up_in_s: float) -> None:
        """No new messages; those in flight are still retried until acknowledged, for up to
        ``give_up_in_s`` (a message given up is not counted as acknowledged)."""
        self.give_up_at = time.monotonic() + give_up_in_s
        self._sending = False

    async def run(self) -> None:
        """Every user's loop, until sending stops and every begun message is acknowledged or given up."""
        limits = httpx.Limits(max_connections=self.users, max_keepalive_connections=self.users)
        async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, limits=limits) as client:
            await asyncio.gather(*(self._user(client, n) for n in range(self.users)))

    async def _user(self, client: httpx.AsyncClient, n: int) -> None:
        rng = random.Random(f"{self.seed}-{n}")
        user = self.user_id(n)
        interval = self.users / self.rate
        await asyncio.sleep(rng.uniform(0, interval))
        poison_seq = rng.randint(*POISON_SEQ) if n in self.cast.poison else None
        seq = 0
        while self._sending:
            key = f"{user}-m{seq:05d}"
            sent_at = time.time()
            text = f"message {seq} from {user}" + (f" {POISON}" if seq == poison_seq else "")
            if n in self.cast.tasks and seq % TASK_EVERY == TASK_EVERY // 2:
                text += f" {TASK}"
            if await self._send(client, user, key, text):
                self.acked.append(Acked(user, seq, key, sent_at, time.time()))
            seq += 1
            await asyncio.sleep(rng.expovariate(1 / interval))

    async def _send(self, client: httpx.AsyncClient, user: str, key: str, text: str) -> bool:
        headers = {"Authorization": f"Bearer {self.token}", "Idempotency-Key": key}
        body = {"text": text}
        while time.monotonic() < self.give_up_at:
            try:
                response = await client.post(f"{self.url}/v1/users/{user}/messages", json=body, headers=headers)
                if 200 <= response.status_code < 300:
                    return True
                outcome = str(response.status_code)
                wait = min(RETRY_S, float(response.headers.get("Retry-After", RETRY_S)))
            except httpx.HTTPError as exc:
                outcome, wait = type(exc).__name__, RETRY_S
            self.refusals[outcome] = self.refusals.get(outcome, 0) + 1
            await asyncio.sleep(wait)
        return False
