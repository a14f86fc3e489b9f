"""Ids on ingest's path routes: one rule, every route (docs/ingest.md, "Ids in paths").

A path parameter is one segment, percent-decoded exactly once: a user id with ``/`` (the
shape of the documented token patterns, ``team-a/*``) is sent with ``%2F``, a ``%`` as
``%25``. The same user id typed into the operator CLI names the same rows.
"""

from __future__ import annotations

import json
from urllib.parse import quote

import httpx
import pytest
from starlette.routing import Route

from ingest_support import cli, ledger_count, read_events, start_ingest
from support import query
from vigil.ingest.app import create_app

USER = "team-a/bob"
PATH_USER = quote(USER, safe="")  # team-a%2Fbob


@pytest.fixture
def ingest(stack, ledger, topics):
    server = start_ingest(stack, ledger, topics)
    yield server
    server.stop()


@pytest.fixture
def client(ingest, ledger):
    """A token scoped the way the docs show: every route family, users ``team-a/*`` only."""
    made = json.loads(
        cli(ledger, "tokens", "create", "team-a", "--scope", "messages,timers", "--users", "team-a/*", "--json")
    )
    with httpx.Client(base_url=ingest.url, headers={"Authorization": f"Bearer {made['token']}"}, timeout=30) as c:
        yield c


def test_every_route_with_a_slash_user_id_reaches_that_user(client, ledger, stack, topics):
    """Finding: user ids with ``/`` could not be reached on the path routes (404): messages,
    timers, tasks."""
    sent = client.post(f"/v1/users/{PATH_USER}/messages", json={"text": "hi"}, headers={"Idempotency-Key": "m-1"})
    assert sent.status_code == 202, sent.text
    (event,) = read_events(stack.bootstrap, topics.events, 1, topics.partitions)
    assert event.user_id == USER

    timer = {"id": "digest", "every": 3600, "payload": {}}
    created = client.post(f"/v1/users/{PATH_USER}/timers", json=timer)
    assert created.status_code == 201, created.text
    assert created.json()["user_id"] == USER
    listed = client.get(f"/v1/users/{PATH_USER}/timers")
    assert listed.status_code == 200 and [t["id"] for t in listed.json()["timers"]] == ["digest"], listed.text
    one = client.get(f"/v1/users/{PATH_USER}/timers/digest")
    assert one.status_code == 200 and one.json()["user_id"] == USER, one.text
    assert client.delete(f"/v1/users/{PATH_USER}/timers/digest").status_code == 204
    assert query(ledger, "SELECT user_id, done FROM timers") == [{"user_id": USER, "done": True}]

    query(
        ledger,
        "INSERT INTO tasks (id, user_id, parent_run_key, depth, owner_chain, instructions, token_budget,"
        " max_attempts, deadline) VALUES ('tsk_aaaaaaaaaaaaaaaaaaaa', %s, 'k', 1, ARRAY[%s], 'dig',"
        " 100, 3, now() + interval '1 h') RETURNING id",
        (USER, USER),
    )
    tasks = client.get(f"/v1/users/{PATH_USER}/tasks")
    assert tasks.status_code == 200 and [t["id"] for t in tasks.json()["tasks"]] == ["tsk_aaaaaaaaaaaaaaaaaaaa"]


def test_a_path_segment_is_decoded_once(client, ledger):
    """``%252F`` is the three characters ``%2F`` in the id, never a second ``/``; a bare
    ``/`` is a path separator, so ``team-a/bob`` unencoded is no route at all."""
    literal = "team-a/%2F"
    made = client.post(f"/v1/users/{quote(literal, safe='')}/timers", json={"id": "t1", "every": 3600})
    assert made.status_code == 201, made.text
    assert query(ledger, "SELECT user_id FROM timers") == [{"user_id": literal}]
    unencoded = client.get(f"/v1/users/{USER}/timers")
    assert unencoded.status_code == 404 and unencoded.json()["error"] == "not_found"
    other = client.get(f"/v1/users/{quote('team-b/eve', safe='')}/timers")
    assert other.status_code == 403, other.text  # the scope still judges the decoded id
    assert ledger_count(ledger, "SELECT count(*) FROM timers") == 1


def test_every_path_parameter_of_ingest_follows_the_rule(stack, ledger, topics):
    """No route can opt out: every ``{name}`` in ingest's route table uses the ``segment``
    convertor (a plain ``{name}`` would hand the handler the id still percent-encoded)."""
    from ingest_support import ingest_settings

    app = create_app(ingest_settings(stack.bootstrap, ledger, topics.events))
    params = [
        (route.path, name, convertor)
        for route in app.routes
        if isinstance(route, Route)
        for name, convertor in route.param_convertors.items()
    ]
    assert {name for _, name, _ in params} >= {"user_id", "timer_id", "task_id", "hook_id", "request_id"}
    assert [(path, name) for path, name, convertor in params if type(convertor).__name__ != "SegmentConvertor"] == []


def test_cli_commands_take_a_slash_user_id(ledger):
    """The operator CLI names the same user the API does: ``team-a/bob`` as typed."""
    cli(ledger, "timers", "add", USER, "t1", "--every", "3600")
    assert "t1" in cli(ledger, "timers", "list", USER)
    cli(ledger, "timers", "rm", USER, "t1")
    cli(ledger, "policies", "set", USER, "chat=fold")
    assert cli(ledger, "policies", "show", USER).startswith(f"{USER}: event policies chat=fold")
    hook = json.loads(cli(ledger, "hooks", "add", "--provider", "github", "--user", USER, "--json"))
    assert query(ledger, "SELECT user_id FROM hooks WHERE id = %s", (hook["id"],)) == [{"user_id": USER}]
    cli(ledger, "inbox", USER)
