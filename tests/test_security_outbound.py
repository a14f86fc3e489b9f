"""Issue 16, what leaves the system: approval tokens never in logs, log files 0600, and
outbound HTTP (webhook channels, the agent's http_request) held to an address policy on
the address a name resolves to, with no credentials in URLs and no unbounded answers."""

from __future__ import annotations

import asyncio
import io
import ipaddress
import json
import socket
import stat
import threading
import time
import uuid
from datetime import UTC, datetime

import pytest
from click.testing import CliRunner

from dispatcher_support import T0, Receiver, add_message, add_users, in_process_dispatcher, one_pass
from support import scalar
from vigil.agent.deferral import question_text
from vigil.agent.http_tool import HttpRequestTool
from vigil.agent.tools import CallContext
from vigil.cli import main
from vigil.clock import ManualClock
from vigil.dispatcher.channels import ChannelConfig, Delivery, Result, WebhookChannel, new_secret
from vigil.dispatcher.pacing import Row
from vigil.ledger.approvals import sign_token
from vigil.ledger.states import ChannelType
from vigil.outbound import AddressPolicy, parse_nets
from vigil_dev import devstack

LOOPBACK = AddressPolicy(parse_nets("127.0.0.0/8,::1/128"))


def test_log_channel_writes_approval_tokens_redacted(ledger):
    """Finding: approval answer tokens were written to the dispatcher's log (mode 0644), so
    anyone who could read the log could approve a refund."""
    pending = {"request_id": "req-1", "summary": "refund 1200", "due": "soon", "on_expiry": "deny"}
    body = question_text(pending, "lee", "the-secret")
    token = sign_token(secret="the-secret", request_id="req-1", user_id="lee")
    assert token in body
    out = io.StringIO()
    d = in_process_dispatcher(ledger, ManualClock(T0.timestamp()), log_stream=out)
    try:
        add_users(ledger, ["lee"])
        add_message(ledger, "lee", body, created_at=T0)
        one_pass(d)
    finally:
        d.close()
    line = out.getvalue()
    assert json.loads(line)["data"]["user_id"] == "lee"
    assert token not in line and token[3:20] not in line and "v1.[redacted]" in line
    # The operator who needs it reads the full message from the ledger.
    assert token in scalar(ledger, "SELECT body FROM outbox")


def test_service_log_files_are_0600(tmp_path):
    logfile = tmp_path / "logs" / "x.log"
    logfile.parent.mkdir()
    logfile.write_text("from an older stack\n")
    logfile.chmod(0o644)
    pid = devstack.spawn(["true"], logfile, tmp_path / "x.pid")
    assert pid > 0
    assert stat.S_IMODE(logfile.stat().st_mode) == 0o600


@pytest.mark.parametrize(
    "address, allowed",
    [
        ("127.0.0.1", False),
        ("10.1.2.3", False),
        ("192.168.0.1", False),
        ("172.16.5.4", False),
        ("169.254.169.254", False),  # the cloud metadata service
        ("100.64.0.1", False),  # shared address space
        ("0.0.0.0", False),
        ("::1", False),
        ("fd00:ec2::254", False),  # AWS's IPv6 metadata address
        ("fe80::1", False),
        ("::ffff:127.0.0.1", False),
        ("224.0.0.1", False),
        ("93.184.216.34", True),
        ("2606:2800:220:1:248:1893:25c8:1946", True),
    ],
)
def test_address_policy_refuses_every_non_public_range(address, allowed):
    assert AddressPolicy().permits(ipaddress.ip_address(address)) is allowed
    if address in ("127.0.0.1", "::1", "::ffff:127.0.0.1"):
        assert LOOPBACK.permits(ipaddress.ip_address(address))


# Issue 46: every forbidden IPv4 range (one address in each), and every IPv6 form that embeds
# an IPv4 address. The policy is called directly: nothing is sent to these addresses.
FORBIDDEN_V4 = {
    "this network 0/8": "0.1.2.3",
    "private 10/8": "10.1.2.3",
    "shared 100.64/10": "100.64.0.1",
    "loopback 127/8": "127.0.0.1",
    "link-local 169.254/16 (metadata)": "169.254.169.254",
    "private 172.16/12": "172.16.5.4",
    "IETF 192.0.0/24": "192.0.0.8",
    "TEST-NET-1 192.0.2/24": "192.0.2.1",
    "private 192.168/16": "192.168.0.1",
    "benchmarking 198.18/15": "198.18.0.1",
    "TEST-NET-2 198.51.100/24": "198.51.100.1",
    "TEST-NET-3 203.0.113/24": "203.0.113.1",
    "multicast 224/4": "224.0.0.1",
    "reserved 240/4": "240.0.0.1",
    "broadcast": "255.255.255.255",
}
PUBLIC_V4 = "93.184.216.34"


