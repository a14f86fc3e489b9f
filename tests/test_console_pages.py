"""The console application in this process against a real ledger: access, escaping, CSRF,
the retry actions and what each page shows. The browser and the whole stack are in
test_console_browser.py."""

from __future__ import annotations

import re

import pytest
from starlette.testclient import TestClient

from console_support import XSS, seed_user
from ingest_support import cli, create_token
from support import query, scalar

HTML = {"accept": "text/html"}


@pytest.fixture
def console(ledger):
    from vigil.console.app import create_app
    from vigil.console.settings import ConsoleSettings

    app = create_app(ConsoleSettings(database_url=ledger, console_auth_cache_s=0))
    with TestClient(app, base_url="http://console.test", follow_redirects=False) as client:
        yield client


def login(console, ledger) -> dict:
    token = create_token(ledger, "ops-alice")
    answer = post_login(console, {"token": token["token"], "next": "/dead"})
    assert answer.status_code == 303 and answer.headers["location"] == "/dead"
    return token


def csrf_of(html: str) -> str:
    return re.search(r'name="csrf" value="([0-9a-f.]{64,})"', html).group(1)


def post_login(console, data: dict):
    """The login form as a browser sends it: its page first (the form's CSRF value and its cookie)."""
    form = console.get("/login")
    return console.post("/login", data={**data, "csrf": csrf_of(form.text)})


def test_every_page_needs_a_token(console, ledger):
    seeded = seed_user(ledger)
    pages = [
        "/",
        "/dead",
        "/approvals",
        "/timers",
        "/partitions",
        f"/users/{seeded.user}",
        f"/events/{seeded.events[0]}",
        f"/runs/{seeded.run_id}",
        f"/deliveries/{seeded.delivery_id}",
        "/search?q=alice",
    ]
    for path in pages:
        answer = console.get(path)
        assert answer.status_code == 401, path
        assert answer.json()["error"] == "unauthorized"
        browser = console.get(path, headers=HTML)
        assert browser.status_code == 303 and browser.headers["location"].startswith("/login?next="), path
    assert console.get("/", headers={"authorization": "Bearer vgl_not-a-token"}).status_code == 401
    # Health and metrics are for probes and Prometheus, like every service's.
    assert console.get("/healthz").status_code == 200
    assert console.get("/metrics").status_code == 200
    token = create_token(ledger)
    assert console.get("/", headers={"authorization": f"Bearer {token['token']}"}).status_code == 200
    cli(ledger, "tokens", "revoke", token["id"])
    revoked = console.get("/", headers={"authorization": f"Bearer {token['token']}"})
    assert revoked.status_code == 403 and revoked.json()["error"] == "token_revoked"


def test_the_console_takes_an_operator_token_only(console, ledger):
    """Scoped tokens: admin opens it; a token without admin, or held to some users, does not."""
    import json

    def token(*args: str) -> str:
        return json.loads(cli(ledger, "tokens", "create", *args, "--json"))["token"]

    for refused in (
        token("app", "--scope", "events,messages"),
        token("ops-team-a", "--scope", "admin", "--users", "a*"),
    ):
        answer = console.get("/", headers={"authorization": f"Bearer {refused}"})
        assert answer.status_code == 403 and answer.json()["error"] == "forbidden"
        assert post_login(console, {"token": refused, "next": "/"}).status_code == 403
        assert console.get("/dead", headers={"authorization": f"Bearer {refused}"}).status_code == 403
    admin = token("ops", "--scope", "admin")
    assert console.get("/", headers={"authorization": f"Bearer {admin}"}).status_code == 200


