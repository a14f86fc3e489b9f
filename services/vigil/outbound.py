"""Where vigil's outbound HTTP may go: the dispatcher's webhooks and the agent's ``http_request``.

A channel URL is set by an operator and a tool URL chosen by a model, so either may name
an address inside the network vigil runs in: the cloud metadata service (169.254.169.254,
which hands out credentials), a database port on a private subnet, the host itself. Every
address that is not globally routable is refused unless ``VIGIL_OUTBOUND_ALLOWED_NETS``
lists its network; an IPv6 address carrying an IPv4 address (NAT64, 6to4, Teredo, mapped,
compatible, translated) is judged by the IPv4 address it carries.

The MCP SDK talks HTTP through httpx2 (a fork of httpx with its own httpcore2): the same
guard is fitted to its pool (:func:`guarded_async_transport2`).

The check runs on the address a name *resolves to*, at connect time, and the connection is
made to that checked address (the TLS server name stays the URL's host): a name that
resolves to a public address when the URL is set and to 127.0.0.1 when it is used (DNS
rebinding) is refused too. URLs with credentials in them (``https://user:pass@host``) are
refused before anything is sent: they would be stored, logged and shown.
"""

from __future__ import annotations

import asyncio
import ipaddress
import re
import socket
from collections.abc import Iterable
from typing import Any
from urllib.parse import urlsplit

import httpcore
import httpcore2
import httpx
import httpx2

from vigil.errors import VigilError
from vigil.settings import CommonSettings, parse_networks

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
Address = ipaddress.IPv4Address | ipaddress.IPv6Address


class BlockedAddress(VigilError, httpcore.ConnectError):
    """The target resolved to an address the policy refuses (an httpx ``ConnectError``)."""


def parse_nets(text: str) -> tuple[Network, ...]:
    """``"127.0.0.0/8, ::1/128"`` -> networks (the parser of ``VIGIL_OUTBOUND_ALLOWED_NETS``)."""
    return parse_networks(text)


_HOST = re.compile(r"[\w.:%-]+")  # names (IDN letters too), IPv4, IPv6 (with a %zone)


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
    # urlsplit drops CR, LF and tab silently, so the URL stored is not the one judged; and a
    # host of "<", quotes or spaces is HTML or a header injection, never a name (issue 58).
    if any(c.isspace() or not c.isprintable() for c in url):
        return "the URL has a space or a control character (CR, LF, tab)"
    if not _HOST.fullmatch(parts.hostname):
        return "the host has characters no host name or address has"
    return None


def literal_address(url: str) -> Address | None:
    """The address a URL's host writes literally, in any form ``getaddrinfo`` reads
    (``127.1``, ``0x7f.0.0.1`` and ``2130706433`` too); None for a name."""
    host = (urlsplit(url).hostname or "").split("%", 1)[0]
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        pass
    try:
        return ipaddress.IPv4Address(socket.inet_aton(host))
    except OSError:
        return None


def address_policy(settings: CommonSettings) -> AddressPolicy:
    """The policy of ``VIGIL_OUTBOUND_ALLOWED_NETS``."""
    return AddressPolicy(parse_networks(settings.outbound_allowed_nets))


# IPv6 forms that carry an IPv4 address in their low 32 bits: a packet to one reaches (or is
# translated to) that IPv4 address, so the IPv4 address is what the policy judges.
_LOW_32_FORMS = (
    ipaddress.IPv6Network("::ffff:0:0/96"),  # IPv4-mapped (RFC 4291)
    ipaddress.IPv6Network("::/96"),  # IPv4-compatible (RFC 4291, deprecated); :: and ::1 included
    ipaddress.IPv6Network("::ffff:0:0:0/96"),  # IPv4-translated (RFC 2765, SIIT)
    ipaddress.IPv6Network("64:ff9b::/96"),  # NAT64 well-known prefix (RFC 6052)
)
# Refused whatever they carry, though Python's is_global says True for them (in some versions).
_REFUSED = (
    # IETF protocol assignments (RFC 6890): not globally reachable; Python 3.11 only knows /29 of it.
    ipaddress.IPv4Network("192.0.0.0/24"),
    ipaddress.IPv6Network("fec0::/10"),  # site-local (deprecated by RFC 3879, still routed in some sites)
    # Local-use NAT64 (RFC 8215): the IPv4 address's place in it depends on the prefix length
    # the site chose, so what it carries cannot be judged.
    ipaddress.IPv6Network("64:ff9b:1::/48"),
)


