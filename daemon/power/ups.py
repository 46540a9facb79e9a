"""UPS through Network UPS Tools: a small client for upsd's line protocol and a monitor that turns
`ups.status` into what the supervisor should do.

Why a small client of our own: the upstream PyNUTClient ships with NUT and is
not on PyPI; `nut2` (the PyPI fork) is unmaintained since 2019 and is built on
telnetlib, which Python 3.13 removed. Reading `ups.status` needs three request
types (GET VAR, LIST VAR, LOGOUT) of a line protocol
(https://networkupstools.org/docs/developer-guide.chunked/net-protocol.html),
so the client is a page.

Status → action (ups.status is a space-separated set of flags: OL, OB, LB, FSD, CHRG, ...):

    OB            commit a checkpoint at once (once per outage), then `on_battery`:
                  lowest_cap → every GPU to its minimum limit, jobs keep running;
                  pause      → jobs stop cleanly (checkpoint, exit 75) and wait
    LB or FSD     final checkpoint and clean stop of every job at the lowest cap; start nothing
    OL            held for `resume_after_s` → caps restored, jobs resume (until then: lowest cap, nothing starts)
    no answer     reported once, not fatal; the last known status stands
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from daemon.config.power import UpsSettings


class NutError(Exception):
    pass


def _unquote(s: str) -> str:
    s = s.strip()
    if len(s) >= 2 and s[0] == s[-1] == '"':
        s = s[1:-1]
    return s.replace('\\"', '"').replace("\\\\", "\\")


class NutClient:
    """A synchronous upsd client with a hard timeout on every request."""

    def __init__(self, host: str, port: int, timeout_s: float):
        self.host, self.port, self.timeout_s = host, port, timeout_s
        self._sock: socket.socket | None = None
        self._buf = b""

    def _connect(self) -> None:
        self._sock = socket.create_connection((self.host, self.port), timeout=self.timeout_s)
        self._buf = b""

    def _readline(self) -> str:
        assert self._sock is not None
        while b"\n" not in self._buf:
            if len(self._buf) > 65536:
                raise NutError("line too long from upsd")
            chunk = self._sock.recv(4096)
            if not chunk:
                raise NutError("upsd closed the connection")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return line.decode("utf-8", "replace").rstrip("\r")

    def _request(self, line: str) -> str:
        if self._sock is None:
            self._connect()
        assert self._sock is not None
        self._sock.sendall(line.encode() + b"\n")
        reply = self._readline()
        if reply.startswith("ERR "):
            raise NutError(f"upsd: {reply[4:]} (for {line.split()[0]} {line.split()[1] if len(line.split()) > 1 else ''})")
        return reply

    def get_var(self, ups: str, var: str) -> str:
        reply = self._request(f"GET VAR {ups} {var}")
        prefix = f"VAR {ups} {var} "
        if not reply.startswith(prefix):
            raise NutError(f"unexpected reply from upsd: {reply!r}")
        return _unquote(reply[len(prefix) :])

    def list_vars(self, ups: str) -> dict[str, str]:
        reply = self._request(f"LIST VAR {ups}")
        if reply != f"BEGIN LIST VAR {ups}":
            raise NutError(f"unexpected reply from upsd: {reply!r}")
        out: dict[str, str] = {}
        while True:
            line = self._readline()
            if line == f"END LIST VAR {ups}":
                return out
            parts = line.split(" ", 3)
            if len(parts) < 4 or parts[0] != "VAR":
                raise NutError(f"unexpected line in LIST VAR: {line!r}")
            out[parts[2]] = _unquote(parts[3])

    def close(self) -> None:
        if self._sock is not None:
            try:
                self._sock.sendall(b"LOGOUT\n")
            except OSError:
                pass
            self._sock.close()
            self._sock = None


ONLINE, ON_BATTERY, LOW_BATTERY, RECOVERING = "online", "on_battery", "low_battery", "recovering"


@dataclass
class UpsAdvice:
    may_start: bool = True
    stop_reason: str | None = None
    checkpoint_now: bool = False
    lowest_cap: bool = False  # every GPU to its minimum limit
    outage: bool = False  # on battery or low: the host may go down any moment, through no job's fault
    notes: list[str] = field(default_factory=list)


class UpsMonitor:
    """Polls upsd on its own thread; `advice(now)` is read by the policy on every supervisor tick.

    `poll_once()` is the whole poll; the thread only repeats it every `poll_s`.
    """

    def __init__(self, settings: UpsSettings, log: Any, clock: Callable[[], float] = time.monotonic):
        self.s, self.log, self.clock = settings, log, clock
        self.client = NutClient(settings.host, settings.port, settings.timeout_s)
        self.mode = ONLINE
        self.status = ""  # the raw ups.status of the last good poll
        self.connected: bool | None = None  # None until the first poll
        self.last_error: str | None = None
        self._ol_since: float | None = None
        self._checkpoint_pending = False
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def poll_once(self) -> None:
        try:
            status = self.client.get_var(self.s.name, "ups.status")
        except (OSError, NutError) as e:
            self.client.close()
            if self.connected is not False:
                self.log.warning("UPS unreachable; keeping the last known status", host=self.s.host,
                                 port=self.s.port, ups=self.s.name, error=str(e), status=self.status or None)
            self.connected, self.last_error = False, str(e)
            return
        if self.connected is False:
            self.log.info("UPS reachable again", ups=self.s.name, status=status)
        self.connected, self.last_error = True, None
        self._update(status, self.clock())

    def _update(self, status: str, now: float) -> None:
        flags = set(status.split())
        with self._lock:
            self.status = status
            before = self.mode
            if flags & {"LB", "FSD"}:
                if self.mode in (ONLINE, RECOVERING):
                    self._checkpoint_pending = True  # went straight to LB: still commit at once
                self.mode = LOW_BATTERY
            elif "OB" in flags:
                if self.mode in (ONLINE, RECOVERING):
                    self.mode = ON_BATTERY
                    self._checkpoint_pending = True
            elif "OL" in flags and self.mode in (ON_BATTERY, LOW_BATTERY):
                self.mode, self._ol_since = RECOVERING, now
            self._settle(now)
            if self.mode != before:
                self.log.warning("UPS state", ups=self.s.name, status=status, state=self.mode, was=before)

    def _settle(self, now: float) -> None:
        if self.mode == RECOVERING and self._ol_since is not None and now - self._ol_since >= self.s.resume_after_s:
            self.mode, self._ol_since = ONLINE, None
            self.log.info("UPS on line long enough; resuming", ups=self.s.name, held_s=self.s.resume_after_s)

    def advice(self, now: float | None = None) -> UpsAdvice:
        now = self.clock() if now is None else now
        with self._lock:
            self._settle(now)
            a = UpsAdvice(outage=self.mode in (ON_BATTERY, LOW_BATTERY))
            if self._checkpoint_pending:
                a.checkpoint_now, self._checkpoint_pending = True, False
            if self.mode == LOW_BATTERY:
                a.may_start, a.stop_reason = False, f"UPS low battery ({self.status})"
                a.lowest_cap = True  # the least power while the final checkpoint is written
                a.notes.append(a.stop_reason + ": final checkpoint, jobs stopped")
            elif self.mode == ON_BATTERY:
                a.may_start = False
                if self.s.on_battery == "pause":
                    a.stop_reason = f"UPS on battery ({self.status})"
                    a.notes.append(a.stop_reason + ": jobs paused")
                else:
                    a.lowest_cap = True
                    a.notes.append(f"UPS on battery ({self.status}): lowest power limit")
            elif self.mode == RECOVERING:
                a.may_start = False
                a.lowest_cap = True  # caps come back together with the jobs, once OL has held
                left = self.s.resume_after_s - (now - (self._ol_since or now))
                a.notes.append(f"UPS back on line; resuming in {max(0.0, left):.0f} s")
            if self.connected is False:
                a.notes.append(f"UPS unreachable ({self.last_error})")
            return a

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="lorad-ups", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.poll_once()
            self._stop.wait(self.s.poll_s)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.s.timeout_s + 1)
        self.client.close()