def test_login_sets_an_httponly_strict_cookie_and_refuses_bad_tokens(console, ledger):
    bad = post_login(console, {"token": "vgl_wrong", "next": "/"})
    assert bad.status_code == 401 and "not valid" in bad.text and "vigil_console=" not in bad.headers["set-cookie"]
    login(console, ledger)
    (c,) = [c for c in console.cookies.jar if c.name == "vigil_console"]
    assert c.has_nonstandard_attr("HttpOnly")
    header = post_login(console, {"token": create_token(ledger)["token"]}).headers.get_list("set-cookie")[0]
    assert header.startswith("vigil_console=") and "Max-Age=" in header
    assert "HttpOnly" in header and "SameSite=strict" in header and "Path=/" in header
    page = console.get("/")
    assert page.status_code == 200 and "Pending events" in page.text
    assert "script-src" not in page.headers["content-security-policy"]  # default-src 'none': no script at all
    assert page.headers["content-security-policy"].startswith("default-src 'none'")
    # An open redirect is not a login target.
    assert post_login(console, {"token": "x", "next": "//evil.example"}).status_code == 401
    ok = post_login(console, {"token": create_token(ledger)["token"], "next": "//evil.example/x"})
    assert ok.headers["location"] == "/"


def test_attacker_controlled_text_is_escaped_everywhere(console, ledger):
    seeded = seed_user(ledger)
    login(console, ledger)
    for path in [
        f"/users/{seeded.user}",
        f"/events/{seeded.events[1]}",
        f"/runs/{seeded.run_id}",
        f"/deliveries/{seeded.delivery_id}",
        "/dead",
        "/search?q=" + XSS,
    ]:
        page = console.get(path)
        assert page.status_code == 200, path
        assert XSS not in page.text, path
        assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page.text, path


def test_timeline_shows_events_runs_and_what_each_run_wrote(console, ledger):
    seeded = seed_user(ledger)
    login(console, ledger)
    page = console.get(f"/users/{seeded.user}").text
    for needle in [
        f'href="/events/{seeded.events[0]}"',
        f'href="/runs/{seeded.run_id}"',
        f'href="/deliveries/{seeded.delivery_id}"',
        "followup-1",
        "apr-1",
        "/memories/notes.md",
        "epoch 7",
        "1280 tokens",
        "3 tool call(s)",
        "billing.invoice_paid",
    ]:
        assert needle in page, needle
    # In time order, newest first: the run (a second ago), the dead event (a minute), the run's events (two).
    assert page.index(f'id="run-{seeded.run_id}"') < page.index(f'id="event-{seeded.dead_event}"')
    assert page.index(f'id="event-{seeded.dead_event}"') < page.index(f'id="event-{seeded.events[0]}"')
    assert console.get("/users/nobody-at-all").status_code == 404


def test_a_runs_writes_are_linked_by_its_id_not_its_finish_instant(console, ledger):
    """Two runs finished in one transaction (one now()), and a timer that a later run set
    again: each write shows under the run whose id it carries, and only there."""
    seeded = seed_user(ledger)
    with __import__("psycopg").connect(ledger) as conn:
        other = conn.execute(
            "INSERT INTO runs (user_id, topic, partition, epoch, worker, event_ids, started_at, finished_at, outcome)"
            " VALUES (%s, 'test.events', 3, 7, 'worker-a', '{}', now() - interval '1 second', now(), 'nothing')"
            " RETURNING id",
            (seeded.user,),
        ).fetchone()[0]
        # Same transaction as the other run's row: the finish instant of both runs.
        conn.execute(
            "INSERT INTO memory (user_id, path, content, run_id) VALUES (%s, '/memories/other.md', 'y', %s)",
            (seeded.user, other),
        )
        conn.execute("UPDATE timers SET run_id = %s WHERE id = 'followup-1'", (other,))
        conn.execute(
            "INSERT INTO tasks (id, user_id, parent_run_key, depth, owner_chain, instructions, token_budget,"
            " max_attempts, deadline, run_id) VALUES ('tsk_aaaaaaaaaaaaaaaaaaaa', %s, 'k', 1, ARRAY[%s], 'dig',"
            " 100, 3, now() + interval '1 h', %s)",
            (seeded.user, seeded.user, other),
        )
    login(console, ledger)
    first = console.get(f"/runs/{seeded.run_id}").text
    assert "/memories/notes.md" in first and "apr-1" in first
    assert "/memories/other.md" not in first and "followup-1" not in first and "tsk_aaaaaaaaaaaaaaaaaaaa" not in first
    second = console.get(f"/runs/{other}").text
    assert "/memories/other.md" in second and "followup-1" in second
    assert 'id="delegated-tsk_aaaaaaaaaaaaaaaaaaaa"' in second
    assert "/memories/notes.md" not in second and "apr-1" not in second
    timeline = console.get(f"/users/{seeded.user}").text
    assert timeline.count("/memories/other.md") == 1 and timeline.count("followup-1") == 1


