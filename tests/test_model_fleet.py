"""One fleet toward the model (vigil.agent.fleet, vigil.ledger.fleet): a 429 one worker is told
slows the other worker's calls too, and VIGIL_MODEL_FLEET_CONCURRENCY bounds the calls in flight
across workers. Two agents, each with its own client, pool and gate (two workers' worth), one
scripted Messages API and one real ledger."""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime, timedelta

import psycopg
import pytest

from vigil.ledger import db
from vigil.ledger import fleet as ledger_fleet
from vigil_dev import agent_testing as t
from vigil_dev.scripted_server import ScriptedServer

END_AFTER_SEND = {"when": {"tool_result": "send_message"}, "reply": []}


def say(pattern: str, text: str, delay: float = 0.0) -> dict:
    rule = {
        "when": {"user_text": pattern},
        "reply": [{"type": "tool_use", "name": "send_message", "input": {"text": text, "urgent": False}}],
    }
    if delay:
        rule["delay"] = delay
    return rule


@pytest.fixture(scope="module")
def server():
    with ScriptedServer([]) as s:
        yield s


async def two_workers(base_url: str, ledger: str, **overrides):
    """Two agents joined to the fleet as two workers would be (their own pools and clients)."""
    pools = [db.async_pool(ledger, name=f"w{i}", max_size=4, autocommit=True) for i in range(2)]
    agents = []
    for i, pool in enumerate(pools):
        await pool.open(wait=True)
        agent = t.agent(base_url, **overrides)
        await agent.join_fleet(pool, f"worker-{i}")
        agents.append(agent)
    return agents, pools


async def close(agents, pools) -> None:
    for agent in agents:
        await agent.close()
    for pool in pools:
        await pool.close()


def backoff_row(ledger: str):
    with psycopg.connect(ledger) as conn:
        return conn.execute("SELECT until, reason, set_by FROM model_backoff").fetchone()


@pytest.mark.parametrize("shared", [True, False])
def test_a_429_one_worker_is_told_slows_the_other_workers_calls(server, ledger, shared):
    """Worker 0 is told 429 with retry-after 3 s; worker 1, starting its run just after, waits
    for the same instant before it asks (shared) or asks at once (VIGIL_MODEL_SHARED_BACKOFF off)."""
    server.set_script(
        {"rules": [{"times": 1, "error": {"status": 429, "retry_after": 3}}, END_AFTER_SEND, say("hello", "Hi!")]}
    )
    server.clear()

    async def go():
        agents, pools = await two_workers(server.base_url, ledger, model_shared_backoff=shared, model_backoff_cap_s=10)
        try:
            first = asyncio.create_task(agents[0].run(t.context([t.chat("hello one")], user_id="u0")))
            while not server.requests():  # worker 0's refused call has reached the API
                await asyncio.sleep(0.02)
            await asyncio.sleep(0.3)  # its 429 is read and the back-off written
            told_at = time.monotonic()
            await agents[1].run(t.context([t.chat("hello two")], user_id="u1"))
            second_took = time.monotonic() - told_at
            await first
            return second_took
        finally:
            await close(agents, pools)

    second_took = asyncio.run(go())
    row = backoff_row(ledger)
    if shared:
        assert row is not None and row[1] == "rate_limited" and row[2] == "worker-0"
        assert second_took >= 2.0, f"worker 1 did not wait for the fleet's back-off ({second_took:.2f} s)"
    else:
        assert row is None
        assert second_took < 2.0, f"worker 1 waited without a shared back-off ({second_took:.2f} s)"


@pytest.mark.parametrize("bound", [1, 0])
def test_the_fleet_bound_holds_calls_in_flight_across_workers(server, ledger, bound):
    """Each answer takes 1.5 s. With VIGIL_MODEL_FLEET_CONCURRENCY=1, two workers' runs ask one
    after the other (first answers about 3 s after both started); without it, together."""
    server.set_script({"rules": [END_AFTER_SEND, say("hello", "Hi!", delay=1.5)]})
    server.clear()

    async def go():
        agents, pools = await two_workers(server.base_url, ledger, model_fleet_concurrency=bound)
        try:
            started = time.monotonic()
            runs = [agent.run(t.context([t.chat(f"hello {i}")], user_id=f"u{i}")) for i, agent in enumerate(agents)]
            await asyncio.gather(*runs)
            return time.monotonic() - started
        finally:
            await close(agents, pools)

    took = asyncio.run(go())
    if bound:
        assert took >= 3.0, f"both first calls were in flight at once ({took:.2f} s)"
    else:
        assert took < 3.0, f"calls were serialised without a fleet bound ({took:.2f} s)"
    with psycopg.connect(ledger) as conn:
        held = conn.execute("SELECT count(*) FROM model_slots WHERE lease_until > now()").fetchone()[0]
    assert held == 0  # every slot was given back


def test_a_dead_workers_slot_frees_when_its_lease_ends_on_the_callers_clock(ledger):
    """The slot rules decided on the caller's clock: no sleep."""
    t0 = datetime(2030, 1, 1, tzinfo=UTC)

    async def go():
        async with await psycopg.AsyncConnection.connect(
            ledger, autocommit=True, row_factory=psycopg.rows.dict_row
        ) as conn:
            await ledger_fleet.make_slots(conn, size=1, now=t0)
            taken = await ledger_fleet.take_slot(conn, size=1, holder="dead:1", lease_s=60, now=t0)
            busy = await ledger_fleet.take_slot(
                conn, size=1, holder="live:1", lease_s=60, now=t0 + timedelta(seconds=59)
            )
            freed = await ledger_fleet.take_slot(
                conn, size=1, holder="live:2", lease_s=60, now=t0 + timedelta(seconds=61)
            )
            await ledger_fleet.give_back(conn, slot=0, holder="dead:1")  # too late: not its slot any more
            still = await ledger_fleet.take_slot(
                conn, size=1, holder="live:3", lease_s=60, now=t0 + timedelta(seconds=62)
            )
            await ledger_fleet.give_back(conn, slot=0, holder="live:2")
            back = await ledger_fleet.take_slot(
                conn, size=1, holder="live:4", lease_s=60, now=t0 + timedelta(seconds=63)
            )
            await ledger_fleet.slow_down(
                conn, provider="anthropic", until=t0 + timedelta(seconds=30), reason="overloaded", set_by="a", now=t0
            )
            await ledger_fleet.slow_down(
                conn, provider="anthropic", until=t0 + timedelta(seconds=10), reason="rate_limited", set_by="b", now=t0
            )
            pause = await ledger_fleet.paused_until(conn, provider="anthropic", now=t0 + timedelta(seconds=20))
            over = await ledger_fleet.paused_until(conn, provider="anthropic", now=t0 + timedelta(seconds=31))
            return taken, busy, freed, still, back, pause, over

    taken, busy, freed, still, back, pause, over = asyncio.run(go())
    assert (taken, busy, freed, still, back) == (0, None, 0, None, 0)
    assert pause is not None and pause.reason == "overloaded" and pause.set_by == "a"  # never moved back
    assert over is None
