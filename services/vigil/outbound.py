"""Where vigil's outbound HTTP may go: the dispatcher's webhooks and the agent's ``http_request``.

A channel URL is set by an operator and a tool URL chosen by a model, so either may name
an address inside the network vigil runs in: the cloud metadata service (169.254.169.254,
which hands out credentials), a database port on a private subnet, the host itself. Every
address that is not globally routable is refused unless ``VIGIL_OUTBOUND_ALLOWED_NETS``
lists its network.

The check runs on the address a name *resolves to*, at connect time, and the connection is
made to that checked address (the TLS server name stays the URL's host): a name that
resolves to a public address when the URL is set and to 127.0.0.1 when it is used (DNS
rebinding) is refused too. URLs with credentials in them (``https://user:pass@host``) are
refused before anything is sent: they would be stored, logged and shown.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Iterable
from typing import Any
from urllib.parse import urlsplit

import httpcore
import httpx

from vigil.settings import CommonSettings, parse_networks

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
Address = ipaddress.IPv4Address | ipaddress.IPv6Address


class BlockedAddress(httpcore.ConnectError):
    """The target resolved to an address the policy refuses (an httpx ``ConnectError``)."""


def parse_nets(text: str) -> tuple[Network, ...]:
    """``"127.0.0.0/8, ::1/128"`` -> networks (the parser of ``VIGIL_OUTBOUND_ALLOWED_NETS``)."""
    return parse_networks(text)


def url_problem(url: str) -> str | None:
    """Why ``url`` may not be used for outbound HTTP before any address is looked at, or None."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError for a bad port
    except ValueError as exc:
        return f"the URL is not valid ({exc})"
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return "expected an http(s) URL with a host"
    if parts.username is not None or parts.password is not None:
        return "credentials in the URL are not allowed (they would be stored and shown)"
    return None


def address_policy(settings: CommonSettings) -> AddressPolicy:
    """The policy of ``VIGIL_OUTBOUND_ALLOWED_NETS``."""
    return AddressPolicy(parse_networks(settings.outbound_allowed_nets))


class AddressPolicy:
    """Globally routable addresses pass; others only inside ``allowed`` networks."""

    def __init__(self, allowed: Iterable[Network] = ()):
        self.allowed = tuple(allowed)

    def permits(self, address: Address) -> bool:
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            address = address.ipv4_mapped  # ::ffff:127.0.0.1 is 127.0.0.1
        if any(address in net for net in self.allowed if net.version == address.version):
            return True
        # is_global is False for loopback, private (RFC 1918, ULA), link-local (the
        # metadata service), shared (100.64/10), multicast, reserved and unspecified.
        return address.is_global and not address.is_multicast

    def choose(self, host: str, infos: list[tuple[Any, ...]]) -> str:
        """The first resolved address the policy permits; BlockedAddress if any is refused.

        All must pass: a name with one public and one private address could otherwise be
        steered to the private one by whoever controls its DNS.
        """
        addresses = [ipaddress.ip_address(info[4][0].split("%", 1)[0]) for info in infos]
        if not addresses:
            raise BlockedAddress(f"{host} did not resolve")
        for address in addresses:
            if not self.permits(address):
                raise BlockedAddress(
                    f"{host} resolves to {address}, which is not a public address "
                    "(allow its network in VIGIL_OUTBOUND_ALLOWED_NETS)"
                )
        return str(addresses[0])

    def resolve(self, host: str, port: int) -> str:
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except socket.gaierror as exc:
            raise httpcore.ConnectError(f"{host}: {exc}") from None
        return self.choose(host, infos)

    async def resolve_async(self, host: str, port: int) -> str:
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except socket.gaierror as exc:
            raise httpcore.ConnectError(f"{host}: {exc}") from None
        return self.choose(host, infos)


class _GuardedSync(httpcore.SyncBackend):
    def __init__(self, policy: AddressPolicy):
        self.policy = policy

    def connect_tcp(self, host: str, port: int, *args: Any, **kwargs: Any) -> httpcore.NetworkStream:
        return super().connect_tcp(self.policy.resolve(host, port), port, *args, **kwargs)


class _GuardedAsync(httpcore.AnyIOBackend):
    def __init__(self, policy: AddressPolicy):
        self.policy = policy

    async def connect_tcp(self, host: str, port: int, *args: Any, **kwargs: Any) -> httpcore.AsyncNetworkStream:
        return await super().connect_tcp(await self.policy.resolve_async(host, port), port, *args, **kwargs)


def guarded_transport(policy: AddressPolicy, **options: Any) -> httpx.HTTPTransport:
    """An httpx transport whose connections pass ``policy`` (no proxies from the environment)."""
    transport = httpx.HTTPTransport(**options)
    # httpx does not take a network backend; its pool does. (httpx 0.28 / httpcore 1.0.)
    transport._pool._network_backend = _GuardedSync(policy)
    return transport


def guarded_async_transport(policy: AddressPolicy, **options: Any) -> httpx.AsyncHTTPTransport:
    transport = httpx.AsyncHTTPTransport(**options)
    transport._pool._network_backend = _GuardedAsync(policy)
    return transport