def _v4(text: str) -> int:
    return int(ipaddress.IPv4Address(text))


EMBEDDINGS = {
    "IPv4 itself": lambda v4: v4,
    "IPv4-mapped ::ffff:0:0/96": lambda v4: str(ipaddress.IPv6Address((0xFFFF << 32) | _v4(v4))),
    "IPv4-mapped, dotted": lambda v4: f"::ffff:{v4}",
    "IPv4-compatible ::/96": lambda v4: str(ipaddress.IPv6Address(_v4(v4))),
    "IPv4-compatible, dotted": lambda v4: f"::{v4}",
    "IPv4-translated ::ffff:0:0:0/96": lambda v4: str(ipaddress.IPv6Address((0xFFFF << 48) | _v4(v4))),
    "NAT64 64:ff9b::/96": lambda v4: str(ipaddress.IPv6Address((0x64FF9B << 96) | _v4(v4))),
    "NAT64, dotted": lambda v4: f"64:ff9b::{v4}",
    "6to4 2002::/16": lambda v4: str(ipaddress.IPv6Address((0x2002 << 112) | (_v4(v4) << 80) | 1)),
    # Teredo: server, then the client obfuscated (bit-inverted); both are judged.
    "Teredo 2001::/32, client": lambda v4: str(
        ipaddress.IPv6Address((0x20010000 << 96) | (_v4(PUBLIC_V4) << 64) | (_v4(v4) ^ 0xFFFFFFFF))
    ),
    "Teredo 2001::/32, server": lambda v4: str(
        ipaddress.IPv6Address((0x20010000 << 96) | (_v4(v4) << 64) | (_v4(PUBLIC_V4) ^ 0xFFFFFFFF))
    ),
}


@pytest.mark.parametrize("form", sorted(EMBEDDINGS))
@pytest.mark.parametrize("network", sorted(FORBIDDEN_V4))
def test_every_ipv6_form_of_a_forbidden_ipv4_address_is_refused(form, network):
    """Finding: NAT64 (64:ff9b::a9fe:a9fe), 6to4 (2002:a9fe:a9fe::), IPv4-compatible and
    IPv4-translated forms of 169.254.169.254 or 127.0.0.1 passed the policy. Each form is
    judged by the IPv4 address it carries."""
    address = ipaddress.ip_address(EMBEDDINGS[form](FORBIDDEN_V4[network]))
    assert AddressPolicy().permits(address) is False, address


@pytest.mark.parametrize("form", sorted(EMBEDDINGS))
def test_every_ipv6_form_of_a_public_ipv4_address_passes(form):
    """The normalisation refuses by meaning, not by shape: the same forms of a public
    address (as a NAT64 network's DNS64 hands out) still pass."""
    address = ipaddress.ip_address(EMBEDDINGS[form](PUBLIC_V4))
    assert AddressPolicy().permits(address) is True, address


@pytest.mark.parametrize("form", sorted(EMBEDDINGS))
def test_allowed_ipv4_networks_cover_their_ipv6_forms(form):
    address = ipaddress.ip_address(EMBEDDINGS[form]("127.0.0.1"))
    if form.startswith("Teredo"):
        return  # the other embedded address is public; loopback is not reachable via Teredo anyway
    assert LOOPBACK.permits(address) is True, address


@pytest.mark.parametrize(
    "address",
    [
        "fec0::1",  # deprecated site-local (RFC 3879), still routed inside some sites
        "feff:ffff::1",
        "64:ff9b:1::a9fe:a9fe",  # local-use NAT64 (RFC 8215): where the IPv4 sits depends on the site
        "64:ff9b:1:ffff::5db8:d822",
        "::",
        "::1",
        "2001:db8::1",  # documentation
        "100::1",  # discard-only
        "ff02::1",
        "fc00::1",
    ],
)
def test_ipv6_ranges_without_an_embedded_address_that_are_refused(address):
    """Finding: fec0::/10 passed (Python's is_global is True for it)."""
    assert AddressPolicy().permits(ipaddress.ip_address(address)) is False


