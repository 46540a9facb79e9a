"""The daemon's clean stop: every trainer checkpoints and exits, and every exit is written, within a deadline.

SIGTERM to every trainer, then only the supervisor's `reap` and `heartbeats` steps until none is left
(SIGKILL to what still runs at the deadline). Exits that cannot be written (the store refuses) are retried
for PENDING_GIVE_UP_S after the last trainer is gone; what is still unwritten then stays `running` in the
store, and the next start's recovery (daemon/service/recovery.py) settles it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Collection
from typing import Any, Protocol

PENDING_GIVE_UP_S = 10.0  # unwritten bookkeeping is retried this long after the last trainer is gone


class Stoppable(Protocol):
    """The part of the supervisor a shutdown drives."""

    children: dict[str, Any]
    pending: Collection[str]
    shutting_down: bool
    notifier: Any
    log: Any
    wake: threading.Event

    def stop(self, c: Any, reason: str) -> None: ...
    def reap(self) -> None: ...
    def heartbeats(self) -> None: ...


def shut_down(sup: Stoppable, deadline_s: float) -> None:
    sup.shutting_down = True
    for c in list(sup.children.values()):
        sup.stop(c, "shutdown")
        c.stop_deadline = time.monotonic() + deadline_s
    if sup.children and sup.notifier is not None:
        sup.notifier.extend_timeout(deadline_s + 10)
    said: set[str] = set()
    alone_since: float | None = None
    while sup.children or sup.pending:
        for name, fn in (("reap", sup.reap), ("heartbeats", sup.heartbeats)):
            try:
                fn()
            except Exception as e:  # noqa: BLE001 — shutting down: say it once, keep reaping
                if f"{name}: {e}" not in said:
                    said.add(f"{name}: {e}")
                    sup.log.error("shutdown_step_failed", step=name, error=f"{type(e).__name__}: {e}")
        if sup.children:
            alone_since = None
        elif sup.pending:
            alone_since = alone_since or time.monotonic()
            if time.monotonic() - alone_since >= PENDING_GIVE_UP_S:
                sup.log.error("bookkeeping_unwritten", jobs=sorted(sup.pending),
                              message="left running in the store; the next start's recovery settles them")
                break
        sup.wake.wait(0.1)
        sup.wake.clear()
