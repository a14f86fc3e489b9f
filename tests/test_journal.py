"""The run journal's ledger rules without processes (vigil.ledger.journal): appends fenced by
the claim's epoch and by a task's lease, a takeover that waits for an append in flight, the
finish and the pruner ending journals, and a replay that takes the journal up exactly."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from types import SimpleNamespace

import psycopg
import pytest
from psycopg.rows import dict_row

from support import query, scalar
from vigil.agent.journal import Journal
from vigil.agent.tools import ToolOutput
from vigil.ledger import journal as ledger_journal
from vigil.ledger.partitions import PartitionKey, take_over

HOME = PartitionKey("events", 0)


def setup(ledger: str) -> None:
    query(ledger, "INSERT INTO partitions (topic, partition, epoch) VALUES ('events', 0, 1)")


async def aconn(ledger: str) -> psycopg.AsyncConnection:
    return await psycopg.AsyncConnection.connect(ledger, autocommit=True, row_factory=dict_row)


def fence(epoch: int = 1) -> ledger_journal.RunFence:
    return ledger_journal.RunFence(HOME, epoch, "ann", 1)


def test_a_stale_epoch_appends_nothing_and_records_no_outcome(ledger):
    setup(ledger)

    async def go():
        conn = await aconn(ledger)
        await ledger_journal.append(conn, fence(), run_key="ann:1", step=1, kind="call", body='{"name":"x"}')
        with psycopg.connect(ledger, autocommit=True, row_factory=dict_row) as other:
            assert take_over(other, HOME, "worker-b") == 2
        with pytest.raises(ledger_journal.Fenced):
            await ledger_journal.outcome(conn, fence(), run_key="ann:1", step=1, outcome='{"text":"ok"}')
        with pytest.raises(ledger_journal.Fenced):
            await ledger_journal.append(conn, fence(), run_key="ann:1", step=2, kind="model", body="{}")
        # The new owner appends under its epoch; a step already there is refused, not replaced.
        await ledger_journal.outcome(conn, fence(2), run_key="ann:1", step=1, outcome='{"text":"ok"}')
        with pytest.raises(ledger_journal.Fenced):
            await ledger_journal.append(conn, fence(2), run_key="ann:1", step=1, kind="call", body="{}")
        await conn.close()

    asyncio.run(go())
    rows = query(ledger, "SELECT step, epoch, outcome::text AS outcome FROM run_journal")
    assert rows == [{"step": 1, "epoch": 1, "outcome": '{"text":"ok"}'}]


def test_a_takeover_waits_for_an_append_in_flight(ledger):
    """The append holds the partition row FOR SHARE to commit: the takeover's epoch bump waits,
    so the next owner reads every step the old one managed to append."""
    setup(ledger)
    with psycopg.connect(ledger, row_factory=dict_row) as conn:  # a transaction held open
        conn.execute(
            "INSERT INTO run_journal (run_key, step, kind, user_id, epoch, attempt, body)"
            " SELECT 'ann:1', 1, 'model', 'ann', p.epoch, 1, '{}' FROM partitions p WHERE p.epoch = 1 FOR SHARE OF p"
        )
        took: list[float] = []

        def takeover():
            with psycopg.connect(ledger, autocommit=True, row_factory=dict_row) as other:
                began = time.monotonic()
                take_over(other, HOME, "worker-b")
                took.append(time.monotonic() - began)

        thread = threading.Thread(target=takeover)
        thread.start()
        time.sleep(0.5)
        assert not took, "the takeover did not wait for the append"
        conn.commit()
        thread.join(10)
    assert took and took[0] >= 0.4


def test_a_task_append_is_fenced_by_its_lease(ledger):
    query(
        ledger,
        "INSERT INTO tasks (id, user_id, parent_run_key, depth, owner_chain, instructions, token_budget, status,"
        " attempts, max_attempts, lease_holder, lease_epoch, heartbeat_at, deadline)"
        " VALUES ('tsk_1', 'ann', 'ann:1', 1, '{ann}', 'do it', 1000, 'running', 1, 3, 'w1', 4, now(),"
        " now() + interval '1 hour')",
    )

    async def go():
        conn = await aconn(ledger)
        await ledger_journal.append(
            conn, ledger_journal.TaskFence("tsk_1", 4), run_key="task:tsk_1", step=1, kind="model", body="{}"
        )
        with pytest.raises(ledger_journal.Fenced):
            await ledger_journal.append(
                conn, ledger_journal.TaskFence("tsk_1", 3), run_key="task:tsk_1", step=2, kind="model", body="{}"
            )
        steps = await ledger_journal.live_task(conn, "task:tsk_1")
        await conn.close()
        return steps

    assert [s.step for s in asyncio.run(go())] == [1]


class Recording:
    """A writer that keeps what the journal would append (the agent side, no ledger)."""

    def __init__(self):
        self.rows: dict[int, list] = {}

    async def append(self, step, kind, body):
        self.rows[step] = [kind, body, None]

    async def outcome(self, step, outcome):
        self.rows[step][2] = outcome

    def steps(self):
        return [ledger_journal.Step(n, kind, body, out) for n, (kind, body, out) in sorted(self.rows.items())]


def test_an_action_call_runs_once_and_in_doubt_again_with_its_key():
    calls: list[str] = []

    async def act(key):
        calls.append(key)
        return ToolOutput("done")

    async def go():
        first = Recording()
        journal = Journal("ann:7", first)
        step = journal.take()
        assert (await journal.action(step, "refund", {"a": 1}, act)).text == "done"
        # Replayed with the outcome recorded: not run again.
        again = Journal.of("ann:7", Recording(), first.steps())
        assert (await again.action(again.take(), "refund", {"a": 1}, act)).text == "done"
        # In doubt (the intent without its outcome): run again, with the same key.
        first.rows[step][2] = None
        doubt = Journal.of("ann:7", first, first.steps())
        await doubt.action(doubt.take(), "refund", {"a": 1}, act)
        assert first.rows[step][2] is not None, "the repeated call's outcome is recorded"

    asyncio.run(go())
    assert calls == ["ann:7:1", "ann:7:1"]


def answer(*blocks):
    """A model response as the journal sees it: content blocks and usage."""
    usage = SimpleNamespace(input_tokens=10, output_tokens=5, cache_read_input_tokens=0, cache_creation_input_tokens=0)
    return SimpleNamespace(content=[SimpleNamespace(**b, to_dict=lambda b=b: b) for b in blocks], usage=usage)


def test_a_diverged_replay_never_gives_a_journaled_key_to_another_call(monkeypatch):
    """The agent changed between two attempts (a tool renamed): the replay keeps the steps
    before as facts, and the call that no longer matches its journaled step is made under a
    number past every journaled one, never under the key its step had (that key named another
    call, which happened). A replay after it, by the same code, takes up the continuation
    instead of leaving the journal again. Before, the run failed (Diverged), its journal was
    dropped and the next attempt started over: the refund made again under a new key."""
    monkeypatch.setattr("vigil.agent.journal.assistant_content", lambda content: [c.to_dict() for c in content])
    calls: list[str] = []

    async def act(key):
        calls.append(key)
        return ToolOutput("done")

    async def ask_tool():
        return answer({"type": "tool_use", "id": "t1", "name": "refund", "input": {}})

    async def go():
        first = Recording()
        journal = Journal("ann:7", first)
        await journal.model_turn(ask_tool)
        await journal.action(journal.take(), "refund", {}, act)
        # The new code calls the tool by another name at step 2.
        second = Recording()
        second.rows = {n: list(row) for n, row in first.rows.items()}
        replay = Journal.of("ann:7", second, first.steps())
        await replay.model_turn(ask_tool)  # step 1: replayed, not asked
        await replay.action(replay.take(), "credit", {}, act)
        assert json.loads(second.rows[3][1])["diverged_at"] == 2
        # Once more, the same code: the continuation is replayed, nothing runs again.
        third = Journal.of("ann:7", Recording(), second.steps())
        await third.model_turn(ask_tool)
        assert (await third.action(third.take(), "credit", {}, act)).text == "done"
        # A model turn where the journal holds a call: asked live under a new number.
        fourth_rows = Recording()
        fourth = Journal.of("ann:7", fourth_rows, first.steps())
        await fourth.model_turn(ask_tool)
        await fourth.model_turn(ask_tool)  # step 2, which the journal holds as a call
        assert list(fourth_rows.rows) == [3] and json.loads(fourth_rows.rows[3][1])["diverged_at"] == 2

    asyncio.run(go())
    assert calls == ["ann:7:2", "ann:7:3"]


def test_a_journaled_outcome_is_a_fact_whatever_the_agent_allows_now():
    """A call made before the crash is handed back as made, even if the tool is since removed,
    denied or set to ask (the conversation takes the fact before it asks permission); a call
    of another name at that step is no fact."""
    first = Recording()

    async def go():
        journal = Journal("bo:1", first)
        await journal.action(journal.take(), "refund", {}, lambda key: _done())

    async def _done():
        return ToolOutput("refunded")

    asyncio.run(go())
    replay = Journal.of("bo:1", None, first.steps())
    assert replay.fact(1, "refund") == ToolOutput("refunded")
    assert replay.fact(1, "credit") is None
    first.rows[1][2] = None  # in doubt: no fact, the call decides again (same key)
    assert Journal.of("bo:1", None, first.steps()).fact(1, "refund") is None


def test_the_finish_and_the_pruner_end_journals(ledger):
    setup(ledger)
    for key, user in (("ann:1", "ann"), ("bob:2", "bob"), ("task:tsk_1", "ann")):
        query(
            ledger,
            "INSERT INTO run_journal (run_key, step, kind, user_id, epoch, attempt, body) VALUES (%s, 1, 'model', %s,"
            " 1, 1, '{}')",
            (key, user),
        )

    async def go():
        conn = await aconn(ledger)
        await ledger_journal.finish_users(conn, ["ann"], [1], keep=False)
        await ledger_journal.finish_users(conn, ["bob"], [2], keep=True)
        await conn.close()

    asyncio.run(go())
    # The user's background task's journal is the task's: a run's finish leaves it.
    assert query(ledger, "SELECT run_key, finished_at IS NOT NULL AS kept FROM run_journal ORDER BY 1") == [
        {"run_key": "bob:2", "kept": True},
        {"run_key": "task:tsk_1", "kept": False},
    ]
    query(ledger, "DELETE FROM run_journal WHERE run_key = 'task:tsk_1'")
    query(ledger, "UPDATE run_journal SET finished_at = now() - interval '3 days'")
    with psycopg.connect(ledger, autocommit=True, row_factory=dict_row) as conn:
        assert ledger_journal.prune(conn, keep_days=5, live_days=7) == 0
        assert ledger_journal.prune(conn, keep_days=2, live_days=7) == 1
    assert scalar(ledger, "SELECT count(*) FROM run_journal") == 0


def test_a_dead_events_journal_is_parked_until_the_operators_retry(ledger):
    """Rule 5: a dead event's journal (a call in doubt) is no later run's to read or end; the
    operator's retry brings it back, to the retried event's claim first."""
    setup(ledger)
    ids = [
        scalar(
            ledger,
            "INSERT INTO events (user_id, source, source_id, kind, received_at) VALUES ('ann', 'chat', %s, 'm', now())"
            " RETURNING id",
            (f"s{n}",),
        )
        for n in range(2)
    ]
    dead, later = ids
    query(ledger, "UPDATE events SET status = 'dead', finished_at = now(), error = 'x' WHERE id = %s", (dead,))
    for key in (f"ann:{dead}~3", f"ann:{later}"):
        query(
            ledger,
            "INSERT INTO run_journal (run_key, step, kind, user_id, epoch, attempt, body)"
            " VALUES (%s, 1, 'model', 'ann', 1, 1, '{}')",
            (key,),
        )

    async def live() -> list[str]:
        conn = await aconn(ledger)
        lives = (await ledger_journal.live_from(await ledger_journal.live_many_cursor(conn, ["ann"]))).get("ann", [])
        await conn.close()
        return [each.run_key for each in lives]

    async def finish(event_ids: list[int]) -> None:
        conn = await aconn(ledger)
        await ledger_journal.finish_users(conn, ["ann"], event_ids, keep=False)
        await conn.close()

    assert asyncio.run(live()) == [f"ann:{later}"]  # parked: the later run never sees it
    asyncio.run(finish([later]))
    assert asyncio.run(live()) == []
    assert query(ledger, "SELECT run_key FROM run_journal") == [{"run_key": f"ann:{dead}~3"}]
    query(ledger, "UPDATE events SET status = 'pending', attempts = 0, finished_at = NULL WHERE id = %s", (dead,))
    assert asyncio.run(live()) == [f"ann:{dead}~3"]


def test_steps_read_back_keep_their_bytes(ledger):
    """json, not jsonb: a replayed answer is the same text, key order included."""
    setup(ledger)
    body = json.dumps({"content": [{"type": "text", "text": "é"}], "z": 1, "a": 2}, ensure_ascii=False)

    async def go():
        conn = await aconn(ledger)
        await ledger_journal.append(conn, fence(), run_key="ann:1", step=1, kind="model", body=body)
        cur = await ledger_journal.live_many_cursor(conn, ["ann"])
        live = await ledger_journal.live_from(cur)
        await conn.close()
        return live

    assert asyncio.run(go())["ann"][0].steps[0].body == body


def test_a_group_append_writes_each_step_under_its_own_fence(ledger):
    """The worker's group statement: the steps whose epoch is current are written, a step of a
    stale epoch and a step already there are refused, each on its own."""
    query(ledger, "INSERT INTO partitions (topic, partition, epoch) VALUES ('events', 0, 2), ('events', 1, 1)")
    other = PartitionKey("events", 1)

    def item(home, epoch, key, step, kind="model"):
        return ledger_journal.Pending(ledger_journal.RunFence(home, epoch, "ann", 1), key, step, kind, "{}")

    async def go():
        conn = await aconn(ledger)
        written = await ledger_journal.append_many(
            conn,
            [item(HOME, 2, "ann:1", 1), item(HOME, 1, "bob:2", 1), item(other, 1, "cy:3", 1, "call")],
        )
        again = await ledger_journal.append_many(conn, [item(HOME, 2, "ann:1", 1)])
        outcomes = await ledger_journal.outcome_many(
            conn, [item(other, 1, "cy:3", 1, "outcome"), item(HOME, 2, "ann:1", 1, "outcome")]
        )
        await conn.close()
        return written, again, outcomes

    written, again, outcomes = asyncio.run(go())
    assert written == {("ann:1", 1), ("cy:3", 1)}  # bob's epoch 1 of partition 0 is stale
    assert again == set()
    assert outcomes == {("cy:3", 1)}  # only a call's outcome, once