def embedded_ipv4(address: ipaddress.IPv6Address) -> tuple[ipaddress.IPv4Address, ...]:
    """The IPv4 addresses an IPv6 address stands for; empty if it embeds none.

    Mapped, compatible, translated and NAT64 (64:ff9b::/96) carry one in the low 32 bits;
    6to4 (2002::/16) in bits 16-47; Teredo (2001::/32) two, the server's and the client's
    (the one packets are relayed to), and both are returned.
    """
    for network in _LOW_32_FORMS:
        if address in network:
            return (ipaddress.IPv4Address(int(address) & 0xFFFFFFFF),)
    if address.sixtofour is not None:
        return (address.sixtofour,)
    if address.teredo is not None:
        return address.teredo
    return ()


class AddressPolicy:
    """Globally routable addresses pass; others only inside ``allowed`` networks.

    An IPv6 address that embeds IPv4 addresses (see :func:`embedded_ipv4`) is judged by what
    it means: it passes when every embedded address would, so ``64:ff9b::a9fe:a9fe`` (NAT64
    to the metadata service) is refused and ``::ffff:127.0.0.1`` passes where 127.0.0.0/8 is
    allowed. An allowed IPv6 network is taken at its word for every address in it.
    """

    def __init__(self, allowed: Iterable[Network] = ()):
        self.allowed = tuple(allowed)

    def _allowed(self, address: Address) -> bool:
        return any(address in net for net in self.allowed if net.version == address.version)

    def _public(self, address: Address) -> bool:
        # is_global is False for loopback, private (RFC 1918, ULA), link-local (the
        # metadata service), shared (100.64/10), reserved and unspecified.
        if address.is_multicast or not address.is_global:
            return False
        return not any(address in net for net in _REFUSED if net.version == address.version)

    def permits(self, address: Address) -> bool:
        if self._allowed(address):
            return True
        if isinstance(address, ipaddress.IPv6Address):
            carried = embedded_ipv4(address)
            if carried:
                return all(self._allowed(v4) or self._public(v4) for v4 in carried)
        return self._public(address)

    def url_problem(self, url: str) -> str | None:
        """:func:`url_problem`, and a literal address the policy refuses (where it is given,
        e.g. ``vigil channels set``; a name is judged at each connection, as it resolves)."""
        problem = url_problem(url)
        if problem is not None:
            return problem
        address = literal_address(url)
        if address is not None and not self.permits(address):
            return f"{address} is not a public address (allow its network in VIGIL_OUTBOUND_ALLOWED_NETS)"
        return None

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


class _GuardedAsync2(httpcore2.AnyIOBackend):
    def __init__(self, policy: AddressPolicy):
        self.policy = policy

    async def connect_tcp(self, host: str, port: int, *args: Any, **kwargs: Any) -> httpcore2.AsyncNetworkStream:
        try:
            address = await self.policy.resolve_async(host, port)
        except (BlockedAddress, httpcore.ConnectError) as exc:
            raise httpcore2.ConnectError(str(exc)) from None
        return await super().connect_tcp(address, port, *args, **kwargs)


def guarded_async_transport2(policy: AddressPolicy, **options: Any) -> httpx2.AsyncHTTPTransport:
    """:func:`guarded_async_transport` for httpx2 (the MCP SDK's client), same pool surgery."""
    transport = httpx2.AsyncHTTPTransport(trust_env=False, **options)
    transport._pool._network_backend = _GuardedAsync2(policy)
    return transport
