"""Issue 46, console sessions: the cookie holds a random session id (never the API token),
the session expires and logout ends it in the ledger, the CSRF value is random per session
and checked on login and logout too, no header skips it, only tokens that may use the
console get a session, API tokens may expire, and unknown tokens, cookies and approval ids
are not a query each."""

from __future__ import annotations

import json
import secrets
from datetime import UTC, datetime, timedelta

import httpx
import pytest
from click.testing import CliRunner
from starlette.testclient import TestClient

from console_support import seed_user
from ingest_support import cli, create_token, start_ingest
from support import UnknownKeys, query, scalar
from test_console_pages import csrf_of, post_login


@pytest.fixture
def console(ledger):
    from vigil.console.app import create_app
    from vigil.console.settings import ConsoleSettings

    app = create_app(ConsoleSettings(database_url=ledger, console_auth_cache_s=0, console_session_s=3600))
    with TestClient(app, base_url="http://console.test", follow_redirects=False) as client:
        yield client


def logged_in(console, ledger, name: str = "ops") -> dict:
    token = create_token(ledger, name)
    assert post_login(console, {"token": token["token"], "next": "/dead"}).status_code == 303
    return token


def test_an_empty_bearer_header_does_not_skip_the_csrf_check(console, ledger):
    """Finding: the cookie with an empty `Authorization: Bearer ` header skipped the CSRF
    check (a dead delivery was revived that way). A request with an Authorization header is
    judged by that header alone, so no header skips it."""
    seeded = seed_user(ledger)
    logged_in(console, ledger)
    for header in ("Bearer ", "Bearer", "bearer  ", "Basic eA==", ""):
        revive = console.post(f"/deliveries/{seeded.delivery_id}/revive", data={}, headers={"authorization": header})
        assert revive.status_code in (401, 403), (header, revive.status_code)
        retry = console.post(
            "/dead/events/retry", data={"event_id": str(seeded.dead_event)}, headers={"authorization": header}
        )
        assert retry.status_code in (401, 403), header
    assert console.post(f"/deliveries/{seeded.delivery_id}/revive", data={}).status_code == 403  # cookie, no CSRF
    assert scalar(ledger, "SELECT status FROM outbox WHERE id = %s", (seeded.outbox_id,)) == "dead"
    assert scalar(ledger, "SELECT status FROM events WHERE id = %s", (seeded.dead_event,)) == "dead"


def test_the_cookie_holds_a_random_session_id_with_max_age_never_the_token(console, ledger):
    """Finding: the cookie held the raw API token, with no Max-Age."""
    token = create_token(ledger, "ops")
    answer = post_login(console, {"token": token["token"], "next": "/"})
    header = answer.headers.get_list("set-cookie")[0]
    assert header.startswith("vigil_console=") and "Max-Age=3600" in header
    cookie = console.cookies["vigil_console"]
    assert token["token"] not in header and cookie != token["token"] and len(cookie) >= 43
    row = query(ledger, "SELECT token_id, id_hash, expires_at - created_at AS life FROM console_sessions")
    assert [(r["token_id"], r["life"]) for r in row] == [(token["id"], timedelta(hours=1))]
    assert cookie not in json.dumps(row, default=str)  # stored as its sha256 only
    assert console.get("/").status_code == 200


def test_a_session_expires_server_side(console, ledger):
    logged_in(console, ledger)
    assert console.get("/").status_code == 200
    query(
        ledger,
        "UPDATE console_sessions SET expires_at = now() - interval '1 second', created_at = now() - interval '1 hour'",
    )
    answer = console.get("/")
    assert answer.status_code == 401 and answer.json()["error"] == "unauthorized"
    assert console.get("/", headers={"accept": "text/html"}).headers["location"].startswith("/login")


def test_logout_needs_the_sessions_csrf_and_ends_the_session_server_side(console, ledger):
    """Finding: logout only deleted the cookie (a copy of it kept working) and needed no CSRF value."""
    logged_in(console, ledger)
    cookie = console.cookies["vigil_console"]
    csrf = csrf_of(console.get("/").text)
    forged = console.post("/logout", data={})
    assert forged.status_code == 403 and forged.json()["error"] == "csrf"
    assert console.get("/").status_code == 200  # still logged in
    assert console.post("/logout", data={"csrf": csrf}).headers["location"] == "/login"
    assert scalar(ledger, "SELECT count(*) FROM console_sessions WHERE ended_at IS NOT NULL") == 1
    console.cookies.set("vigil_console", cookie, domain="console.test")  # a copy of the old cookie
    assert console.get("/").status_code == 401


