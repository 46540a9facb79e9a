"""What the daemon tells systemd after each tick: its STATUS line, and the watchdog ping while it is healthy.

`systemctl status lorad` shows the line (each job's step and speed, what is queued, draining, a stuck inbox,
the power policy's notes). The watchdog is fed only from here and only after a tick whose steps all worked,
so a loop that keeps failing gets the daemon restarted. The datagrams themselves: daemon/system/notify.py.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from daemon.supervisor.trainer import Child


def status_line(children: Iterable[Child], queued: int, draining: bool, stuck: list[dict[str, Any]],
                notes: list[str]) -> str:
    parts = []
    for c in children:
        sps = f", {c.s_per_step:.2f} s/step" if c.s_per_step else ""
        parts.append(f"{c.job_id} step {c.step}/{c.total}{sps}" + (f" (stopping: {c.stop_reason})" if c.stop_reason else ""))
    if not parts:
        parts.append("idle")
    s = "; ".join(parts) + f"; {queued} queued"
    if draining:
        s += "; draining"
    if stuck:
        s += f"; inbox stuck ({len(stuck)} file(s): {stuck[0]['error']})"
    if notes:
        s += "; " + "; ".join(notes)
    return s


class SystemdReporter:
    """Sends STATUS when the line changes and WATCHDOG at a third of the watchdog interval, when healthy."""

    def __init__(self, notifier):
        self.notifier = notifier
        self.last_watchdog = 0.0
        self.last_status = ""

    def report(self, healthy: bool, line) -> None:
        """`line`: a function giving the status line (not built at all outside systemd)."""
        if self.notifier is None or not self.notifier.enabled:
            return
        now = time.monotonic()
        wd = self.notifier.watchdog_s
        if wd and healthy and now - self.last_watchdog >= wd / 3:
            self.notifier.watchdog()
            self.last_watchdog = now
        s = line()
        if s != self.last_status:
            self.notifier.status(s)
            self.last_status = s