def test_ipv6_literal_in_an_allowed_network_passes_whatever_it_embeds():
    """An operator who allows an IPv6 network means that network, forms and all."""
    policy = AddressPolicy(parse_nets("64:ff9b::/96"))
    assert policy.permits(ipaddress.ip_address("64:ff9b::a9fe:a9fe"))
    assert not AddressPolicy().permits(ipaddress.ip_address("64:ff9b::a9fe:a9fe"))


def delivery(url: str) -> Delivery:
    now = datetime.now(UTC)
    row = Row(1, "u1", 1, "hello", False, now, "sending", uuid.uuid4(), 0, None, now)
    config = ChannelConfig(ChannelType.WEBHOOK, url=url, secret=new_secret())
    return Delivery(row.delivery_id, "u1", (row,), 1, now, config)


def test_webhook_to_a_loopback_address_or_name_is_refused_unless_allowed():
    """Finding: channel URLs were not checked against loopback, private, link-local or
    metadata addresses. Checked on the resolved address: `localhost` is refused too."""
    receiver = Receiver().start()
    port = receiver.server.server_address[1]
    strict = WebhookChannel(5.0, 2)  # the default policy
    try:
        for url in (receiver.url, f"http://localhost:{port}/hook", f"http://[::ffff:127.0.0.1]:{port}/hook"):
            outcome = strict.send(delivery(url), datetime.now(UTC))
            assert outcome.result is Result.DEAD and "not a public address" in outcome.error, outcome
        assert receiver.got() == []
        allowed = WebhookChannel(5.0, 2, LOOPBACK)
        assert allowed.send(delivery(receiver.url), datetime.now(UTC)).result is Result.DELIVERED
        allowed.close()
        assert len(receiver.got()) == 1
    finally:
        strict.close()


def test_webhook_with_credentials_in_the_url_is_refused_and_never_shown(ledger):
    """Finding: a password in a URL was stored in the audit row and printed by channels show."""
    add_users(ledger, ["ana"])
    result = CliRunner().invoke(
        main,
        ["channels", "set", "ana", "--type", "webhook", "--url", "https://bob:hunter2@example.com/h"],
        env={"VIGIL_DATABASE_URL": ledger},
    )
    assert result.exit_code == 2 and "credentials" in result.output and "hunter2" not in result.output
    assert scalar(ledger, "SELECT count(*) FROM channels") == 0
    assert scalar(ledger, "SELECT count(*) FROM audit") == 0
    channel = WebhookChannel(5.0, 1, LOOPBACK)
    outcome = channel.send(delivery("http://bob:hunter2@127.0.0.1:1/h"), datetime.now(UTC))
    channel.close()
    assert outcome.result is Result.DEAD and "hunter2" not in outcome.error


def test_webhook_answer_body_is_never_read():
    """Finding: a 50 MB answer raised the dispatcher's memory by 51 MB, kept. At most 64 KiB
    of an answer are read now: a receiver announcing 50 MB and sending them slowly is
    delivered at once."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    stop = threading.Event()

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 50000000\r\n\r\n" + b"x" * 1_000_000)
            stop.wait(20)  # the other 49 MB never come

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    channel = WebhookChannel(10.0, 1, LOOPBACK)
    try:
        started = time.monotonic()
        outcome = channel.send(delivery(f"http://127.0.0.1:{port}/h"), datetime.now(UTC))
        assert outcome.result is Result.DELIVERED
        assert time.monotonic() - started < 5
    finally:
        stop.set()
        channel.close()
        listener.close()


def test_http_request_tool_checks_the_address_an_allowed_name_resolves_to():
    """Finding: http_request allowed an exact host list but did not check the address a name
    resolves to (an allowed name pointing at 127.0.0.1 reached the host itself)."""
    tool = HttpRequestTool(("localhost",), {}, 5.0, 10_000)
    call = CallContext("u1", "toolu_1", "key-1")
    output = asyncio.run(tool.run({"method": "GET", "url": "http://localhost:9/x"}, call))
    assert output.is_error and "Not sent" in output.text and "not a public address" in output.text
