"""The ledger's tasks as a run may look at them: :class:`vigil.agent.base.TaskDoor` over a
connection source (the worker's pool, or a DSN for tools and tests). The owner rule is the
ledger's (:func:`vigil.ledger.tasks.of_owner`), applied on every call. Runs and background
tasks record their sync children through it too (:func:`vigil.ledger.tasks.sync_started`)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import psycopg

from vigil.agent.base import NewTask, SyncOutcome, TasksUnavailable
from vigil.ledger import db
from vigil.ledger import tasks as ledger
from vigil.worker.finish import new_task_row

Connect = Callable[[], AbstractAsyncContextManager[Any]]


class LedgerTasks:
    def __init__(self, connect: Connect):
        self._connect = connect

    @classmethod
    def connecting(cls, dsn: str) -> LedgerTasks:
        """A connection of its own per call (no pool bound to an event loop)."""

        @asynccontextmanager
        async def connect() -> AsyncIterator[Any]:
            conn = await db.connect_async(dsn, autocommit=True)
            try:
                yield conn
            finally:
                await conn.close()

        return cls(connect)

    async def owned(self, *, user_id: str, owners: Sequence[str], task_id: str | None = None) -> list[ledger.TaskRow]:
        try:
            async with self._connect() as conn:
                return await ledger.of_owner(conn, user_id=user_id, owners=owners, task_id=task_id)
        except (psycopg.Error, OSError) as exc:
            raise TasksUnavailable(f"the task ledger did not answer: {exc}") from exc

    async def open_count(self, user_id: str) -> int:
        try:
            async with self._connect() as conn:
                return await ledger.open_count(conn, user_id)
        except (psycopg.Error, OSError) as exc:
            raise TasksUnavailable(f"the task ledger did not answer: {exc}") from exc

    async def cancel(self, *, task_id: str, actor: str) -> ledger.TaskRow | None:
        try:
            async with self._connect() as conn:
                return await ledger.cancel(conn, task_id=task_id, actor=actor)
        except (psycopg.Error, OSError) as exc:
            raise TasksUnavailable(f"the task ledger did not answer: {exc}") from exc

    async def sync_started(self, *, user_id: str, task: NewTask) -> None:
        try:
            async with self._connect() as conn:
                await ledger.sync_started(conn, new_task_row(user_id, task))
        except (psycopg.Error, OSError) as exc:
            raise TasksUnavailable(f"the task ledger did not answer: {exc}") from exc

    async def sync_ended(self, *, user_id: str, task: NewTask, outcome: SyncOutcome) -> None:
        u = outcome.usage
        ended = ledger.Outcome(
            outcome.status, outcome.result, outcome.error, u.turns, u.input_tokens, u.output_tokens, u.last_tool, u.note
        )
        try:
            async with self._connect() as conn:
                if not await ledger.sync_ended(conn, task_id=task.id, outcome=ended):
                    # Its start was not written (best effort): the row now, then its end.
                    await ledger.sync_started(conn, new_task_row(user_id, task))
                    await ledger.sync_ended(conn, task_id=task.id, outcome=ended)
        except (psycopg.Error, OSError) as exc:
            raise TasksUnavailable(f"the task ledger did not answer: {exc}") from exc
