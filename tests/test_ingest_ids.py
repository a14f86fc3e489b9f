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
from click.testing import CliRunner
from starlette.routing import Route

from ingest_support import cli, ledger_count, probed_ingest, read_events
from support import query
from vigil.ingest.app import create_app

USER = "team-a/bob"
PATH_USER = quote(USER, safe="")  # team-a%2Fbob


@pytest.fixture
def ingest(stack, ledger, topics):
    with probed_ingest(stack, ledger, topics) as server:
        yield server


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


# Issue 58: one id rule on every route (vigil.envelope.id_problem): 1 to 256 printable
# characters with no space at either end. " b1" showed in the console as a lookalike of b1;
# the tasks list allowed 200 where every other route allowed 256.
EDGE_IDS = [" b1", "b1 ", " ", "   ", "\u3000b1", "b\x01"]


@pytest.fixture
def admin(ingest, ledger):
    made = json.loads(cli(ledger, "tokens", "create", "admin", "--json"))
    with httpx.Client(base_url=ingest.url, headers={"Authorization": f"Bearer {made['token']}"}, timeout=30) as c:
        yield c


@pytest.mark.parametrize("odd", EDGE_IDS)
def test_an_id_with_an_edge_space_is_refused_on_every_route(admin, ledger, stack, topics, odd):
    user = quote(odd, safe="")
    event = {"user_id": "u1", "source": "s", "source_id": "1", "kind": "k"}
    in_path = "user_id" if odd.isprintable() else "path"  # a control character fails the whole path first
    answers = [
        *((admin.post("/v1/events", json={**event, name: odd}), "invalid_event", name) for name in event),
        (admin.post("/v1/events", json={**event, "session_id": odd}), "invalid_event", "session_id"),
        (admin.post(f"/v1/users/{user}/messages", json={"text": "hi"}), "invalid_request", in_path),
        (admin.post(f"/v1/users/{user}/timers", json={"id": "t1", "every": 60}), "invalid_request", in_path),
        (admin.get(f"/v1/users/{user}/timers"), "invalid_request", in_path),
        (admin.get(f"/v1/users/{user}/timers/t1"), "invalid_request", in_path),
        (admin.delete(f"/v1/users/{user}/timers/t1"), "invalid_request", in_path),
        (admin.get(f"/v1/users/{user}/tasks"), "invalid_request", in_path),
    ]
    for response, error, field in answers:
        assert response.status_code == 400, (response.request.url, response.text)
        assert (response.json()["error"], response.json()["field"]) == (error, field), response.text
    assert read_events(stack.bootstrap, topics.events, 0, topics.partitions, settle=1.0) == []
    assert ledger_count(ledger, "SELECT count(*) FROM timers") == 0


@pytest.mark.parametrize(
    "args",
    [
        ("channels", "set", " b1", "--type", "log"),
        ("hooks", "add", "--provider", "github", "--user", "b1 "),
        ("policies", "set", "  b1", "chat=fold"),
    ],
)
def test_an_id_with_an_edge_space_is_refused_by_the_commands_that_store_one(ledger, args):
    """Issue 58: only `timers add` had the id rule; `channels set " b1"` stored a lookalike
    of b1 that no route can reach."""
    from vigil.cli import main

    result = CliRunner().invoke(main, list(args), env={"VIGIL_DATABASE_URL": ledger})
    assert result.exit_code == 2 and "a user id must not begin or end with a space" in result.output, result.output
    for table in ("channels", "hooks", "agent_policies"):
        assert ledger_count(ledger, f"SELECT count(*) FROM {table}") == 0, table


def test_the_tasks_list_takes_a_user_id_of_256_characters_as_every_route_does(admin):
    long_user = "u" * 256
    assert admin.get(f"/v1/users/{long_user}/tasks").status_code == 200
    assert admin.get(f"/v1/users/{long_user}/timers").status_code == 200
    assert admin.get(f"/v1/users/{long_user}u/tasks").status_code == 400


# Each reserved source (timer, approval and the hook providers) as a producer might write it.
RESERVED_WRITTEN = [
    "Timer",
    "timer ",
    "\uff54\uff49\uff4d\uff45\uff52",  # fullwidth timer
    "APPROVAL",
    "GitHub",
    " stripe",
    "Standard-Webhooks",
    "\uff53\uff54\uff52\uff49\uff50\uff45",  # fullwidth stripe
]


@pytest.mark.parametrize("source", RESERVED_WRITTEN)
def test_a_reserved_source_is_refused_however_it_is_written(admin, stack, topics, source):
    response = admin.post("/v1/events", json={"user_id": "u1", "source": source, "source_id": "1", "kind": "k"})
    assert response.status_code == 400 and response.json()["field"] == "source", response.text
    assert read_events(stack.bootstrap, topics.events, 0, topics.partitions, settle=1.0) == []


def test_a_reserved_source_in_a_batch_is_refused_as_alone_and_nothing_is_produced(admin, stack, topics):
    """Issue 58: the batch route refuses a folded reserved source as the single-event route
    does, naming the item, and produces none of the batch (the good item before it either)."""
    good = {"user_id": "u1", "source": "s", "source_id": "1", "kind": "k"}
    for source in RESERVED_WRITTEN:
        reserved = {**good, "source": source, "source_id": "2"}
        alone = admin.post("/v1/events", json=reserved)
        batch = admin.post("/v1/events", json={"events": [good, reserved]})
        assert batch.status_code == alone.status_code == 400, (source, batch.text)
        named = {"field": "events[1].source", "detail": "events[1]." + alone.json()["detail"]}
        assert batch.json() == {**alone.json(), **named}, (source, batch.text, alone.text)
    assert read_events(stack.bootstrap, topics.events, 0, topics.partitions, settle=1.0) == []


def test_a_batch_with_a_repeated_source_id_reports_what_was_stored(admin, stack, topics):
    one = {"user_id": "u1", "source": "s", "source_id": "dup", "kind": "k"}
    other = {**one, "source_id": "other"}
    response = admin.post("/v1/events", json={"events": [one, {**one, "kind": "k2"}, other]})
    assert response.status_code == 202 and response.json() == {"accepted": 2, "duplicates": 1}, response.text
    produced = read_events(stack.bootstrap, topics.events, 2, topics.partitions, settle=1.0)
    assert sorted((e.source_id, e.kind) for e in produced) == [("dup", "k"), ("other", "k")]


def test_another_users_session_is_404_on_events_as_on_messages(admin, ledger, stack, topics):
    query(ledger, "INSERT INTO sessions (id, user_id) VALUES ('s-of-ann', 'ann') RETURNING id")
    mine = {"user_id": "ann", "source": "s", "source_id": "1", "kind": "k", "session_id": "s-of-ann"}
    theirs = {**mine, "user_id": "bob", "source_id": "2"}
    response = admin.post("/v1/events", json=theirs)
    assert response.status_code == 404 and response.json()["error"] == "unknown_session", response.text
    batch = admin.post("/v1/events", json={"events": [mine, theirs]})
    assert batch.status_code == 404 and batch.json()["field"] == "events[1].session_id", batch.text
    assert admin.post("/v1/users/bob/messages", json={"text": "hi", "session_id": "s-of-ann"}).status_code == 404
    assert admin.post("/v1/events", json=mine).status_code == 202
    assert [e.source_id for e in read_events(stack.bootstrap, topics.events, 1, topics.partitions, settle=1.0)] == ["1"]
