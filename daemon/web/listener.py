"""The dashboard's HTTP listener: uvicorn in a thread of the daemon process.

The socket is bound here, on the caller's thread, so an address in use is an
error the daemon can report (and carry on without a dashboard) instead of
uvicorn exiting its thread. uvicorn installs no signal handlers off the main
thread: the daemon's SIGTERM handling stays its own.
"""

from __future__ import annotations

import socket
import threading

import uvicorn

from daemon.config.web import split_listen


class WebListener:
    def __init__(self, app, listen: str):
        self.app = app
        self.host, self.port = split_listen(listen)
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
                                timeout_graceful_shutdown=2)
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
