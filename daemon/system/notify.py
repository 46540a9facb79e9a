"""The systemd notify protocol (sd_notify), written out because it is one datagram per message.

A library (sdnotify, systemd-python) would add a dependency for ten lines,
and systemd-python needs libsystemd headers to build. NOTIFY_SOCKET is an
AF_UNIX datagram socket path; a leading '@' means the abstract namespace.
Outside systemd (no NOTIFY_SOCKET) every call is a no-op.
"""

from __future__ import annotations

import os
import socket


class SystemdNotifier:
    """Tells systemd how the daemon is (ready, status, watchdog, stopping); a job's notifications (webhook,
    command) are daemon/supervisor/notifications.py's Notifications."""

    def __init__(self, env: dict[str, str] | None = None):
        env = os.environ if env is None else env
        addr = env.get("NOTIFY_SOCKET", "")
        self.addr = ("\0" + addr[1:]) if addr.startswith("@") else addr
        self.sock: socket.socket | None = None
        if self.addr:
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        # WATCHDOG_USEC is for us only if WATCHDOG_PID is unset or names this process.
        usec = env.get("WATCHDOG_USEC")
        wpid = env.get("WATCHDOG_PID")
        ok = usec and usec.isdigit() and (not wpid or wpid == str(os.getpid()))
        self.watchdog_s: float | None = int(usec) / 1e6 if ok else None

    @property
    def enabled(self) -> bool:
        return self.sock is not None

    def send(self, *fields: str) -> bool:
        """Send 'KEY=VALUE' fields in one datagram; never raises (a gone systemd must not stop training)."""
        if self.sock is None:
            return False
        try:
            self.sock.sendto("\n".join(fields).encode(), self.addr)
            return True
        except OSError:
            return False

    def ready(self, status: str) -> bool:
        return self.send("READY=1", f"STATUS={status}", f"MAINPID={os.getpid()}")

    def status(self, status: str) -> bool:
        return self.send(f"STATUS={status}")

    def watchdog(self) -> bool:
        return self.send("WATCHDOG=1")

    def stopping(self, status: str) -> bool:
        return self.send("STOPPING=1", f"STATUS={status}")

    def extend_timeout(self, seconds: float) -> bool:
        """Ask for `seconds` more before systemd gives up on a start or stop (a final checkpoint is being saved)."""
        return self.send(f"EXTEND_TIMEOUT_USEC={int(seconds * 1e6)}")

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None
