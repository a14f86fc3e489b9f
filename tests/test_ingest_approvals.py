"""Approval answers through ingest: the cases of the source document's section 7 (a refund
approval with a deadline), plus an answer that arrived in time but was processed late.

Whichever of answer and expiry is stored first stands; the answer path checks the deadline
against the time the request *arrived*; the body says which answer stands, and the status
whether this one counted (200) or not (409: late, or another answer came first); the wake-up
event is on the topic afterwards.
"""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime, timedelta

import httpx
import psycopg
import pytest
from psycopg.rows import dict_row

from ingest_support import (
    APPROVAL_SECRET,
    USER,
    create_token,
    make_request,
    probed_ingest,
    read_events,
    start_ingest,
    stored,
)
from vigil.ledger import approvals


def run_expiry(dsn: str, request_id: str) -> str:
    """What the scheduler's expiry timer does at the deadline."""
    with psycopg.connect(dsn, row_factory=dict_row) as conn:
        return approvals.expire(conn, request_id, datetime.now(UTC), timedelta(hours=1)).answer


def now() -> datetime:
    return datetime.now(UTC)


@pytest.fixture
def ingest(stack, ledger, topics):
    with probed_ingest(stack, ledger, topics) as server:
        yield server


def answer(ingest, request_id: str, given: str, token: str) -> httpx.Response:
    return httpx.post(f"{ingest.url}/v1/approvals/{request_id}", json={"answer": given, "token": token}, timeout=30)


def not_counted(response: httpx.Response) -> dict:
    """A 409's body: the refusal's error and detail, and the answer's body as a 200 has it."""
    assert response.status_code == 409, response.text
    body = response.json()
    assert isinstance(body.pop("error"), str) and isinstance(body.pop("detail"), str), body
    return body


def test_expiry_stored_first_then_yes_gives_expired(ingest, ledger):
    token = make_request(ledger, "r-expired-first", now() - timedelta(hours=1))
    assert run_expiry(ledger, "r-expired-first") == "expired"
    response = answer(ingest, "r-expired-first", "yes", token)
    assert not_counted(response) == {"request_id": "r-expired-first", "answer": "expired", "given": "yes"}
    assert response.json()["error"] == "expired"
    assert stored(ledger, "r-expired-first")["answer"] == "expired"


def test_yes_after_the_deadline_before_any_scheduler_ran_gives_expired(ingest, ledger, stack, topics):
    token = make_request(ledger, "r-late", now() - timedelta(seconds=1))
    response = answer(ingest, "r-late", "yes", token)
    assert not_counted(response) == {"request_id": "r-late", "answer": "expired", "given": "yes"}
    row = stored(ledger, "r-late")
    assert row["answer"] == "expired" and row["received_at"] is not None
    # The session still wakes, with the answer that stands.
    [wake] = read_events(stack.bootstrap, topics.events, 1, topics.partitions)
    assert (wake.user_id, wake.source, wake.source_id, wake.kind) == (USER, "approval", "r-late", "approval.answer")
    assert json.loads(wake.payload)["answer"] == "expired" and wake.session_id == "s-r-late"


def test_yes_then_no_gives_yes_and_a_later_expiry_changes_nothing(ingest, ledger, stack, topics):
    token = make_request(ledger, "r-twice", now() + timedelta(hours=4))
    first = answer(ingest, "r-twice", "yes", token)
    second = answer(ingest, "r-twice", "no", token)
    retry = answer(ingest, "r-twice", "yes", token)
    assert first.status_code == 200 and first.json() == {"request_id": "r-twice", "answer": "yes", "given": "yes"}
    assert not_counted(second) == {"request_id": "r-twice", "answer": "yes", "given": "no"}
    assert second.json()["error"] == "already_answered"
    assert retry.status_code == 200 and retry.json() == first.json()  # a retry of the answer that stands
    assert run_expiry(ledger, "r-twice") == "yes"
    assert stored(ledger, "r-twice")["answer"] == "yes"
    # Three wake-ups with one key: the ledger keeps one event (the worker's UNIQUE key).
    wakes = read_events(stack.bootstrap, topics.events, 3, topics.partitions)
    assert {(w.source, w.source_id) for w in wakes} == {("approval", "r-twice")}
    assert all(json.loads(w.payload)["answer"] == "yes" for w in wakes)


