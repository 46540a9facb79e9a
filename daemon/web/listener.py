"""The dashboard's HTTP listener: uvicorn in a thread of the daemon process.

The socket is bound here, on the caller's thread, so an address in use is an
error the daemon can report (and carry on without a dashboard) instead of
uvicorn exiting its thread. uvicorn installs no signal handlers off the main
thread: the daemon's SIGTERM handling stays its own.

Slow clients: uvicorn bounds a request's head (h11's 16 KiB) and an idle keep-alive connection (5 s), but not
the time a request's head may take: a client sending a header line now and then held its connection for as
long as it liked. HeaderDeadline closes a connection whose request head is not whole `web.header_timeout_s`
after the connection (or its previous response) began.
"""

from __future__ import annotations

import asyncio
import socket
import threading

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from daemon.config.web import split_listen

KEEP_ALIVE_S = 5  # uvicorn's own default, said here: an idle connection between requests is closed after it
MAX_HEAD_BYTES = 16 << 10  # h11's default: a request line and headers larger than this are answered 400


class HeaderDeadline(H11Protocol):
    """uvicorn's h11 protocol, with a deadline on each request's head (uvicorn has no setting for it)."""

    header_timeout_s = 10.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_deadline: asyncio.TimerHandle | None = None
        self._arm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm()  # the next request's head has its own deadline

    def connection_lost(self, exc: Exception | None) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
        super().connection_lost(exc)

    def _arm(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None
        if not self.transport.is_closing():
            self._head_deadline = self.loop.call_later(self.header_timeout_s, self._late)

    def _late(self) -> None:
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()  # no whole request head yet: a slow client, or one holding a connection


class WebListener:
    def __init__(self, app, listen: str, header_timeout_s: float = HeaderDeadline.header_timeout_s):
        self.app = app
        self.host, self.port = split_listen(listen)
        # A subclass per listener: the deadline is a class attribute because uvicorn builds the protocol itself.
        self.protocol = type("HeaderDeadline", (HeaderDeadline,), {"header_timeout_s": header_timeout_s})
        self.sock: socket.socket | None = None
        self.server: uvicorn.Server | None = None
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        """Bind (OSError if the address is taken or not ours) and serve on a daemon thread."""
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        s = socket.socket(family, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # Accepted connections inherit it: uvicorn writes a response's head and body separately, and with
        # Nagle's algorithm the body would wait for the client's delayed ACK (~40 ms on every page).
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            s.bind((self.host, self.port))
            s.listen(128)
        except OSError:
            s.close()
            raise
        s.set_inheritable(False)  # trainers must not inherit the listening socket
        self.sock = s
        self.port = s.getsockname()[1]  # the real port when the config says 0
        config = uvicorn.Config(self.app, log_level="warning", access_log=False, lifespan="off",
                                timeout_graceful_shutdown=2, http=self.protocol, timeout_keep_alive=KEEP_ALIVE_S,
                                h11_max_incomplete_event_size=MAX_HEAD_BYTES)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [s]}, name="web", daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/"

    def close(self, timeout_s: float = 3.0) -> None:
        if self.server is not None:
            self.server.should_exit = True
        if self.thread is not None:
            self.thread.join(timeout_s)
        if self.sock is not None:
            self.sock.close()
            self.sock = None