def test_the_csrf_value_is_random_per_session_and_dies_with_it(console, ledger):
    """Finding: the CSRF value was a fixed HMAC of the token: the same across logins, and it
    survived logout."""
    seeded = seed_user(ledger)
    token = logged_in(console, ledger)
    first = csrf_of(console.get("/dead").text)
    console.post("/logout", data={"csrf": first})
    assert post_login(console, {"token": token["token"], "next": "/"}).status_code == 303
    second = csrf_of(console.get("/dead").text)
    assert first != second
    stale = console.post(f"/deliveries/{seeded.delivery_id}/revive", data={"csrf": first})
    assert stale.status_code == 403 and stale.json()["error"] == "csrf"
    assert console.post(f"/deliveries/{seeded.delivery_id}/revive", data={"csrf": second}).status_code == 303


def test_login_needs_the_forms_own_csrf_value(console, ledger):
    """Finding: login needed no CSRF value (another site could log a browser in as anyone)."""
    token = create_token(ledger)
    for data in ({}, {"csrf": "0" * 64}):
        answer = console.post("/login", data={"token": token["token"], **data})
        assert answer.status_code == 403 and "expired" in answer.text, data
    form = console.get("/login")
    console.cookies.delete("vigil_console_login")
    assert console.post("/login", data={"token": token["token"], "csrf": csrf_of(form.text)}).status_code == 403
    assert scalar(ledger, "SELECT count(*) FROM console_sessions") == 0


def test_only_tokens_that_may_use_the_console_get_a_session(console, ledger):
    """Finding: login accepted any token and set the cookie, then every page was 403."""
    for options in (["--scope", "events,messages"], ["--scope", "admin", "--users", "a*"]):
        token = json.loads(cli(ledger, "tokens", "create", "app", *options, "--json"))
        answer = post_login(console, {"token": token["token"], "next": "/"})
        assert answer.status_code == 403 and "may not use the console" in answer.text
        assert "vigil_console=" not in answer.headers["set-cookie"]
    assert scalar(ledger, "SELECT count(*) FROM console_sessions") == 0


def test_tokens_expire_at_ingest_and_console_and_list_shows_it(stack, ledger, topics, console):
    """Finding: API tokens never expired. `--expires 30d` or an instant is stored and shown;
    past it, ingest and the console refuse the token (401 token_expired), its login and its
    sessions end; a session never outlives its token."""
    made = json.loads(cli(ledger, "tokens", "create", "short", "--expires", "30d", "--json"))
    expires = datetime.fromisoformat(made["expires_at"])
    assert timedelta(days=29, hours=23) < expires - datetime.now(UTC) <= timedelta(days=30)
    listed = [json.loads(line) for line in cli(ledger, "tokens", "list", "--json").splitlines()]
    assert [t["expires_at"] for t in listed if t["id"] == made["id"]] == [made["expires_at"]]
    at = json.loads(cli(ledger, "tokens", "create", "at", "--expires", "2099-01-01T00:00:00Z", "--json"))
    assert at["expires_at"].startswith("2099-01-01")
    for bad in ("yesterday", "2001-01-01T00:00:00Z", "0d", "-5d"):
        from vigil.cli import main

        result = CliRunner().invoke(
            main, ["tokens", "create", "x", "--expires", bad], env={"VIGIL_DATABASE_URL": ledger}
        )
        assert result.exit_code == 2 and "--expires" in result.output, (bad, result.output)

    # A login's session ends when the token does.
    assert post_login(console, {"token": made["token"], "next": "/"}).status_code == 303
    assert scalar(ledger, "SELECT expires_at FROM console_sessions") == scalar(
        ledger, "SELECT LEAST(created_at + interval '1 hour', %s) FROM console_sessions", (expires,)
    )
    query(ledger, "UPDATE api_tokens SET expires_at = now() - interval '1 second' WHERE id = %s", (made["id"],))
    bearer = {"authorization": f"Bearer {made['token']}"}
    for answer in (console.get("/", headers=bearer), console.get("/")):
        assert answer.status_code == 401 and answer.json()["error"] == "token_expired"
    refused = post_login(console, {"token": made["token"], "next": "/"})
    assert refused.status_code == 401 and "expired" in refused.text
    server = start_ingest(stack, ledger, topics, ingest_auth_cache_s=0)
    try:
        answer = httpx.get(f"{server.url}/v1/users/u1/timers", headers=bearer)
        assert answer.status_code == 401 and answer.json()["error"] == "token_expired"
        fresh = {"authorization": f"Bearer {at['token']}"}
        assert httpx.get(f"{server.url}/v1/users/u1/timers", headers=fresh).status_code == 200
    finally:
        server.stop()