def test_answer_to_a_request_never_made_is_unknown(ingest, stack, topics):
    token = approvals.sign_token(secret=APPROVAL_SECRET, request_id="r-never", user_id=USER)
    response = answer(ingest, "r-never", "yes", token)
    assert response.status_code == 404
    assert response.json()["answer"] == "unknown" and response.json()["error"] == "unknown_request"
    assert read_events(stack.bootstrap, topics.events, 0, topics.partitions, settle=1.0) == []


def test_answer_received_before_the_deadline_but_processed_after_it_stands(stack, ledger, topics):
    deadline: dict[str, datetime] = {}

    async def slow_step(_request):
        # The request has been stamped on arrival; hold it until the deadline has passed.
        while now() < deadline["due"] + timedelta(milliseconds=300):
            await asyncio.sleep(0.05)

    server = start_ingest(stack, ledger, topics, before_answer=slow_step)
    try:
        due = deadline["due"] = now() + timedelta(seconds=1)
        token = make_request(ledger, "r-in-time", due)
        assert now() < due - timedelta(milliseconds=300), "the test machine is too slow for this timing"
        response = answer(server, "r-in-time", "yes", token)
    finally:
        server.stop()
    assert response.status_code == 200 and response.json()["answer"] == "yes"
    row = stored(ledger, "r-in-time")
    assert row["received_at"] < due < row["answered_at"], row
    assert row["answer"] == "yes"


def test_bad_token_is_403_and_stores_nothing(ingest, ledger, stack, topics):
    make_request(ledger, "r-guarded", now() + timedelta(hours=1))
    other_user = approvals.sign_token(secret=APPROVAL_SECRET, request_id="r-guarded", user_id="someone-else")
    other_secret = approvals.sign_token(secret="not-the-secret", request_id="r-guarded", user_id=USER)
    for token in (other_user, other_secret, "v1.garbage"):
        response = answer(ingest, "r-guarded", "yes", token)
        assert response.status_code == 403 and response.json()["error"] == "invalid_token"
    row = stored(ledger, "r-guarded")
    assert row["answer"] is None and row["received_at"] is None
    bad_answer = httpx.post(f"{ingest.url}/v1/approvals/r-guarded", json={"answer": "maybe", "token": other_user})
    assert bad_answer.status_code == 400 and bad_answer.json()["field"] == "answer"
    assert read_events(stack.bootstrap, topics.events, 0, topics.partitions, settle=1.0) == []


# -- answers where the person is: action URLs and chat replies ---------------------------


def actions_of(ingest, request_id: str, due: datetime) -> dict[str, str]:
    """The approve and deny URLs the question's delivery carries (as the worker signs them)."""
    made = approvals.answer_actions(
        secret=APPROVAL_SECRET, request_id=request_id, user_id=USER, due=due, base_url=ingest.url
    )
    return {action["id"]: action["url"] for action in made}


def test_an_action_url_answers_once_and_a_replay_is_refused(ingest, ledger, stack, topics):
    due = now() + timedelta(hours=1)
    make_request(ledger, "r-button", due)
    urls = actions_of(ingest, "r-button", due)
    first = httpx.post(urls["approve"], timeout=30)
    assert first.status_code == 200 and first.json() == {"request_id": "r-button", "answer": "yes", "given": "yes"}
    replay = httpx.post(urls["approve"], timeout=30)
    assert not_counted(replay) == {"request_id": "r-button", "answer": "yes", "given": "yes"}
    assert replay.json()["error"] == "already_used"
    other = httpx.post(urls["deny"], timeout=30)  # the other button: the request has its answer
    assert other.status_code == 409 and other.json()["error"] == "already_used"
    row = stored(ledger, "r-button")
    assert (row["answer"], row["answered_via"]) == ("yes", "action")
    wakes = read_events(stack.bootstrap, topics.events, 3, topics.partitions)
    assert {(w.source_id, json.loads(w.payload)["answer"]) for w in wakes} == {("r-button", "yes")}


