"""The delegate tool through the real SDK against the scripted Messages API: the child's
boundary is the parent's narrowed, depth is bounded, and a sync child's tokens are the
parent's. (Background tasks on real workers: tests/test_tasks.py.)"""

from __future__ import annotations

import asyncio
import dataclasses
import time

import psycopg
import pytest
from psycopg.rows import dict_row

from support import query
from vigil.agent.base import Delegation, TaskContext
from vigil.agent.delegation import CHILD_SYSTEM
from vigil.ledger import budgets as ledger_budgets
from vigil_dev import agent_testing as t
from vigil_dev.scripted_server import ScriptedServer


@pytest.fixture(scope="module")
def server():
    with ScriptedServer([]) as s:
        yield s


def limits(depth: int = 0, max_depth: int = 2, budget: int = 5000) -> Delegation:
    return Delegation(
        depth=depth, max_depth=max_depth, token_budget=budget, timeout_s=60, max_attempts=3, owner_chain=("u1", "k")
    )


def ctx_with(text: str, delegation: Delegation | None):
    ctx = t.context([t.chat(text)])
    ctx.delegation = delegation
    return ctx


def task_ctx(instructions: str) -> TaskContext:
    """A depth-1 task delegated with refund."""
    return TaskContext(
        task_id="tsk_t",
        user_id="u1",
        instructions=instructions,
        tools=("refund",),
        token_budget=5000,
        deadline=time.monotonic() + 60,
        delegation=limits(depth=1, max_depth=1),
        attempt=1,
    )


def call(name, **tool_input):
    return {"type": "tool_use", "name": name, "input": tool_input}


def delegate_results(server) -> list[dict]:
    out = []
    for request in server.requests():
        for block in request["messages"][-1]["content"]:
            if block.get("type") == "tool_result":
                out.append(block)
    return out


def run(server, rules, ctx, **overrides):
    server.set_script(rules)
    server.clear()
    [result] = t.run(server.base_url, ctx, **overrides)
    return result


CHILD = {"system": "sub-agent"}


def test_a_child_may_not_get_a_tool_the_parent_must_ask_for(server):
    """refund is `ask` by default: the parent cannot hand it to a child that has nobody to ask."""
    result = run(
        server,
        [
            {"when": {"tool_result": "delegate"}, "reply": []},
            {"reply": [call("delegate", instructions="refund order 7", tools=["refund"])]},
        ],
        ctx_with("please", limits()),
    )
    [refused] = delegate_results(server)
    assert refused.get("is_error") and "may not use refund without asking" in refused["content"]
    assert result.tasks == []


def test_a_tool_the_parent_may_use_freely_can_be_given(server):
    result = run(
        server,
        [
            {"when": {"tool_result": "delegate"}, "reply": []},
            {"reply": [call("delegate", instructions="refund order 7", tools=["refund"], budget=999)]},
        ],
        ctx_with("please", limits()),
        tool_permissions="refund=allow",
    )
    [task] = result.tasks
    # Its chain: the user, the conversation that delegated, the run (later runs of the
    # conversation own it too).
    assert (task.tools, task.depth, task.token_budget) == (("refund",), 1, 999)
    assert task.owner_chain == ("u1", result.session.id, "k")
    assert task.session_id == result.session.id  # its result resumes this conversation


def test_depth_past_the_bound_is_refused(server):
    result = run(
        server,
        [
            {"when": {"tool_result": "delegate"}, "reply": []},
            {"reply": [call("delegate", instructions="anything")]},
        ],
        ctx_with("please", limits(depth=1, max_depth=1)),
    )
    [refused] = delegate_results(server)
    assert refused.get("is_error") and "at most 1 deep" in refused["content"]
    assert result.tasks == []


def test_a_sync_childs_tokens_are_the_parents(server):
    """The child is its own conversation (own transcript, own system prompt, no send_message);
    its answer is the tool result; its turns and tokens are added to the parent run's usage."""
    result = run(
        server,
        [
            {"when": {**CHILD, "user_text": "add 40 and 2"}, "reply": [{"type": "text", "text": "42"}]},
            {
                "when": {"tool_result": "delegate", "tool_result_text": "^42$"},
                "reply": [call("send_message", text="the answer is 42")],
            },
            {"when": {"tool_result": "send_message"}, "reply": []},
            {"reply": [call("delegate", instructions="add 40 and 2", mode="sync")]},
        ],
        ctx_with("compute please", limits()),
    )
    requests = server.requests()
    child = [r for r in requests if r["system"] == CHILD_SYSTEM]
    parent = [r for r in requests if r["system"] != CHILD_SYSTEM]
    assert len(child) == 1 and len(parent) == 3
    assert child[0]["messages"] == [{"role": "user", "content": [{"type": "text", "text": "add 40 and 2"}]}]
    assert "tools" not in child[0] or all(tool["name"] != "send_message" for tool in child[0]["tools"])
    assert [m.text for m in result.messages] == ["the answer is 42"]
    assert result.usage.turns == 4  # three parent calls and the child's
    assert result.tasks == []


