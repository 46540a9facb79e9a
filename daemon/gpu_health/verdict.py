"""Per GPU: ok → quarantined → held, and back. Pure: readings and a clock in, verdicts out.

    ok           scheduled
    quarantined  a fatal fault (lost, unknown error, a fatal Xid, new uncorrectable ECC errors, a pending or
                 failed row remap): not scheduled; its trainer is stopped. Back to ok by itself once its
                 readings have been clean for recover_s (a driver reload, a reset by an admin)
    held         max_faults faults within fault_window_s: kept out, whatever it reads, until `lorad gpu clear N`

A fault is an event (each fatal Xid, each rise of the ECC count) or the onset of a condition (lost, an error, a
pending remap); a condition that lasts is one fault, and the GPU cannot recover while it lasts.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from daemon.gpu_health.reading import FATAL_XIDS, GIB, Reading, slowdown

OK, QUARANTINED, HELD = "ok", "quarantined", "held"


@dataclass(frozen=True)
class Rules:
    recover_s: float = 30.0
    max_faults: int = 3
    fault_window_s: float = 3600.0


@dataclass
class GpuVerdict:
    gpu: int
    state: str = OK
    reason: str | None = None  # the latest fault, in words
    since: float = 0.0  # when it entered this state
    faults: deque = field(default_factory=deque)  # times of faults within the window
    clean_since: float | None = None  # the first clean reading after a fault
    condition: str | None = None  # lost / error / pending remap, while it lasts
    fatal: bool = False  # out for a fault that leaves nothing on it to trust (lost, unknown error, a fatal Xid)
    lost: bool = False
    ecc: int | None = None  # the last uncorrectable ECC count seen (the baseline)
    throttle: list[str] = field(default_factory=list)
    memory_total: int | None = None
    foreign: list[tuple[int, int]] = field(default_factory=list)  # (pid, bytes) of processes not ours
    notes: list[str] = field(default_factory=list)  # non-fatal Xids seen, newest last (a few)

    @property
    def usable(self) -> bool:
        return self.state == OK

    def foreign_bytes(self) -> int:
        return sum(b for _, b in self.foreign)

    def free_bytes(self) -> int | None:
        return None if self.memory_total is None else max(0, self.memory_total - self.foreign_bytes())

    def view(self) -> dict[str, Any]:
        """What status, /metrics and the dashboard show. Memory to 0.1 GiB and no raw throttle reasons: the daemon
        writes a view to state.db when it changes, and a browser's memory moving by a few MiB is no change."""
        free = self.free_bytes()
        return {"gpu": self.gpu, "state": self.state, "reason": self.reason, "faults": len(self.faults),
                "lost": self.lost, "slowdown": slowdown(self.throttle),
                "memory_total_gb": None if self.memory_total is None else round(self.memory_total / GIB, 1),
                "foreign_gb": round(self.foreign_bytes() / GIB, 1), "foreign_processes": len(self.foreign),
                "free_gb": None if free is None else round(free / GIB, 1)}


@dataclass(frozen=True)
class Change:
    gpu: int
    before: str
    after: str
    reason: str | None
    fatal: bool  # the GPU's state may no longer be trusted (lost, unknown error, a fatal Xid): kill, don't save


def _condition(r: Reading) -> tuple[str | None, bool]:
    if r.lost:
        return "GPU lost (fell off the bus)", True
    if r.error:
        return f"unknown error: {r.error}", True
    if r.remap_failed:
        return "row remapping failed", False
    if r.pending_remap:
        return "row remap pending: the GPU needs a reset", False
    return None, False


def observe(v: GpuVerdict, r: Reading, ours: set[int] | None, rules: Rules, now: float) -> Change | None:
    """Fold one reading into the GPU's verdict; the change of state it causes, if any."""
    before = v.state
    events: list[tuple[str, bool]] = []
    cond, cond_fatal = _condition(r)
    if cond is not None and cond != v.condition:
        events.append((cond, cond_fatal))
    v.condition, v.lost = cond, r.lost
    for x in r.xids:
        if x in FATAL_XIDS:
            events.append((f"Xid {x}", True))
        else:
            v.notes = [*v.notes[-4:], f"Xid {x} (an application error; the GPU stays in service)"]
    if not r.lost and r.error is None:
        if r.ecc_uncorrected is not None and v.ecc is not None and r.ecc_uncorrected > v.ecc:
            events.append((f"{r.ecc_uncorrected - v.ecc} new uncorrectable ECC error(s)", False))
        if r.ecc_uncorrected is not None:
            v.ecc = r.ecc_uncorrected
        v.throttle, v.memory_total = list(r.throttle), r.memory_total
        v.foreign = [(pid, b) for pid, b in r.processes if ours is None or pid not in ours]
    for _ in events:
        v.faults.append(now)
    while v.faults and v.faults[0] < now - rules.fault_window_s:
        v.faults.popleft()
    fatal = any(f for _, f in events)
    if events:
        v.reason = "; ".join(w for w, _ in events)
        v.fatal = v.fatal or fatal
        v.clean_since = None
        if len(v.faults) >= rules.max_faults:
            v.state = HELD
        elif v.state == OK:
            v.state = QUARANTINED
    elif v.state == QUARANTINED and cond is None:
        if v.clean_since is None:
            v.clean_since = now
        if now - v.clean_since >= rules.recover_s:
            v.state, v.clean_since, v.fatal = OK, None, False
    elif cond is not None:
        v.clean_since = None
    if v.state != before:
        v.since = now
        return Change(v.gpu, before, v.state, v.reason if v.state != OK else "healthy again", fatal)
    if events and v.state != OK:  # a new fault on a GPU already out: said, and it still counts
        return Change(v.gpu, before, v.state, v.reason, fatal)
    return None


def clear(v: GpuVerdict, now: float) -> Change | None:
    """`lorad gpu clear N`: its faults forgotten; ok again unless a condition (lost, ...) still holds."""
    before = v.state
    v.faults.clear()
    v.clean_since = None
    v.state = QUARANTINED if v.condition is not None else OK
    if v.condition is None:
        v.reason, v.fatal = None, False
    if v.state != before:
        v.since = now
        return Change(v.gpu, before, v.state, "cleared by lorad gpu clear" if v.state == OK else v.reason, False)
    return None