def test_timeline_pages_by_keyset_without_losing_or_repeating_entries(console, ledger):
    with __import__("psycopg").connect(ledger) as conn:
        conn.execute("INSERT INTO users (user_id, home_topic, home_partition) VALUES ('bob', 't', 0)")
        # 120 events received at the same instant: the keyset's tiebreak is the id.
        conn.execute(
            "INSERT INTO events (user_id, source, source_id, kind, received_at)"
            " SELECT 'bob', 'chat', 'm' || g, 'chat.message', '2026-01-01Z' FROM generate_series(1, 120) g"
        )
    login(console, ledger)
    seen, path = [], "/users/bob"
    while path:
        page = console.get(path).text
        seen += [int(i) for i in re.findall(r'id="event-(\d+)"', page)]
        more = re.search(r'id="older" href="([^"]+)"', page)
        path = more.group(1).replace("&amp;", "&") if more else None
    assert len(seen) == 120 and len(set(seen)) == 120 and seen == sorted(seen, reverse=True)


def test_search_finds_user_source_id_delivery_and_run(console, ledger):
    seeded = seed_user(ledger)
    login(console, ledger)
    assert console.get("/search?q=alice").headers["location"] == "/users/alice"
    assert console.get("/search?q=msg-1").headers["location"] == f"/events/{seeded.events[0]}"
    assert console.get("/search?q=msg-1&user=alice").headers["location"] == f"/events/{seeded.events[0]}"
    assert console.get("/search?q=msg-1&user=bob&kind=source_id").status_code == 200  # bob has no such event
    assert console.get(f"/search?q={seeded.delivery_id}").headers["location"] == f"/deliveries/{seeded.delivery_id}"
    assert console.get(f"/search?q={seeded.run_id}&kind=run").headers["location"] == f"/runs/{seeded.run_id}"
    assert console.get(f"/search?q={seeded.events[0]}&kind=event").headers["location"] == (
        f"/events/{seeded.events[0]}"
    )
    missing = console.get("/search?q=no-such-thing")
    assert missing.status_code == 200 and 'id="no-match"' in missing.text


