"""Issue 16: a bounded fuzz of the HTTP API. Every operation in the committed OpenAPI
document (``services/vigil/ingest/openapi.json``) is called with generated path ids (any
Unicode, raw percent-escapes, NUL, lone surrogates), query strings, headers and bodies
(well-formed envelopes with hostile values, arbitrary JSON, JSON text with \\u escapes no
encoder would write, non-JSON bytes). The server must never answer 5xx, every refusal must
be the JSON error shape, and nothing may be produced or stored beyond what 2xx answers
acknowledged. Hypothesis keeps it to a fixed number of examples (well under a minute).

Issue 46 added numbers of any shape (huge, ², ①, 5,000 digits, 1e-400) to the timers API's
fields and query strings and to the instants, raw bytes to the providers' headers, and the
console's routes (path ids and query values of those shapes, before and after authentication)."""

from __future__ import annotations

import hashlib
import hmac
import json
import re
from pathlib import Path
from urllib.parse import quote

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ingest_support import cli, create_token, ledger_count, probed_ingest, read_events

OPENAPI = json.loads((Path(__file__).parent.parent / "services/vigil/ingest/openapi.json").read_text())
OPERATIONS = sorted(
    (method.upper(), path)
    for path, operations in OPENAPI["paths"].items()
    for method in operations
    if path.startswith("/v1/")
)
EXAMPLES = 500  # about 25 s on a 2-core machine
STRIPE_SECRET = "whsec_" + "f" * 32

texts = st.one_of(
    st.sampled_from(["u1", "alice", "team-a/bob", "", " ", "x" * 300, "é", "日本"]),
    st.text(max_size=40),
    st.text(alphabet=st.characters(codec="utf-8", categories=["Cc", "Zl", "Zs", "So"]), max_size=5),
)
# Path segments as a client could send them: quoted text, or raw escapes of any bytes.
segments = st.one_of(
    texts.map(lambda t: quote(t, safe="")),
    st.binary(min_size=1, max_size=8).map(lambda b: "".join(f"%{byte:02X}" for byte in b)),
    st.sampled_from(
        ["%00", "a%00b", "%ED%A0%80", "%FF", "%0A", "..", "%2F", "team-a%2Fbob", "a%252Fb", "%25", "%2F%2F"]
    ),
)
json_values = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(min_value=-(2**70), max_value=2**70),
        st.floats(allow_nan=False, allow_infinity=False),
        texts,
    ),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(texts, inner, max_size=4)),
    max_leaves=12,
)
# Numbers of any shape (issue 46): huge, negative, fractional, and strings of digits that
# str.isdigit() and int() disagree on (², ①, Arabic-Indic), or that int() refuses (5,000 of them).
huge_integers = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.integers(min_value=-(10**400), max_value=10**400),
    st.sampled_from([253_402_300_799, 253_402_300_800, -62_135_596_801, 1_767_225_600_000]),
)
digit_strings = st.one_of(
    huge_integers.map(str),
    st.text(alphabet="0123456789²³¹①١٢٣٠٫.-+_ e", min_size=1, max_size=12),
    st.sampled_from(["9" * 310, "9" * 5000, "1" * 309 + ".5", "²", "①", "١٢", " 5", "1_0", "0x10"]),
)
instants = st.one_of(
    st.datetimes(timezones=st.timezones()).map(lambda d: d.isoformat()),
    st.sampled_from(["9999-12-31T23:59:59-23:59", "0001-01-01T00:00:00+00:01", "2026-01-01T00:00:00", "x"]),
    st.sampled_from(["2026-01-05T09:00Z", "20260105T090000Z", "2026-01-05T09:00:00+05:99", "2026-02-30T00:00:00Z"]),
    huge_integers,
    st.floats(allow_nan=False, allow_infinity=False),
    digit_strings,
    st.booleans(),
)
envelopes = st.fixed_dictionaries(
    {"user_id": texts, "source": texts, "source_id": texts, "kind": texts},
    optional={
        "payload": json_values,
        "occurred_at": instants,
        "received_at": instants,
        "session_id": texts,
        "headers": st.dictionaries(texts, texts, max_size=3),
        "bogus": json_values,
    },
)
timers = st.fixed_dictionaries(
    {"id": texts},
    optional={
        "due": st.one_of(st.integers(min_value=-(2**40), max_value=2**40), instants, digit_strings),
        "every": st.one_of(st.integers(min_value=-5, max_value=2**33), st.floats(allow_nan=False)),
        "cron": st.sampled_from(["* * * * *", "0 9 * * 1", "61 * * * *", "x"]),
        "tz": st.sampled_from(["UTC", "Asia/Tokyo", "Mars/Olympus", ""]),
        "catch_up": st.sampled_from(["coalesce", "each", "skip", "all"]),
        "max_lateness": st.integers(min_value=-1, max_value=2**33),
        "payload": json_values,
    },
)
documents = st.one_of(
    envelopes,
    st.fixed_dictionaries({"events": st.lists(envelopes, max_size=3)}),
    timers,
    st.fixed_dictionaries({"text": texts}),
    st.fixed_dictionaries({"answer": st.sampled_from(["yes", "no", "maybe"]), "token": texts}),
    json_values,
)