def test_an_expired_action_url_is_refused_and_stores_nothing(ingest, ledger, stack, topics):
    due = now() - timedelta(seconds=2)
    make_request(ledger, "r-button-late", due)
    response = httpx.post(actions_of(ingest, "r-button-late", due)["approve"], timeout=30)
    assert response.status_code == 410, response.text
    body = response.json()
    assert (body["error"], body["request_id"], body["given"]) == ("expired", "r-button-late", "yes")
    assert stored(ledger, "r-button-late")["answer"] is None  # the expiry timer applies the policy
    assert read_events(stack.bootstrap, topics.events, 0, topics.partitions, settle=1.0) == []


def test_a_forged_action_url_is_refused_and_stores_nothing(ingest, ledger, stack, topics):
    due = now() + timedelta(hours=1)
    token = make_request(ledger, "r-button-forged", due)
    deny = actions_of(ingest, "r-button-forged", due)["deny"]
    forged = [
        deny.replace("/actions/no?", "/actions/yes?"),  # the deny signature on the approve path
        deny.split("&signature=")[0] + "&signature=" + token,  # the answer token is not an action's
        deny.replace(f"expires={int(due.timestamp())}", f"expires={int(due.timestamp()) + 3600}"),  # extended
        deny.split("&signature=")[0],  # no signature
    ]
    for url in forged:
        response = httpx.post(url, timeout=30)
        assert response.status_code == 403 and response.json()["error"] == "invalid_signature", (url, response.text)
    other_secret = approvals.answer_actions(
        secret="not-the-secret", request_id="r-button-forged", user_id=USER, due=due, base_url=ingest.url
    )
    assert httpx.post(other_secret[0]["url"], timeout=30).status_code == 403
    unknown = actions_of(ingest, "r-never-asked", due)["approve"]
    assert httpx.post(unknown, timeout=30).status_code == 404
    assert stored(ledger, "r-button-forged")["answer"] is None
    assert read_events(stack.bootstrap, topics.events, 0, topics.partitions, settle=1.0) == []


@pytest.mark.parametrize("odd", ["\u2461", "\u00b2", "\u2460", "\u2075", "\u1369", "1796528169\u00b2", "9" * 20, "-1"])
def test_an_action_url_with_odd_digits_in_expires_is_403_not_500(ingest, odd):
    # Issue 58: str.isdigit() let "②" through to int(), a 500 with tracebacks and no token needed.
    response = httpx.post(
        f"{ingest.url}/v1/approvals/r-odd/actions/no", params={"expires": odd, "signature": "v1.AAAA"}, timeout=30
    )
    assert response.status_code == 403, response.text
    assert response.json()["error"] == "invalid_signature"


def delivered_question(dsn: str, request_id: str) -> str:
    """The question's delivery as the dispatcher fixed it, with the actions that name its
    request: its id, which a reply names."""
    actions = [{"id": a, "answer": w, "request_id": request_id} for a, w in (("approve", "yes"), ("deny", "no"))]
    with psycopg.connect(dsn) as conn:
        return str(
            conn.execute(
                "INSERT INTO outbox (user_id, run_id, epoch, body, status, delivery_id, fixed_at, delivered_at,"
                " session_id, urgent, actions) VALUES (%s, 1, 1, 'Approval needed', 'delivered', gen_random_uuid(),"
                " now(), now(), %s, true, %s) RETURNING delivery_id",
                (USER, f"s-{request_id}", json.dumps(actions)),
            ).fetchone()[0]
        )


def with_session(dsn: str, request_id: str) -> str:
    """The saved session the request waits in (a reply may name it instead of the delivery)."""
    with psycopg.connect(dsn) as conn:
        conn.execute("INSERT INTO sessions (user_id, id) VALUES (%s, %s)", (USER, f"s-{request_id}"))
    return f"s-{request_id}"