def test_retry_needs_the_csrf_token_and_is_audited_with_the_operator(console, ledger):
    seeded = seed_user(ledger)
    login(console, ledger)
    page = console.get("/dead").text
    assert f'value="{seeded.dead_event}"' in page and seeded.delivery_id in page
    # A forged form (no CSRF value, or another's) changes nothing.
    for forged in ({}, {"csrf": "0" * 64}):
        answer = console.post("/dead/events/retry", data={"event_id": str(seeded.dead_event), **forged})
        assert answer.status_code == 403 and answer.json()["error"] == "csrf"
        assert console.post(f"/deliveries/{seeded.delivery_id}/revive", data=forged).status_code == 403
    assert scalar(ledger, "SELECT status FROM events WHERE id = %s", (seeded.dead_event,)) == "dead"
    assert scalar(ledger, "SELECT count(*) FROM audit WHERE action IN ('dead.retry', 'delivery.revive')") == 0

    csrf = csrf_of(page)
    answer = console.post("/dead/events/retry", data={"event_id": str(seeded.dead_event), "csrf": csrf})
    assert answer.status_code == 303 and answer.headers["location"].startswith("/dead?retried=")
    row = query(ledger, "SELECT status, attempts, retried_by FROM events WHERE id = %s", (seeded.dead_event,))[0]
    assert (row["status"], row["attempts"]) == ("pending", 0) and row["retried_by"].startswith("ops-alice (tok_")
    answer = console.post(f"/deliveries/{seeded.delivery_id}/revive", data={"csrf": csrf})
    assert answer.headers["location"] == f"/deliveries/{seeded.delivery_id}?revived=1"
    assert scalar(ledger, "SELECT status FROM outbox WHERE id = %s", (seeded.outbox_id,)) == "pending"
    audit = query(
        ledger, "SELECT actor, action, detail FROM audit WHERE action IN ('dead.retry', 'delivery.revive') ORDER BY id"
    )
    assert [a["action"] for a in audit] == ["dead.retry", "delivery.revive"]
    assert all(a["actor"].startswith("ops-alice (tok_") and a["actor"].endswith("via console") for a in audit)
    assert audit[0]["detail"] == {"requested": [seeded.dead_event], "retried": [seeded.dead_event]}
    # A second click finds nothing dead: left alone, and said so.
    again = console.post(f"/deliveries/{seeded.delivery_id}/revive", data={"csrf": csrf})
    assert again.headers["location"].endswith("?not_dead=1")
    # The dead letters page shows who retried what (the audit rows), newest first.
    actions = console.get("/dead").text.split('id="operator-actions"')[1]
    assert actions.index("delivery.revive") < actions.index("dead.retry")
    assert "ops-alice (tok_" in actions and seeded.delivery_id in actions


def test_lists_show_open_approvals_late_timers_and_partitions(console, ledger):
    seeded = seed_user(ledger)
    with __import__("psycopg").connect(ledger) as conn:
        held = "INSERT INTO outbox (user_id, run_id, epoch, body) VALUES ('alice', %s, 7, 'held')"
        conn.execute(held, (seeded.run_id,))
        conn.execute(
            "INSERT INTO timers (id, user_id, kind, due) VALUES ('late-one', 'alice', 'followup',"
            " date_trunc('second', now()) - interval '5 min'), ('far-off', 'alice', 'followup',"
            " date_trunc('second', now()) + interval '5 hours')"
        )
        conn.execute(
            "INSERT INTO partitions (topic, partition, epoch, holder, acquired_at, handover_until)"
            " VALUES ('vigil.events', 2, 41, 'worker-<b>x</b>', now(), NULL),"
            " ('vigil.events', 3, 9, 'worker-y', now(), now() + interval '15 seconds'),"
            " ('vigil.events', 4, 9, 'worker-y', now(), now() - interval '1 second')"
        )
    login(console, ledger)
    approvals = console.get("/approvals").text
    assert "apr-1" in approvals and "refund" in approvals
    timers = console.get("/timers").text
    assert "late-one" in timers and "<b>late</b>" in timers and "far-off" not in timers
    partitions = console.get("/partitions").text
    assert ">41<" in partitions and "worker-&lt;b&gt;x&lt;/b&gt;" in partitions
    row = lambda n: partitions.split(f'id="partition-vigil.events-{n}"')[1].split("</tr>")[0]  # noqa: E731
    # A hand-over in progress shows on its holder; one whose deadline passed does not.
    assert "handing over until" in row(3) and "handing over" not in row(4) and "handing over" not in row(2)
    overview = console.get("/").text
    assert "Dead in the last hour" in overview and "1 events" in overview
    card = lambda name: overview.split(f'id="card-{name}"')[1].split('<div class="card"')[0]  # noqa: E731
    assert '<a href="/approvals">1</a>' in card("approvals") and "none past its deadline" in card("approvals")
    assert '<a href="/timers">1</a>' in card("timers")  # late-one; followup-1 and far-off are not due yet
    assert f'<a href="/users/alice">alice</a> by <a href="/runs/{seeded.run_id}">' in card("outbox")