def encoded(document) -> bytes:
    return json.dumps(document, ensure_ascii=False).encode("utf-8", errors="surrogatepass")


# JSON text an encoder would never write: lone surrogates and NUL as escapes, huge numbers.
hostile_texts = st.sampled_from(
    [
        '{"user_id":"u1","source":"s","source_id":"1","kind":"k","payload":{"\\ud800":1}}',
        '{"text":"\\udfff"}',
        '{"text":"a\\u0000b"}',
        '{"id":"t1","due":2000000000,"payload":{"x":1e999}}',
        '{"id":"t1","every":' + "9" * 400 + "}",
        '{"id":"t1","due":' + "9" * 350 + "}",
        '{"id":"t1","due":' + "9" * 5000 + "}",
        '{"id":"t1","due":"' + "9" * 310 + '"}',
        '{"id":"t1","due":2000000000,"payload":{"x":1e-400}}',
        '{"user_id":"u1","source":"s","source_id":"1","kind":"k","occurred_at":253402300800}',
        '{"user_id":"u1","source":"s","source_id":"1","kind":"k","payload":[' + "1" * 1500 + "]}",
        '{"id":"evt_1","type":"invoice.paid","created":"\u00b2"}',
        '{"id":"evt_1","type":"invoice.paid","created":1.5e9}',
        '{"events":[{"user_id":"u1","source":"s","source_id":"1","kind":"k"},{"user_id":"\\ud800"}]}',
        "[" * 5000,
        "{}",
        "",
    ]
).map(str.encode)
bodies = st.one_of(documents.map(encoded), hostile_texts, st.binary(max_size=64))
content_types = st.sampled_from(
    ["application/json", "application/json", "application/vnd.x+json", "text/plain", "", "application/json; x=1"]
)


