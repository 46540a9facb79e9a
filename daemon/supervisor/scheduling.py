"""Priority, decided: who yields to a higher-priority job, and the order the queue will run in.

Pure functions of the jobs' priorities, arrivals and devices: no store, no processes, no clock of their own.
The supervisor's spawn step asks `to_preempt` when the first job in line cannot start; `lorad status` lists the
jobs in `status_order`. Tests walk both as tables (tests/daemon/supervisor/test_scheduling.py).

Preemption (daemon config `preempt: true`, the default): when the first job in line does not fit the free
devices and every device it would need runs work of strictly lower priority, the lowest-priority running jobs
(the most recently started first, among equals: the least work since their start) checkpoint and yield, just
enough of them to make room; they go back to the queue and resume later, with nothing counted against them.
Nobody yields when even all lower-priority work would not make room, or while earlier stops already will.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Runner:
    job_id: str
    priority: int
    devices: int  # how many devices it holds
    started_at: float
    stopping: bool = False  # already asked to stop (a pause, a drain, an earlier preemption): its devices free up


@dataclass(frozen=True)
class Waiter:
    job_id: str
    priority: int
    devices: int  # how many devices it needs at once


def to_preempt(first: Waiter | None, running: list[Runner], free: int, enabled: bool = True) -> list[str]:
    """The running jobs that should checkpoint and yield so that `first` (the first in line) can start."""
    if not enabled or first is None or free >= first.devices:
        return []
    soon = free + sum(r.devices for r in running if r.stopping)
    if soon >= first.devices:
        return []  # stops under way already make room
    lower = sorted((r for r in running if not r.stopping and r.priority < first.priority),
                   key=lambda r: (r.priority, -r.started_at))
    chosen = []
    for r in lower:
        chosen.append(r.job_id)
        soon += r.devices
        if soon >= first.devices:
            return chosen
    return []  # not enough lower-priority work to make room: nobody yields for nothing


STATE_RANK = {"running": 0, "queued": 1, "waiting": 2, "waiting_for_gpu": 2, "interrupted": 2, "fetching": 2,
              "paused": 3}  # the rest: last


def status_order(jobs: list[dict[str, Any]], now: float) -> list[dict[str, Any]]:
    """Running jobs, then the queue in the order it will run (ready jobs by priority, then arrival; those in a
    retry backoff after them, by when they may start), then waiting and paused ones, then finished jobs (by
    arrival)."""
    def key(j: dict[str, Any]):
        rank = STATE_RANK.get(j["state"], 4)
        if j["state"] == "queued":
            backoff = j["not_before"] > now
            return (rank, backoff, j["not_before"] if backoff else 0, -j["priority"], j["seq"])
        if rank == 4:
            return (rank, False, 0, 0, j["seq"])
        return (rank, False, 0, -j["priority"], j["seq"])

    return sorted(jobs, key=key)