def test_a_task_is_offered_only_tools_still_allowed_where_it_executes(server):
    """A task delegated with refund, executed on a worker where refund is now `ask`: the child
    is not offered refund (the boundary is checked again at execution, and only narrows)."""

    async def go(permissions: str):
        claude = t.agent(server.base_url, tool_permissions=permissions)
        try:
            ctx = task_ctx("refund order 9")
            return await claude.run_task(ctx), ctx
        finally:
            await claude.close()

    server.set_script([{"reply": [{"type": "text", "text": "cannot refund from here"}]}])
    for permissions, offered in (("refund=ask", []), ("refund=allow", ["refund"])):
        server.clear()
        result, ctx = asyncio.run(go(permissions))
        [request] = server.requests()
        assert [tool["name"] for tool in request.get("tools", [])] == offered, permissions
        assert result.text == "cannot refund from here"
        assert ctx.usage.turns == 1 and ctx.usage.input_tokens > 0


def test_a_run_starts_at_most_its_bound_of_background_tasks_and_reserves_their_tokens(server):
    """VIGIL_MAX_TASKS_PER_RUN=3: the fourth background delegation of one run is an error result
    the model reads. Each queued task's budget is reserved from the run's tokens at delegation:
    with 4,000 billed tokens, a first task of 2,000 leaves a second less than it asked for, and what
    the tasks may spend and what the run spent never add up past the run's budget."""
    rules = [{"when": {"tool_result": "delegate"}, "reply": []}]
    fan_out = [call("delegate", instructions=f"job {i}", budget=300) for i in range(4)]
    bounded = dataclasses.replace(limits(budget=2000), max_tasks_per_run=3)
    result = run(server, [*rules, {"reply": fan_out}], ctx_with("fan out", bounded), max_run_tokens=5000)
    results = delegate_results(server)
    assert [bool(r.get("is_error")) for r in results] == [False, False, False, True], results
    assert "at most 3 background tasks" in results[3]["content"]
    assert [t.token_budget for t in result.tasks] == [300, 300, 300]

    two = [call("delegate", instructions=f"big job {i}", budget=2000) for i in range(2)]
    result = run(server, [*rules, {"reply": two}], ctx_with("fan out", bounded), max_run_tokens=4000)
    budgets = [t.token_budget for t in result.tasks]
    spent = ledger_budgets.billed(result.usage)  # as the run's cap counts it
    assert budgets[0] == 2000 and budgets[1] < 2000, budgets
    assert sum(budgets) + spent <= 4000, (budgets, spent)


def test_a_tasks_progress_names_its_last_tool_and_its_latest_note(server):
    """The child's usage, kept current for the heartbeat to flush: turns, tokens, the last tool
    it called and the text it wrote with that call (its note)."""
    ctx = task_ctx("look around")

    async def go():
        claude = t.agent(server.base_url, tool_permissions="refund=allow")
        try:
            return await claude.run_task(ctx)
        finally:
            await claude.close()

    server.clear()
    server.set_script(
        [
            {"when": {"tool_result": "refund"}, "reply": [{"type": "text", "text": "all done"}]},
            {"reply": [{"type": "text", "text": "refunding order 3 first"}, call("refund", order_id="3")]},
        ]
    )
    result = asyncio.run(go())
    assert result.text == "all done"
    assert (ctx.usage.turns, ctx.usage.last_tool, ctx.usage.note) == (2, "refund", "refunding order 3 first")


# -- the agent looks at its own tasks (tasks_list, task_result, task_cancel) --------------------


def _seed_tasks(ledger: str, rows: list[tuple[str, str, tuple[str, ...], str]]) -> None:
    """(id, user, owner chain, status) rows, as a delegating run's finish and a holder leave them."""
    from vigil.ledger import tasks as ledger_tasks

    async def seed():
        conn = await psycopg.AsyncConnection.connect(ledger, autocommit=True, row_factory=dict_row)
        for task_id, user, chain, status in rows:
            new = ledger_tasks.NewTaskRow(
                id=task_id,
                user_id=user,
                parent_run_key=chain[1],
                parent_task_id=None,
                session_id=None,
                depth=1,
                owner_chain=list(chain),
                instructions=f"instructions of {task_id}",
                tools=[],
                token_budget=100,
                max_attempts=2,
                timeout_s=600,
            )
            await ledger_tasks.create(conn, new)
            if status == "succeeded":
                await conn.execute(
                    "UPDATE tasks SET status = 'succeeded', result = %s, finished_at = now() WHERE id = %s",
                    (f"answer of {task_id}", task_id),
                )
        await conn.close()

    asyncio.run(seed())