def test_approval_answer_tokens_in_messages_are_not_shown(console, ledger):
    from vigil.ledger.approvals import sign_token

    seeded = seed_user(ledger)
    token = sign_token(secret="secret", request_id="apr-1", user_id=seeded.user)
    with __import__("psycopg").connect(ledger) as conn:
        conn.execute("UPDATE outbox SET body = %s WHERE id = %s", (f"Approve? token: {token}", seeded.outbox_id))
    login(console, ledger)
    for path in [f"/users/{seeded.user}", f"/runs/{seeded.run_id}", f"/deliveries/{seeded.delivery_id}"]:
        page = console.get(path).text
        assert token not in page and "v1.(answer token hidden)" in page, path


def test_dead_letters_page_through_rows_microseconds_apart(console, ledger):
    with __import__("psycopg").connect(ledger) as conn:
        # Deaths microseconds apart: a cursor rounded to milliseconds would skip some of them.
        conn.execute(
            "INSERT INTO events (user_id, source, source_id, kind, received_at, status, attempts, finished_at)"
            " SELECT 'carol~x', 'chat', 'd' || g, 'chat.message', now(), 'dead', 5,"
            " '2026-01-01Z'::timestamptz + make_interval(secs => g * 0.000137) FROM generate_series(1, 120) g"
        )
    login(console, ledger)
    seen, path = [], "/dead"
    while path:
        page = console.get(path).text
        seen += [int(i) for i in re.findall(r'name="event_id" value="(\d+)"', page)]
        more = re.search(r'href="(/dead\?events_before=[^"]+)"', page)
        path = more.group(1).replace("&amp;", "&") if more else None
    assert len(seen) == 120 and len(set(seen)) == 120
    assert console.get("/dead?events_before=not-json").status_code == 200  # a bad cursor is the first page


def test_timeline_shows_the_users_background_tasks_escaped(console, ledger):
    """Issue 17's tasks on the timeline: status, attempts, holder, result or error; the task's
    instructions and result come from a model and are shown as text."""
    seeded = seed_user(ledger)
    query(
        ledger,
        """INSERT INTO tasks (id, user_id, parent_run_key, depth, owner_chain, instructions, token_budget,
                              max_attempts, deadline, status, attempts, lease_epoch, finished_at, result)
           VALUES ('tsk_0123456789abcdef0123', %(u)s, 'k', 1, ARRAY[%(u)s], %(x)s, 100, 3, now() + interval '1 h',
                   'succeeded', 2, 2, now(), %(x)s),
                  ('tsk_ffffffffffffffffffff', %(u)s, 'k', 1, ARRAY[%(u)s], 'slow one', 100, 3, now() + interval '1 h',
                   'lost', 3, 3, now(), NULL)""",
        {"u": seeded.user, "x": "research " + XSS},
    )
    query(ledger, "UPDATE tasks SET error = 'no heartbeat from w-1 for 31 s (attempt 3 of 3)' WHERE status = 'lost'")
    login(console, ledger)
    page = console.get(f"/users/{seeded.user}").text
    assert "Background tasks" in page and "tsk_0123456789abcdef0123" in page and "2 of 3" in page
    assert "no heartbeat from w-1 for 31 s (attempt 3 of 3)" in page
    assert XSS not in page and "research &lt;script&gt;alert(1)&lt;/script&gt;" in page