@pytest.fixture
def target(stack, ledger, topics):
    with probed_ingest(stack, ledger, topics, max_timers_per_user=20) as server:
        token = create_token(ledger)["token"]
        scoped = json.loads(cli(ledger, "tokens", "create", "s", "--scope", "events", "--users", "u*", "--json"))
        github = json.loads(cli(ledger, "hooks", "add", "--provider", "github", "--user", "u1", "--json"))
        stripe = json.loads(
            cli(
                ledger,
                "hooks",
                "add",
                "--provider",
                "stripe",
                "--user",
                "u1",
                "--secret-stdin",
                "--json",
                input=STRIPE_SECRET + "\n",
            )
        )
        hooks = {"github": (github["id"], github["secret"]), "stripe": (stripe["id"], STRIPE_SECRET)}
        seen = {"events": 0, "timers": 0}
        with httpx.Client(base_url=server.url, timeout=30) as client:
            yield client, token, scoped["token"], hooks, seen
    produced = read_events(stack.bootstrap, topics.events, seen["events"], topics.partitions, settle=1.0)
    assert len(produced) == seen["events"], "a refused request produced, or an acknowledged one did not"
    assert ledger_count(ledger, "SELECT count(*) FROM timers") == seen["timers"], "a refused request stored a timer"


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    operation=st.sampled_from(OPERATIONS),
    ids=st.lists(segments, min_size=2, max_size=2),
    query=st.one_of(
        st.just(""),
        st.text(max_size=20).map(lambda t: "?after=" + quote(t)),
        segments.map("?x=".__add__),
        digit_strings.map(lambda t: "?limit=" + quote(t)),
        instants.map(lambda t: "?before=" + quote(str(t))),
    ),
    body=bodies,
    content_type=content_types,
    auth=st.sampled_from(["token", "scoped", "junk", "none"]),
    real_hook=st.sampled_from([None, "github", "stripe"]),
    sign=st.booleans(),  # a valid GitHub signature over the body, so its headers are read
    key=st.one_of(st.none(), st.binary(min_size=1, max_size=20)),
    # Provider headers as raw bytes: UTF-8, invalid UTF-8, latin-1 digits (b"\xb2" reads "²").
    provider_headers=st.dictionaries(
        st.sampled_from([b"x-github-delivery", b"x-github-event", b"webhook-id", b"webhook-timestamp"]),
        st.one_of(st.binary(min_size=1, max_size=12), st.sampled_from(["café-1".encode(), b"caf\xe9", b"\xb2"])),
        max_size=3,
    ),
    stripe_stamp=st.one_of(st.none(), st.binary(min_size=1, max_size=6), digit_strings.map(str.encode)),
)
def test_no_request_is_a_500_and_refusals_store_nothing(
    target, operation, ids, query, body, content_type, auth, real_hook, sign, key, provider_headers, stripe_stamp
):
    client, token, scoped, hooks, seen = target
    method, template = operation
    names = re.findall(r"{(\w+)}", template)
    values = dict(zip(names, ids, strict=False))
    if "hook_id" in values and real_hook:
        values["hook_id"] = hooks[real_hook][0]
    path = template
    for name, value in values.items():
        path = path.replace("{" + name + "}", value)
    headers: dict[bytes, bytes] = {b"content-type": content_type.encode()}
    if auth != "none":
        bearer = {"token": token, "scoped": scoped, "junk": "vgl_nope"}[auth]
        headers[b"authorization"] = f"Bearer {bearer}".encode()
    if key is not None:
        headers[b"idempotency-key"] = key.replace(b"\r", b"").replace(b"\n", b"") or b"k"
    if real_hook:
        digest = hmac.new(hooks["github"][1].encode(), body, hashlib.sha256).hexdigest() if sign else "00"
        headers[b"x-hub-signature-256"] = b"sha256=" + digest.encode()
    headers.update(
        {name: value.replace(b"\r", b"").replace(b"\n", b"") or b"x" for name, value in provider_headers.items()}
    )
    if stripe_stamp is not None:
        headers[b"stripe-signature"] = b"t=" + stripe_stamp.replace(b"\r", b"").replace(b"\n", b"") + b",v1=00"
    try:
        response = client.request(method, path + query, content=body if method != "GET" else None, headers=headers)
    except httpx.LocalProtocolError:
        return  # a request httpx itself will not send (an illegal header byte)
    status = response.status_code
    assert status < 500, (method, path, query, body[:200], response.text[:500])
    if status >= 400:
        shown = response.json()
        assert isinstance(shown.get("error"), str) and isinstance(shown.get("detail"), str), shown
    elif method == "POST" and template == "/v1/users/{user_id}/timers" and status == 201:
        seen["timers"] += 1
    elif status == 202:
        seen["events"] += response.json()["accepted"]


# Issue 46: the timers API's numbers, always with a valid token and user, so every example
# reaches the parsers (the operation-wide fuzz above rarely does).
number_literals = st.one_of(
    huge_integers.map(str),
    st.floats(allow_nan=False, allow_infinity=False).map(repr),
    digit_strings.map(json.dumps),
    instants.map(json.dumps),
    st.sampled_from(["9" * 5000, "-" + "9" * 5000, "1e-400", "1" + "0" * 1500 + ".5", "true", "null", "[]", '"①"']),
)
INTERNALS = ("int_max_str_digits", "Exceeds the limit", "invalid literal", "ValueError", "Traceback", "float(")


