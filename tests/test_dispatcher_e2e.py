"""A whole run, end to end: a chat message in through ingest, recorded and answered by the
echo agent in a worker, the reply out through the dispatcher's webhook channel, signed.
Every piece is a real `vigil` process on the real broker and ledger."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from dispatcher_support import PASS_METRIC, Receiver, metric, standard_webhooks_valid
from ingest_support import cli, create_token
from support import query, scalar, wait_for
from worker_support import FAST


@pytest.mark.slow
def test_chat_message_in_through_ingest_reply_out_through_the_webhook(spawn, vigil_env, ledger):
    receiver = Receiver().start()
    try:
        user = "u-e2e-dispatch"
        secret = json.loads(cli(ledger, "channels", "set", user, "--type", "webhook", "--url", receiver.url, "--json"))[
            "secret"
        ]
        token = create_token(ledger)["token"]
        ports = {name: int(vigil_env[f"VIGIL_{name.upper()}_PORT"]) for name in ("worker", "ingest", "dispatcher")}
        spawn(["worker"], {**vigil_env, **FAST, "VIGIL_AGENT": "echo"}, name="worker").wait_healthy(ports["worker"])
        spawn(["ingest"], vigil_env, name="ingest").wait_healthy(ports["ingest"])
        env = {**vigil_env, "VIGIL_DISPATCHER_POLL_INTERVAL_S": "0.1"}
        spawn(["dispatcher"], env, name="dispatcher").wait_healthy(ports["dispatcher"])

        answer = httpx.post(
            f"http://127.0.0.1:{ports['ingest']}/v1/users/{user}/messages",
            json={"text": "hello vigil"},
            headers={"Authorization": f"Bearer {token}"},
            timeout=30,
        )
        assert answer.status_code == 202, answer.text
        wait_for(lambda: receiver.got(), 90, "the reply at the webhook receiver")
        (reply,) = receiver.got()
        assert standard_webhooks_valid(secret, reply)
        assert reply.user == user and reply.bodies == ["hello vigil"]
        row = query(
            ledger,
            "SELECT o.run_id, o.epoch, o.status, o.delivery_id::text AS d, r.event_ids"
            " FROM outbox o JOIN runs r ON r.id = o.run_id",
        )[0]
        assert (row["status"], row["d"]) == ("delivered", reply.id)
        assert reply.data["messages"][0]["run_id"] == row["run_id"]
        assert scalar(ledger, "SELECT kind FROM events WHERE id = %s", (row["event_ids"][0],)) == "chat.message"

        # A second message within the hour is answered at once but its reply waits the gap.
        httpx.post(
            f"http://127.0.0.1:{ports['ingest']}/v1/users/{user}/messages",
            json={"text": "are you there?"},
            headers={"Authorization": f"Bearer {token}"},
            timeout=30,
        ).raise_for_status()
        wait_for(lambda: scalar(ledger, "SELECT count(*) FROM outbox") == 2, 90, "the second reply in the outbox")
        moment = time.time()
        for _ in range(2):
            wait_for(
                lambda moment=moment: (metric(ports["dispatcher"], PASS_METRIC) or 0) > moment, 30, "a dispatcher pass"
            )
            moment = time.time()
        assert len(receiver.got()) == 1
        assert scalar(ledger, "SELECT status FROM outbox ORDER BY id DESC LIMIT 1") == "pending"
    finally:
        receiver.stop()