@pytest.fixture
def chat(ingest, ledger):
    token = create_token(ledger)["token"]
    with httpx.Client(base_url=ingest.url, headers={"Authorization": f"Bearer {token}"}, timeout=30) as client:
        yield client


@pytest.mark.parametrize(
    ("text", "given"), [("Yes!", "yes"), ("はい。", "yes"), ("  no thanks ", None), ("いいえ", "no")]
)
def test_a_clear_chat_reply_to_the_question_answers_it(chat, ledger, stack, topics, text, given):
    make_request(ledger, "r-chat", now() + timedelta(hours=1))
    delivery = delivered_question(ledger, "r-chat")
    response = chat.post(f"/v1/users/{USER}/messages", json={"text": text, "in_reply_to": delivery})
    assert response.status_code == 202, response.text
    [event] = read_events(stack.bootstrap, topics.events, 1, topics.partitions)
    row = stored(ledger, "r-chat")
    if given is None:  # unclear: a message to the agent, the approval still open
        assert (event.source, event.session_id, json.loads(event.payload)) == ("chat", "s-r-chat", {"text": text})
        assert row["answer"] is None
        return
    assert response.json()["answer"] == given and response.json()["session_id"] == "s-r-chat"
    assert (row["answer"], row["answered_via"]) == (given, "chat")
    assert (event.source, event.kind, event.session_id) == ("approval", "approval.answer", "s-r-chat")
    assert json.loads(event.payload)["answer"] == given


def test_a_chat_reply_after_the_deadline_is_told_expired(chat, ledger, stack, topics):
    make_request(ledger, "r-chat-late", now() - timedelta(seconds=1))
    delivery = delivered_question(ledger, "r-chat-late")
    response = chat.post(f"/v1/users/{USER}/messages", json={"text": "yes", "in_reply_to": delivery})
    assert not_counted(response)["answer"] == "expired" and response.json()["error"] == "expired"
    assert stored(ledger, "r-chat-late")["answered_via"] == "chat"
    events = read_events(stack.bootstrap, topics.events, 1, topics.partitions, settle=1.0)
    assert {e.source for e in events} == {"approval"}, "the late yes was also run as a chat turn"


@pytest.mark.parametrize("naming", ["in_reply_to", "session_id"])
@pytest.mark.parametrize(("first", "text", "given"), [("yes", "No.", "no"), ("no", "Yes!", "yes")])
def test_a_second_chat_answer_is_told_the_answer_that_stands_and_is_not_run(
    chat, ledger, stack, topics, naming, first, text, given
):
    # Issue 58: a "no" after the question was answered yes was a 202 ordinary message, run
    # as a new turn in the question's session; the API and the links answer 409. Either order.
    token = make_request(ledger, "r-twice", now() + timedelta(hours=1))
    delivery, session = delivered_question(ledger, "r-twice"), with_session(ledger, "r-twice")
    assert answer_status(chat, "r-twice", first, token) == 200
    named = {"in_reply_to": delivery} if naming == "in_reply_to" else {"session_id": session}
    response = chat.post(f"/v1/users/{USER}/messages", json={"text": text, **named})
    assert not_counted(response) == {
        "request_id": "r-twice",
        "answer": first,
        "given": given,
        "accepted": 1,
        "source_id": response.json()["source_id"],
        "session_id": session,
    }
    assert response.json()["error"] == "already_answered"
    assert stored(ledger, "r-twice")["answer"] == first
    events = read_events(stack.bootstrap, topics.events, 2, topics.partitions, settle=1.0)
    assert {e.source for e in events} == {"approval"}, f"the late {given} was also run as a chat turn"