def test_a_flood_of_unknown_console_tokens_and_cookies_is_not_a_flood_of_queries(console, ledger):
    """Finding: every unknown console token and cookie cost a ledger query (ingest had a miss
    guard). The console now has ingest's guard (vigil.ttl_cache.MissGuard) for both."""
    token = logged_in(console, ledger)
    cookie = console.cookies["vigil_console"]
    guard = UnknownKeys("console", "token", "session")
    for _ in range(200):
        junk = {"authorization": f"Bearer vgl_{secrets.token_urlsafe(32)}"}
        assert console.get("/", headers=junk).status_code == 401
        console.cookies.set("vigil_console", secrets.token_urlsafe(32), domain="console.test")
        assert console.get("/").status_code == 401
    console.cookies.set("vigil_console", cookie, domain="console.test")
    assert console.get("/").status_code == 200  # a real session still works
    assert console.get("/", headers={"authorization": f"Bearer {token['token']}"}).status_code == 200
    guard.assert_guarded(200)


def test_a_made_up_equal_login_pair_is_refused(console, ledger):
    """Issue 58: the double-submit check took any equal pair the client made up (a cookie
    planted from a sibling subdomain beside the same value in a forged form). The pair is now
    issued and signed by the console."""
    token = create_token(ledger)
    for made_up in ("0" * 64, "1767225600." + "a" * 32 + "." + "b" * 64):
        console.cookies.set("vigil_console_login", made_up, domain="console.test", path="/login")
        answer = console.post("/login", data={"token": token["token"], "csrf": made_up})
        assert answer.status_code == 403 and "expired" in answer.text, made_up
    assert scalar(ledger, "SELECT count(*) FROM console_sessions") == 0
    console.cookies.clear()
    assert post_login(console, {"token": token["token"], "next": "/"}).status_code == 303


async def _call(app, method: str, path: str, headers: list[tuple[bytes, bytes]], chunks: list[dict]):
    """One request straight into the ASGI app: the scope and body a raw client would give."""
    sent: list[dict] = []
    scope = {
        "type": "http",
        "http_version": "1.1",
        "method": method,
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "headers": headers,
        "scheme": "http",
        "server": ("console.test", 80),
        "client": ("127.0.0.1", 5000),
        "root_path": "",
        "app": app,
    }
    queue = list(chunks)

    async def receive():
        return queue.pop(0) if queue else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    await app(scope, receive, send)
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], body


FORM = [(b"content-type", b"application/x-www-form-urlencoded"), (b"content-length", b"100")]


def test_a_client_that_hangs_up_mid_body_is_a_disconnect_not_a_500(console, caplog):
    """Issue 58: a login whose client went away mid-body (or that the console's own body
    timeout answered 408) logged a ClientDisconnect traceback and counted a 500."""
    import asyncio
    import json as json_

    app = console.app
    chunks = [{"type": "http.request", "body": b"token=vgl_", "more_body": True}, {"type": "http.disconnect"}]
    with caplog.at_level("DEBUG"):
        status, body = asyncio.run(_call(app, "POST", "/login", [(b"host", b"console.test"), *FORM], chunks))
    assert status == 400 and json_.loads(body)["error"] == "client_disconnected", body
    assert not [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")]


@pytest.mark.parametrize("hosts", [[], [b"console.test", b"evil.test"]])
def test_the_console_refuses_a_missing_or_doubled_host_as_ingest_does(console, hosts):
    import asyncio
    import json as json_

    headers = [(b"host", h) for h in hosts]
    status, body = asyncio.run(_call(console.app, "GET", "/healthz", headers, []))
    assert status == 400, body
    assert json_.loads(body)["error"] == "invalid_request" and json_.loads(body)["field"] == "Host"


def test_a_form_past_its_limits_and_a_wrong_method_have_their_own_codes(console):
    """Issue 58: the form-limit 400 and the 405 both said not_found."""
    too_many = console.post(
        "/login",
        content="&".join(f"f{i}=1" for i in range(1500)),
        headers={"content-type": "application/x-www-form-urlencoded"},
    )
    assert too_many.status_code == 400 and too_many.json()["error"] == "invalid_request", too_many.text
    wrong = console.get("/dead/events/retry")
    assert wrong.status_code == 405 and wrong.json()["error"] == "method_not_allowed", wrong.text