def test_timeline_shows_a_sync_child_and_its_parent_task(console, ledger):
    """Issue 44's sync rows on the timeline: the mode, and the task that delegated it."""
    seeded = seed_user(ledger)
    query(
        ledger,
        """INSERT INTO tasks (id, user_id, parent_run_key, parent_task_id, depth, owner_chain, instructions,
                              token_budget, max_attempts, deadline, status, attempts, finished_at, mode)
           VALUES ('tsk_parentparentparent', %(u)s, 'k', NULL, 1, ARRAY[%(u)s], 'survey', 100, 3,
                   now() + interval '1 h', 'succeeded', 1, now(), 'background'),
                  ('tsk_childchildchildchi', %(u)s, 'tsk_parentparentparent', 'tsk_parentparentparent', 2,
                   ARRAY[%(u)s], 'count', 100, 1, now() + interval '1 h', 'succeeded', 1, now(), 'sync')""",
        {"u": seeded.user},
    )
    login(console, ledger)
    page = console.get(f"/users/{seeded.user}").text
    row = page[page.index('id="task-tsk_childchildchildchi"') :]
    row = row[: row.index("</tr>")]
    assert "sync · depth 2" in row and 'child of <a href="#task-tsk_parentparentparent">' in row, row
    assert "lease" not in row


def console_with(ledger: str, **settings):
    from vigil.console.app import create_app
    from vigil.console.settings import ConsoleSettings

    app = create_app(ConsoleSettings(database_url=ledger, console_auth_cache_s=0, **settings))
    return TestClient(app, base_url="http://console.test", follow_redirects=False)


def test_partitions_show_lag_from_the_broker_and_pending_events_from_the_ledger(ledger, stack, topics):
    """Lag = the broker's end offset - the ledger's consumer position, per partition; pending
    events by their users' home partition; a partition no worker was assigned still shows."""
    from confluent_kafka import Producer

    producer = Producer({"bootstrap.servers": stack.bootstrap})
    for partition, count in ((0, 5), (1, 2)):
        for n in range(count):
            producer.produce(topics.events, value=b"x%d" % n, partition=partition)
    assert producer.flush(30) == 0
    with __import__("psycopg").connect(ledger) as conn:
        conn.execute(
            "INSERT INTO partitions (topic, partition, epoch, holder, acquired_at) VALUES (%s, 0, 2, 'w-1', now())",
            (topics.events,),
        )
        conn.execute(
            "INSERT INTO consumer_positions (topic, partition, next_offset) VALUES (%s, 0, 3)", (topics.events,)
        )
        conn.execute("INSERT INTO users (user_id, home_topic, home_partition) VALUES ('pat', %s, 1)", (topics.events,))
        conn.execute(
            "INSERT INTO events (user_id, source, source_id, kind, received_at)"
            " SELECT 'pat', 'chat', 'p' || g, 'chat.message', now() FROM generate_series(1, 2) g"
        )
    with console_with(ledger, kafka_bootstrap=stack.bootstrap, events_topic=topics.events) as console:
        login(console, ledger)
        page = console.get("/partitions").text
    rows = {
        int(m.group(1)): m.group(2)
        for m in re.finditer(rf'<tr id="partition-{re.escape(topics.events)}-(\d+)">(.*?)</tr>', page, re.S)
    }
    assert sorted(rows) == [0, 1, 2, 3], page
    cells = {p: re.findall(r"<td[^>]*>(.*?)</td>", row, re.S) for p, row in rows.items()}
    # columns: topic, partition, epoch, holder, assigned, position, end offset, lag, pending
    assert cells[0][2] == "2" and cells[0][3] == "w-1" and cells[0][6] == "5" and cells[0][7] == "<b>2</b>"
    assert cells[0][5].startswith("3")
    assert cells[1][3] == "never assigned" and cells[1][6] == "2" and cells[1][7] == "<b>2</b>"
    assert cells[1][8] == "2"  # pat's two pending events: home partition 1
    assert cells[2][6] == "0" and cells[2][7] == "0" and cells[0][8] == "0"


