"""What stands in front of the dashboard's routes: the Host check and the request body's byte count.

    Host        DNS rebinding: a page on evil.example whose name is made to resolve to 127.0.0.1 reaches a
                loopback listener with `Host: evil.example`. Starlette's TrustedHostMiddleware refuses names
                other than the ones the dashboard is reached by (allowed_hosts); an IP literal passes, since a
                browser that sends one has that address as its origin, which no rebinding can give it.
    body        counted as it arrives, not only by Content-Length (a chunked upload has none): past the cap the
                request is answered 413 and nothing more is read. The routes check the token before they read
                a body at all (daemon/web/app.py).
The header deadline for slow clients lives with uvicorn's settings, in daemon/web/listener.py.
"""

from __future__ import annotations

import ipaddress
import socket

from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.responses import PlainTextResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from daemon.config.web import WebSettings, is_loopback

LOOPBACK_NAMES = ("localhost",)
WILDCARDS = ("0.0.0.0", "::")


def allowed_hosts(settings: WebSettings) -> list[str]:
    """The names the dashboard answers to: localhost on a loopback or wildcard listener, the machine's own
    names on one other machines reach, and `web.hosts` (a proxy's name, a DNS alias; "*" turns the check off)."""
    host, _ = settings.host_port()
    names = list(settings.hosts)
    if is_loopback(host) or host in WILDCARDS:
        names += LOOPBACK_NAMES
    if not is_loopback(host):
        names += [socket.gethostname(), socket.getfqdn()]
    if not _ip(host) and host not in WILDCARDS:
        names.append(host)  # the listen address given as a name
    return sorted({n.lower() for n in names if n})


def _host_of(header: str) -> str:
    """A Host header without its port ("[::1]:8742" → "::1")."""
    if header.startswith("["):
        return header[1:header.find("]")]
    return header.rpartition(":")[0] if ":" in header else header


def _ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    return True


class HostCheck(TrustedHostMiddleware):
    """TrustedHostMiddleware, with IP literals let through (see the module's docstring)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and _ip(_host_of(Headers(scope=scope).get("host", ""))):
            await self.app(scope, receive, send)
            return
        await super().__call__(scope, receive, send)


class BodyLimit:
    """At most `max_bytes` of request body reach the app, counted as they arrive."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_bytes:
            await self._too_large()(scope, receive, send)  # said at once, before a byte of it is read
            return
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    # Raised inside the route's body read; Starlette's exception layer answers 413.
                    raise HTTPException(413, f"request larger than {self.max_bytes} bytes")
            return message

        await self.app(scope, counted, send)

    def _too_large(self) -> PlainTextResponse:
        return PlainTextResponse(f"request larger than {self.max_bytes} bytes", status_code=413)
