"""``http_request``: the agent's one real action tool, held to an allow-list of hosts.

Credentials are referenced by name. The model writes ``"credential": "github"``; this
executor looks the secret up (``VIGIL_CREDENTIAL_GITHUB``), checks that it may go to that
host, and adds the header itself. The secret is therefore never in the model's arguments,
the transcript, memory or a log line, and a response that echoes it back (an echo service,
an error page quoting the request) has it replaced before the model reads it.

What the tool refuses outright (whatever the permission): a host not on the allow-list, a
host that resolves to a non-public address not allowed by ``VIGIL_OUTBOUND_ALLOWED_NETS``,
a scheme other than http(s), a credential sent over plain http to anything but loopback,
headers that carry authority (the model must use a credential name instead), redirects
(a 3xx is handed back, not followed, so an allowed host cannot bounce the call elsewhere).
In auto mode, any method other than GET and HEAD is risky: it changes state somewhere.
"""

from __future__ import annotations

import ipaddress
import logging
from typing import Any
from urllib.parse import urlsplit

import httpx

from vigil.agent.settings import Credential, Permission
from vigil.agent.tools import ActionTool, CallContext, ToolOutput
from vigil.outbound import AddressPolicy, BlockedAddress, guarded_async_transport

log = logging.getLogger(__name__)

METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE")
SAFE_METHODS = ("GET", "HEAD")
# Headers that grant authority or identity: only the credential broker sets these.
FORBIDDEN_HEADERS = {"authorization", "proxy-authorization", "cookie", "x-api-key", "host", "idempotency-key"}
MAX_BODY_CHARS = 100_000


def _host_port(url: str) -> tuple[str, str, int] | str:
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        return f"the URL is not valid ({exc})"
    if parts.scheme not in ("http", "https"):
        return "only http and https URLs are allowed"
    if not parts.hostname:
        return "the URL has no host"
    if parts.username or parts.password:
        return "credentials in the URL are not allowed; name a credential instead"
    return parts.scheme, parts.hostname.lower(), port or (443 if parts.scheme == "https" else 80)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _entry(entry: str) -> tuple[str, int | None]:
    if entry.startswith("["):  # [v6::addr]:port
        host, _, rest = entry[1:].partition("]")
        port = rest[1:]
    else:
        host, _, port = entry.partition(":")
    return host, int(port) if port else None


def host_allowed(host: str, port: int, allowed: tuple[str, ...]) -> bool:
    """``host`` entries allow any port; ``host:port`` entries only that port."""
    for name, only_port in map(_entry, allowed):
        if name == host and only_port in (None, port):
            return True
    return False