def test_partitions_page_says_unknown_when_kafka_does_not_answer(ledger):
    """No broker at the address: the page still answers, within the bound, with the lag
    unknown; the failure is cached, so the next load does not wait again."""
    import time

    from vigil_dev.devstack import free_port

    with __import__("psycopg").connect(ledger) as conn:
        conn.execute("INSERT INTO partitions (topic, partition, epoch, holder) VALUES ('vigil.events', 0, 1, 'w')")
    with console_with(ledger, kafka_bootstrap=f"127.0.0.1:{free_port()}") as console:
        login(console, ledger)
        started = time.monotonic()
        first = console.get("/partitions")
        took = time.monotonic() - started
        assert first.status_code == 200 and 'class="lag">unknown<' in first.text and "did not answer" in first.text
        assert took < 4.0, took
        started = time.monotonic()
        again = console.get("/partitions")
        assert again.status_code == 200 and 'class="lag">unknown<' in again.text
        assert time.monotonic() - started < 0.5  # the cached failure, not another wait


def test_search_by_source_id_alone_is_an_index_lookup(ledger):
    """Any user's event by its source id among those recorded in the dedup window: the key by
    event_keys_by_source_id, then the event through its user's indexes (never a scan of a big
    table, never a window of the newest events)."""
    from test_ledger_partitions import plan_of, seed_history
    from vigil.ledger.console import events_by_source_id
    from vigil.ledger.queries import Q

    seed_history(ledger)  # a month of finished events, a partition a day
    query(
        ledger,
        "INSERT INTO events (user_id, source, source_id, kind, received_at) VALUES ('q', 'chat', 'new-1', 'c', now())",
    )
    # Their dedup keys, as the worker's record writes them (same statement: same recorded_at).
    query(ledger, "INSERT INTO event_keys SELECT user_id, source, source_id, recorded_at FROM events")
    query(ledger, "ANALYZE events")
    query(ledger, "ANALYZE event_keys")

    def nodes(plan: dict) -> list[dict]:
        return [plan] + [n for child in plan.get("Plans", []) for n in nodes(child)]

    for source_id in ("old-7", "new-1", "missing"):
        params = {"source_id": source_id, "user_id": None, "limit": 50}
        plan = nodes(plan_of(ledger, Q.console_events_by_source_id, params))
        # The planner reads a near-empty partition (a day ahead, the live queue here) whole: that
        # is cheaper than its index. Every partition with history is read through the index.
        seq = {n["Relation Name"] for n in plan if n["Node Type"] == "Seq Scan"}
        big = {r["relname"] for r in query(ledger, "SELECT relname FROM pg_class WHERE reltuples > 100")}
        assert not seq & big, seq & big
        used = {n.get("Index Name") for n in plan if n.get("Index Name")}
        assert "event_keys_by_source_id" in used, used
    with __import__("psycopg").connect(ledger, row_factory=__import__("psycopg").rows.dict_row) as conn:
        [old] = events_by_source_id(conn, source_id="old-7")  # 8 days old: no window of the newest misses it
        assert old.user_id == "u00007" and old.status == "done"
        [new] = events_by_source_id(conn, source_id="new-1")  # pending, in the live queue
        assert (new.user_id, new.status) == ("q", "pending")
        assert [e.source_id for e in events_by_source_id(conn, source_id="new-1", user_id="q")] == ["new-1"]
        assert events_by_source_id(conn, source_id="new-1", user_id="someone-else") == []


def test_a_run_page_lists_its_kept_journal(console, ledger):
    """VIGIL_RUN_JOURNAL_DAYS keeps a run's steps: its page lists the model turns with their
    tokens and the calls with their key and outcome (docs/worker.md, "Durable runs")."""
    seeded = seed_user(ledger)
    with __import__("psycopg").connect(ledger) as conn:
        first = conn.execute("SELECT min(e) FROM runs, unnest(event_ids) e WHERE id = %s", (seeded.run_id,)).fetchone()
        key = f"{seeded.user}:{first[0]}"
        conn.execute(
            "INSERT INTO run_journal (run_key, step, kind, user_id, epoch, attempt, body, outcome, finished_at) VALUES"
            " (%s, 1, 'model', %s, 1, 1, %s, NULL, now()), (%s, 2, 'call', %s, 1, 1, %s, %s, now())",
            (
                key,
                seeded.user,
                '{"content": [{"type": "tool_use", "id": "t", "name": "refund", "input": {}}],'
                ' "usage": {"input_tokens": 321, "output_tokens": 12}, "ms": 840}',
                key,
                seeded.user,
                f'{{"name": "refund", "input": {{}}, "key": "{key}:2"}}',
                '{"text": "<refunded>", "is_error": false}',
            ),
        )
    login(console, ledger)
    page = console.get(f"/runs/{seeded.run_id}").text
    assert 'id="steps"' in page and "calls refund" in page and "321 / 12" in page
    assert f"{key}:2" in page and "ok" in page
    assert "<refunded>" not in page  # results are not shown raw