def test_an_agent_reads_and_cancels_only_the_tasks_of_its_own_chain(server, ledger):
    """A run in a resumed conversation: tasks_list, task_result and task_cancel reach the
    tasks of its chain, those its run or an earlier run of its conversation delegated and
    their descendants, and nothing else of its user: another run's task (another
    conversation's, or of none) and its children are refused alike, as are another user's
    task and an unknown id: one error result that tells nothing of them, and nothing
    cancelled. (Every chain starts with the user: owning by the user would own them all.)"""
    from vigil.agent.base import SavedSession
    from vigil.worker.task_door import LedgerTasks

    session = SavedSession("ses-mine", "open", [])
    ctx = t.context([t.chat("how are my tasks?", session_id=session.id)], sessions=[session])
    ctx.delegation = dataclasses.replace(limits(), owner_chain=("u1", ctx.run_key))
    earlier = "u1:8:8:1"  # an earlier run of this conversation
    _seed_tasks(
        ledger,
        [
            ("tsk_done", "u1", ("u1", session.id, ctx.run_key), "succeeded"),
            ("tsk_open", "u1", ("u1", session.id, ctx.run_key), "queued"),
            ("tsk_grandchild", "u1", ("u1", ctx.run_key, "tsk_done"), "queued"),  # chain of an older run
            ("tsk_earlier", "u1", ("u1", session.id, earlier), "succeeded"),
            ("tsk_earlier_child", "u1", ("u1", session.id, earlier, "tsk_earlier"), "queued"),
            ("tsk_other_run", "u1", ("u1", "u1:9:9:1"), "queued"),
            ("tsk_other_session", "u1", ("u1", "ses-other", "u1:7:7:1"), "succeeded"),
            ("tsk_other_child", "u1", ("u1", "ses-other", "u1:7:7:1", "tsk_other_session"), "queued"),
            ("tsk_theirs", "u2", ("u2", session.id, ctx.run_key), "succeeded"),
        ],
    )
    ctx.tasks = LedgerTasks.connecting(ledger)
    own = ("tsk_done", "tsk_open", "tsk_grandchild", "tsk_earlier", "tsk_earlier_child")
    others = ("tsk_other_run", "tsk_other_session", "tsk_other_child", "tsk_theirs", "tsk_nothing")
    calls = [
        call("tasks_list"),
        *[call("task_result", task_id=i) for i in own],
        call("task_cancel", task_id="tsk_open"),
        call("task_cancel", task_id="tsk_earlier_child"),
        *[call("task_result", task_id=i) for i in others],
        *[call("task_cancel", task_id=i) for i in others],
    ]
    run(server, [{"when": {"tool_result": "tasks_list"}, "reply": []}, {"reply": calls}], ctx)
    listed, *answers = delegate_results(server)
    read, cancelled, refused = answers[: len(own)], answers[len(own) : len(own) + 2], answers[len(own) + 2 :]
    assert not listed.get("is_error"), listed
    assert all(i in listed["content"] for i in own), listed
    assert not any(i in listed["content"] for i in others), listed
    assert all(not r.get("is_error") for r in read + cancelled), read + cancelled
    assert "answer of tsk_done" in read[0]["content"] and "answer of tsk_earlier" in read[3]["content"]
    assert all("cancelled" in c["content"] for c in cancelled), cancelled
    assert len(refused) == 2 * len(others)
    for answer, task_id in zip(refused, others + others):
        assert answer.get("is_error"), answer
        assert answer["content"].replace(task_id, "X") == refused[-1]["content"].replace("tsk_nothing", "X"), answer
    touched = query(ledger, "SELECT id, status FROM tasks WHERE cancel_requested_at IS NOT NULL ORDER BY id")
    assert touched == [{"id": "tsk_earlier_child", "status": "cancelled"}, {"id": "tsk_open", "status": "cancelled"}]