class HttpRequestTool(ActionTool):
    name = "http_request"
    default_permission = Permission.AUTO

    def __init__(
        self,
        allowed_hosts: tuple[str, ...],
        credentials: dict[str, Credential],
        timeout_s: float,
        max_bytes: int,
        policy: AddressPolicy | None = None,
    ):
        self.allowed_hosts = allowed_hosts
        # An allowed name can still resolve to a private address (a typo'd internal name, a
        # rebinding DNS answer): the address it resolves to is checked at connect time.
        self.policy = policy or AddressPolicy()
        self.credentials = credentials
        self.timeout_s = timeout_s
        self.max_bytes = max_bytes
        names = sorted(credentials)
        self.description = (
            "Make an HTTP request to an allowed host and read the response (status, content type, "
            f"body, cut at {max_bytes} bytes). Allowed hosts: {', '.join(allowed_hosts)}. "
            "Never put secrets in the URL or headers: name a credential instead and it is attached for you"
            + (f" (available: {', '.join(names)})." if names else " (none are configured).")
            + " Redirects are not followed. Calls that change state (anything but GET and HEAD) may be "
            "blocked or need the user's approval."
        )
        credential_schema: dict[str, Any] = {"type": "string", "description": "Name of a credential to attach."}
        if names:
            credential_schema["enum"] = names
        self.input_schema = {
            "type": "object",
            "properties": {
                "method": {"type": "string", "enum": list(METHODS)},
                "url": {"type": "string", "description": "Absolute http(s) URL on an allowed host."},
                "headers": {"type": "object", "additionalProperties": {"type": "string"}},
                "body": {"type": "string", "description": "Request body, e.g. JSON text."},
                "credential": credential_schema,
            },
            "required": ["method", "url"],
            "additionalProperties": False,
        }

    def check(self, args: dict[str, Any]) -> str | None:
        method, url = args.get("method"), args.get("url")
        if method not in METHODS:
            return f"method must be one of {', '.join(METHODS)}"
        if not isinstance(url, str):
            return "url is required"
        target = _host_port(url)
        if isinstance(target, str):
            return target
        scheme, host, port = target
        if not host_allowed(host, port, self.allowed_hosts):
            return f"{host} is not on the allow-list ({', '.join(self.allowed_hosts)})"
        headers = args.get("headers") or {}
        if not isinstance(headers, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in headers.items()
        ):
            return "headers must map names to strings"
        taken = sorted(h for h in headers if h.lower() in FORBIDDEN_HEADERS)
        if taken:
            return f"header {taken[0]} may not be set by hand; name a credential instead"
        body = args.get("body")
        if body is not None and (not isinstance(body, str) or len(body) > MAX_BODY_CHARS):
            return f"body must be a string of at most {MAX_BODY_CHARS} characters"
        name = args.get("credential")
        if name is not None:
            credential = self.credentials.get(name) if isinstance(name, str) else None
            if credential is None:
                return f"there is no credential named {name!r}"
            if credential.hosts and not host_allowed(host, port, credential.hosts):
                return f"credential {name} may not be sent to {host}"
            if scheme != "https" and not _is_loopback(host):
                return f"credential {name} is only sent over https"
        return None

    def risk(self, args: dict[str, Any]) -> str | None:
        if args.get("method") in SAFE_METHODS:
            return None
        host = urlsplit(str(args.get("url"))).hostname
        return f"{args.get('method')} changes state at {host}, which needs a person to approve"

    def describe(self, args: dict[str, Any]) -> str:
        line = f"{args.get('method')} {args.get('url')}"
        if args.get("credential"):
            line += f" using credential {args['credential']}"
        body = args.get("body")
        if body:
            line += f" with body {body[:300]!r}" + (" (cut)" if len(body) > 300 else "")
        return line

    def _redact(self, text: str) -> str:
        for credential in self.credentials.values():
            for secret in {credential.secret.get_secret_value(), credential.header_value()}:
                text = text.replace(secret, f"[credential {credential.name}]")
        return text

    async def run(self, args: dict[str, Any], call: CallContext) -> ToolOutput:
        refusal = self.check(args)
        if refusal is not None:  # checked before the permission too; again here, right before acting
            return ToolOutput(f"Not sent: {refusal}.", True)
        method, url = args["method"], args["url"]
        headers = dict(args.get("headers") or {})
        if method not in SAFE_METHODS:
            headers["Idempotency-Key"] = call.idempotency_key
        name = args.get("credential")
        if name:
            credential = self.credentials[name]
            headers[credential.header] = credential.header_value()
        host = urlsplit(url).hostname
        try:
            transport = guarded_async_transport(self.policy)
            async with httpx.AsyncClient(
                timeout=self.timeout_s, follow_redirects=False, trust_env=False, transport=transport
            ) as client:
                async with client.stream(method, url, headers=headers, content=args.get("body")) as response:
                    body = b""
                    async for chunk in response.aiter_bytes():
                        body += chunk
                        if len(body) > self.max_bytes:
                            break
        except httpx.HTTPError as exc:
            log.info("http_request %s %s failed: %s", method, host, type(exc).__name__)
            if isinstance(exc.__cause__, BlockedAddress):
                return ToolOutput(f"Not sent: {exc.__cause__}.", True)
            return ToolOutput(f"The request failed: {type(exc).__name__}.", True)
        log.info("http_request %s %s -> %d", method, host, response.status_code)
        cut = len(body) > self.max_bytes
        text = body[: self.max_bytes].decode("utf-8", errors="replace")
        lines = [f"HTTP {response.status_code} {response.reason_phrase}"]
        for header in ("content-type", "location"):
            if header in response.headers:
                lines.append(f"{header}: {response.headers[header]}")
        lines += ["", text + (f"\n[cut at {self.max_bytes} bytes]" if cut else "")]
        return ToolOutput(self._redact("\n".join(lines)), response.status_code >= 400)
