"""The CLI side of the socket: one request, one reply; a clear one-line message when the daemon is down."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Any

from daemon import protocol as p
from daemon.system.paths import default_home

RUNTIME_SOCKET = Path("/run/lorad/lorad.sock")


class DaemonDown(Exception):
    pass


def find_socket(home: str | None = None, sock: str | None = None) -> Path:
    """--socket, $LORAD_SOCKET, --home/lorad.sock, the systemd RuntimeDirectory, then the default home."""
    if sock:
        return Path(sock)
    if os.environ.get("LORAD_SOCKET"):
        return Path(os.environ["LORAD_SOCKET"])
    if home:
        return Path(home) / "lorad.sock"
    if RUNTIME_SOCKET.exists():
        return RUNTIME_SOCKET
    return default_home() / "lorad.sock"


class Client:
    def __init__(self, path: Path, timeout_s: float = 60.0):
        self.path = Path(path)
        self.timeout_s = timeout_s

    def call(self, req: p.BaseModel) -> dict[str, Any]:
        """Send one typed request; return the reply's data (as sent: --json prints it as is; p.parse_reply reads it)
        or raise p.ProtocolError (the daemon's error code and message) / DaemonDown."""
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(self.timeout_s)
        try:
            try:
                s.connect(str(self.path))
            except (FileNotFoundError, ConnectionRefusedError):
                raise DaemonDown(f"lorad: the daemon is not running (no socket at {self.path})") from None
            except PermissionError:
                raise DaemonDown(f"lorad: permission denied on {self.path} (join the daemon's group)") from None
            except OSError as e:
                raise DaemonDown(f"lorad: cannot reach the daemon at {self.path}: {e}") from None
            buf = b""
            try:
                s.sendall(p.encode(req))
            except (BrokenPipeError, ConnectionResetError):
                # A daemon with no free connection answers `busy` at once and hangs up without reading: its
                # answer is still ours to read below. (A BrokenPipeError here is not our stdout's.)
                pass
            try:
                while not buf.endswith(b"\n"):
                    chunk = s.recv(1 << 20)
                    if not chunk:
                        break
                    buf += chunk
            except ConnectionResetError:
                buf = b""  # the daemon went away mid-request
        finally:
            s.close()
        if not buf:
            raise DaemonDown(f"lorad: the daemon closed the connection on {self.path} without answering")
        reply = json.loads(buf)
        if not reply.get("ok"):
            raise p.ProtocolError(reply.get("error", "error"), reply.get("message", ""))
        return reply.get("data", {})