# A few hundred examples against a real server or ledger: well under a minute each.
three_hundred = settings(
    max_examples=300,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@three_hundred
@given(
    field=st.sampled_from(["due", "every", "max_lateness", "limit", "tasks_limit", "before"]),
    literal=number_literals,
)
def test_timers_api_numbers_of_any_shape_are_a_400_in_neutral_words_or_accepted(target, field, literal):
    client, token, _, _, seen = target
    auth = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
    if field in ("due", "every", "max_lateness"):
        other = "" if field == "due" else ',"due":2000000000'
        text = f'{{"id":"t1","{field}":{literal}{other}}}'
        response = client.post("/v1/users/u1/timers", content=text.encode(), headers=auth)
    else:
        value = json.loads(literal) if literal not in ("9" * 5000, "-" + "9" * 5000) else literal
        value = literal if isinstance(value, (list, type(None))) else str(value)
        path, name = {
            "limit": ("/v1/users/u1/timers", "limit"),
            "tasks_limit": ("/v1/users/u1/tasks", "limit"),
            "before": ("/v1/users/u1/tasks", "before"),
        }[field]
        response = client.get(path, params={name: value}, headers=auth)
    assert response.status_code < 500, (field, literal[:80], response.text[:300])
    if response.status_code >= 400:
        shown = response.json()
        assert isinstance(shown.get("detail"), str) and shown.get("field") in (field.removeprefix("tasks_"), "body")
        assert not any(word in shown["detail"] for word in INTERNALS) and len(shown["detail"]) < 300, shown
    elif response.status_code == 201:
        seen["timers"] += 1


# Issue 46: the console's routes. Path ids and query values of any shape (5,000 digits, ²,
# ①, NUL, raw escapes), before and after authentication: never a 500, and every refusal
# the JSON error shape (the pages are HTML).
CONSOLE_ROUTES = [
    ("GET", "/users/{}", "before"),
    ("GET", "/events/{}", None),
    ("GET", "/runs/{}", None),
    ("GET", "/deliveries/{}", None),
    ("GET", "/search", "q"),
    ("GET", "/search?kind=run", "q"),
    ("GET", "/search?kind=event", "q"),
    ("GET", "/search?q=alice", "user"),
    ("GET", "/dead", "events_before"),
    ("GET", "/dead", "outbox_before"),
    ("GET", "/approvals", "after"),
    ("GET", "/timers", "after"),
    ("GET", "/", None),
    ("POST", "/dead/events/retry", "event_id"),
    ("POST", "/deliveries/{}/revive", None),
    ("POST", "/login", "token"),
    ("POST", "/logout", "csrf"),
]
console_values = st.one_of(
    texts,
    digit_strings,
    st.sampled_from(["\x00", "a\x00b", "²", "①", "9" * 5000, "9" * 20, "0", '["2026-01-01T00:00:00Z", 9e99]']),
    huge_integers.map(lambda n: json.dumps(["2026-01-01T00:00:00+00:00", n])),
    st.tuples(instants.map(str), texts, digit_strings).map(lambda t: json.dumps(list(t))),
    st.tuples(instants.map(str), huge_integers, huge_integers).map(lambda t: "~".join(map(str, t))),
)


@pytest.fixture
def console_target(ledger):
    from starlette.testclient import TestClient

    from console_support import seed_user
    from test_console_pages import post_login
    from vigil.console.app import create_app
    from vigil.console.settings import ConsoleSettings

    seed_user(ledger)
    token = create_token(ledger)["token"]
    app = create_app(ConsoleSettings(database_url=ledger, console_auth_cache_s=0))
    with TestClient(app, base_url="http://console.test", follow_redirects=False) as client:
        assert post_login(client, {"token": token, "next": "/"}).status_code == 303
        session = client.cookies["vigil_console"]
        client.cookies.clear()  # sent only when an example asks for it
        yield client, token, session


@three_hundred
@given(
    route=st.sampled_from(CONSOLE_ROUTES),
    segment=st.one_of(segments, digit_strings.map(lambda t: quote(t, safe=""))),
    value=console_values,
    auth=st.sampled_from(["token", "session", "junk", "none"]),
)
def test_console_routes_never_answer_500(console_target, route, segment, value, auth):
    client, token, session = console_target
    method, template, name = route
    path = template.replace("{}", segment)
    headers = {
        "token": {"authorization": f"Bearer {token}"},
        "session": {"cookie": f"vigil_console={session}"},
        "junk": {"authorization": "Bearer vgl_nope"},
        "none": {},
    }[auth]
    if method == "POST":
        data = {name: value} if name else {}
        response = client.post(path, data=data, headers=headers)
    else:
        params = {name: value} if name else None
        response = client.get(path, params=params, headers=headers)
    assert response.status_code < 500, (method, path, name, value[:80], response.text[:300])
    if response.status_code >= 400 and path != "/login":  # a refused login is its form again
        shown = response.json()
        assert isinstance(shown.get("error"), str) and isinstance(shown.get("detail"), str), shown
        assert not any(word in shown["detail"] for word in INTERNALS) and len(shown["detail"]) < 300, shown


# Issue 58: the approval action URL (no token: the signature is the capability). Its
# `expires` went to int(): "②" was a 500 with two tracebacks per request, for anyone.
@three_hundred
@given(
    request_id=segments,
    word=st.sampled_from(["yes", "no", "maybe", "YES", "%79es"]),
    expires=st.one_of(digit_strings, instants.map(str), st.just("")),
    signature=st.one_of(texts, st.just("v1.AAAA"), st.text(alphabet="v1.AZaz09-_=", max_size=60)),
)
def test_the_action_route_never_answers_500_whatever_its_query(target, request_id, word, expires, signature):
    client = target[0]
    response = client.post(
        f"/v1/approvals/{request_id}/actions/{word}", params={"expires": expires, "signature": signature}
    )
    assert response.status_code < 500, (request_id, word, expires[:80], response.text[:300])
    assert 400 <= response.status_code < 500, response.text  # nothing was ever asked: nothing to answer
    shown = response.json()
    assert isinstance(shown.get("error"), str) and isinstance(shown.get("detail"), str), shown
    assert not any(word in shown["detail"] for word in INTERNALS) and len(shown["detail"]) < 300, shown