@pytest.mark.parametrize("naming", ["in_reply_to", "session_id"])
def test_the_same_chat_answer_twice_is_a_retry_and_is_not_run(chat, ledger, stack, topics, naming):
    """The answer that stands, given again (a person who sends "yes" twice): the API's retry,
    202 with that answer, the first answer's record unchanged, and no chat turn."""
    make_request(ledger, "r-again", now() + timedelta(hours=1))
    delivery, session = delivered_question(ledger, "r-again"), with_session(ledger, "r-again")
    named = {"in_reply_to": delivery} if naming == "in_reply_to" else {"session_id": session}
    answers = [chat.post(f"/v1/users/{USER}/messages", json={"text": text, **named}) for text in ("yes", "Yes!")]
    for response in answers:
        assert response.status_code == 202, response.text
        assert (response.json()["request_id"], response.json()["answer"], response.json()["given"]) == (
            "r-again",
            "yes",
            "yes",
        )
    assert answers[0].json()["source_id"] != answers[1].json()["source_id"]
    row = stored(ledger, "r-again")
    assert (row["answer"], row["answered_via"]) == ("yes", "chat")
    events = read_events(stack.bootstrap, topics.events, 2, topics.partitions, settle=1.0)
    assert {e.source for e in events} == {"approval"}, "the repeated yes was also run as a chat turn"


def test_a_chat_yes_after_the_expiry_was_stored_is_told_expired_and_is_not_run(chat, ledger, stack, topics):
    make_request(ledger, "r-gone", now() - timedelta(minutes=5))
    delivery = delivered_question(ledger, "r-gone")
    assert run_expiry(ledger, "r-gone") == "expired"
    response = chat.post(f"/v1/users/{USER}/messages", json={"text": "yes", "in_reply_to": delivery})
    assert response.status_code == 409 and response.json()["error"] == "expired", response.text
    assert (response.json()["answer"], response.json()["given"]) == ("expired", "yes")
    events = read_events(stack.bootstrap, topics.events, 1, topics.partitions, settle=1.0)
    assert {e.source for e in events} == {"approval"}, "the late yes was also run as a chat turn"


def test_a_yes_to_a_later_message_of_the_session_is_an_ordinary_message(chat, ledger, stack, topics):
    """Only a reply to the question is an answer: once the agent wrote again, "yes" replies
    to that, and reaches the agent."""
    token = make_request(ledger, "r-then", now() + timedelta(hours=1))
    delivered_question(ledger, "r-then")
    session = with_session(ledger, "r-then")
    assert answer_status(chat, "r-then", "yes", token) == 200
    with psycopg.connect(ledger) as conn:
        conn.execute(
            "INSERT INTO outbox (user_id, run_id, epoch, body, session_id) VALUES (%s, 1, 1, 'Refunded. More?', %s)",
            (USER, session),
        )
    response = chat.post(f"/v1/users/{USER}/messages", json={"text": "yes", "session_id": session})
    assert response.status_code == 202, response.text
    events = read_events(stack.bootstrap, topics.events, 2, topics.partitions, settle=1.0)
    assert sorted(e.source for e in events) == ["approval", "chat"]


def answer_status(client: httpx.Client, request_id: str, given: str, token: str) -> int:
    return client.post(f"/v1/approvals/{request_id}", json={"answer": given, "token": token}).status_code


def test_a_flood_of_made_up_approval_ids_is_not_a_flood_of_queries(ingest, ledger):
    """Issue 46: the answer route needs no API token, and every unknown approval id cost a
    ledger query. Past a budget a second, ids are checked against the set of answerable
    requests (one query a second); a real request is still answered."""
    import secrets

    from support import UnknownKeys

    token = make_request(ledger, "r-real", now() + timedelta(minutes=10))
    guard = UnknownKeys("ingest", "approval")
    with httpx.Client(base_url=ingest.url, timeout=30) as client:
        for _ in range(300):
            made_up = secrets.token_hex(16)
            response = client.post(f"/v1/approvals/{made_up}", json={"answer": "yes", "token": "v1." + "a" * 43})
            assert response.status_code == 404 and response.json()["answer"] == "unknown"
    assert answer(ingest, "r-real", "yes", token).status_code == 200
    guard.assert_guarded(300)