def test_a_delegation_past_the_users_open_tasks_is_an_error_result(server, ledger):
    """VIGIL_MAX_OPEN_TASKS_PER_USER=3 with two of the user's tasks open (one queued, one
    running) and a finished one: the run's first background delegation is queued, its second
    is refused with an error result the model reads."""
    from vigil.worker.task_door import LedgerTasks

    ctx = ctx_with("fan out", dataclasses.replace(limits(), max_open_tasks_per_user=3))
    old = ("u1", "u1:7:7:1")
    _seed_tasks(
        ledger,
        [("tsk_q", "u1", old, "queued"), ("tsk_r", "u1", old, "queued"), ("tsk_s", "u1", old, "succeeded")],
    )
    query(ledger, "UPDATE tasks SET status = 'running', lease_holder = 'w', heartbeat_at = now() WHERE id = 'tsk_r'")
    ctx.tasks = LedgerTasks.connecting(ledger)
    fan_out = [call("delegate", instructions=f"job {i}", budget=300) for i in range(2)]
    result = run(server, [{"when": {"tool_result": "delegate"}, "reply": []}, {"reply": fan_out}], ctx)
    queued, refused = delegate_results(server)
    assert not queued.get("is_error"), queued
    assert refused.get("is_error") and "at most 3 open background tasks" in refused["content"], refused
    assert len(result.tasks) == 1 and result.tasks[0].max_open == 3


# -- every child visible (issue 44 item 2) ------------------------------------------------------


def test_a_sync_child_leaves_a_sync_task_row_with_its_status_and_usage(server, ledger):
    """A run's sync child, and that child's own sync child, each leave a `sync` task row: the
    child's parent is the run (its key), the grandchild's parent the child (parent_task_id);
    status succeeded, their turns and tokens, started and finished, never reported as an event.
    The same run again (a replay: the same run key and steps) writes the same two rows, not
    two more."""
    from vigil.worker.task_door import LedgerTasks

    ctx = ctx_with("compute please", dataclasses.replace(limits(), owner_chain=("u1", "u1:1:1:1")))
    ctx.tasks = LedgerTasks.connecting(ledger)
    rules = [
        {"when": {**CHILD, "user_text": "^add 40 and 2$"}, "reply": [{"type": "text", "text": "42"}]},
        {"when": {**CHILD, "tool_result": "delegate"}, "reply": [{"type": "text", "text": "it is 42"}]},
        {"when": {**CHILD, "user_text": "^ask a helper$"}, "reply": [call("delegate", instructions="add 40 and 2")]},
        {"when": {"tool_result": "delegate"}, "reply": []},
        {"reply": [call("delegate", instructions="ask a helper", mode="sync")]},
    ]
    first_session = None
    for attempt in (1, 2):
        result = run(server, rules, ctx)
        first_session = first_session or result.session.id  # the rows keep the chain they started with
        [answer] = delegate_results(server)[-1:]
        assert answer["content"] == "it is 42", answer
        rows = query(ledger, "SELECT * FROM tasks ORDER BY depth")
        assert len(rows) == 2, rows
        child, grandchild = rows
        assert {r["mode"] for r in rows} == {"sync"} and {r["status"] for r in rows} == {"succeeded"}
        assert (child["parent_run_key"], child["parent_task_id"], child["depth"]) == (ctx.run_key, None, 1)
        assert (grandchild["parent_task_id"], grandchild["depth"]) == (child["id"], 2)
        assert child["owner_chain"] == ["u1", first_session, "u1:1:1:1"]
        assert grandchild["owner_chain"] == ["u1", first_session, "u1:1:1:1", child["id"]]
        assert child["result"] == "it is 42" and grandchild["result"] == "42"
        assert (child["turns"], grandchild["turns"]) == (3, 1)  # a row's usage includes its sync children's
        assert grandchild["input_tokens"] > 0 and child["input_tokens"] > grandchild["input_tokens"]
        assert child["output_tokens"] > 0 and child["attempts"] == attempt
        assert all(r["started_at"] and r["finished_at"] and r["reported_at"] for r in rows)
        assert all(r["lease_holder"] is None and r["heartbeat_at"] is None for r in rows)
        assert result.usage.turns == 5 and result.tasks == []  # the run's two and its child's three


def test_a_sync_child_whose_row_cannot_be_written_still_answers(server):
    """Best effort: a ledger that does not answer costs the run nothing but a warning and a
    count in vigil_sync_task_rows_unwritten_total."""
    from vigil.agent import metrics
    from vigil.worker.task_door import LedgerTasks

    ctx = ctx_with("compute please", limits())
    ctx.tasks = LedgerTasks.connecting("postgresql://vigil@127.0.0.1:1/none?connect_timeout=1")
    before = metrics.SYNC_TASK_ROWS_UNWRITTEN._value.get()
    rules = [
        {"when": {**CHILD, "user_text": "add 40 and 2"}, "reply": [{"type": "text", "text": "42"}]},
        {"when": {"tool_result": "delegate"}, "reply": []},
        {"reply": [call("delegate", instructions="add 40 and 2", mode="sync")]},
    ]
    run(server, rules, ctx)
    [answer] = delegate_results(server)
    assert answer["content"] == "42" and not answer.get("is_error"), answer
    assert metrics.SYNC_TASK_ROWS_UNWRITTEN._value.get() == before + 2  # its start and its end