def test_a_run_page_lists_its_what_if_replays(console, ledger):
    """`vigil runs replay` records each replay: the run's page lists them with their verdict
    and the command that shows the diff (docs/agent.md, "Changing an agent safely")."""
    seeded = seed_user(ledger)
    login(console, ledger)
    assert "None (<code>vigil runs replay</code>" in console.get(f"/runs/{seeded.run_id}").text
    first = scalar(ledger, "SELECT min(e) FROM runs, unnest(event_ids) e WHERE id = %s", (seeded.run_id,))
    key = f"{seeded.user}:{first}"
    with __import__("psycopg").connect(ledger) as conn:
        conn.execute(
            "INSERT INTO run_replays (run_key, user_id, made_by, ran_with, verdict, messages_changed, report)"
            " VALUES (%s, %s, 'ops', 'profile support v2, model claude-next', 'new actions', true, '{}')",
            (key, seeded.user),
        )
    page = console.get(f"/runs/{seeded.run_id}").text
    assert 'id="replays"' in page and "profile support v2, model claude-next" in page
    assert "new actions" in page and f"vigil runs replay {key}" in page


def test_odd_ids_and_query_values_are_4xx_or_a_page_never_500(console, ledger):
    """Issue 46: /events/<5,000 digits> and /runs/<20 digits> were 500s before any
    authentication; with a token, /search?q=² (or ①, NUL) and NUL in /users/ were 500s, and a
    404 echoed the whole id."""
    seed_user(ledger)
    for path in ("/events/" + "9" * 5000, "/runs/" + "9" * 5000, "/runs/" + "9" * 20, "/events/%C2%B2"):
        answer = console.get(path)
        assert answer.status_code == 401 and answer.json()["error"] == "unauthorized", path
    token = create_token(ledger)["token"]
    bearer = {"authorization": f"Bearer {token}"}
    for path, error in (
        ("/events/" + "9" * 5000, "unknown_event"),
        ("/runs/" + "9" * 20, "unknown_run"),
        ("/runs/-1", "unknown_run"),
        ("/events/%C2%B2", "unknown_event"),
        ("/users/a%00b", "unknown_user"),
        ("/users/" + "u" * 5000, "unknown_user"),
    ):
        answer = console.get(path, headers=bearer)
        assert answer.status_code == 404 and answer.json()["error"] == error, (path, answer.text[:200])
        assert len(answer.json()["detail"]) < 200
    for q in ("²", "①", "\x00", "a\x00b", "9" * 20, "9" * 5000):
        for kind in ("any", "run", "event"):
            answer = console.get("/search", params={"q": q, "kind": kind}, headers=bearer)
            assert answer.status_code == 200 and 'id="no-match"' in answer.text, (q[:20], kind)
    assert console.get("/search", params={"q": "msg-1", "user": "a\x00"}, headers=bearer).status_code == 200
    cursor = '["2026-01-01T00:00:00+00:00","99999999999999999999"]'
    assert console.get("/dead", params={"events_before": cursor}, headers=bearer).status_code == 200
    assert console.get("/users/alice", params={"before": "2026-01-01~0~" + "9" * 20}, headers=bearer).status_code == 200
    retry = console.post("/dead/events/retry", data={"event_id": "9" * 20}, headers=bearer)
    assert retry.status_code == 400 and retry.json()["error"] == "bad_event_id"
