"""Job states and the one table of allowed transitions. Depends on nothing.

`Store.transition()` checks this table and writes the change in the same
SQLite transaction; anything not listed here raises IllegalTransition.
"""

from __future__ import annotations

QUEUED = "queued"
RUNNING = "running"
PAUSED = "paused"
INTERRUPTED = "interrupted"
WAITING = "waiting"
SUCCEEDED = "succeeded"
FAILED = "failed"
CANCELLED = "cancelled"
FETCHING = "fetching"  # lorad submit --from: its checkpoint is being downloaded from the mirror
WAITING_FOR_GPU = "waiting_for_gpu"  # its GPU was quarantined (daemon/gpu_health/): waits for a healthy one

STATES = (QUEUED, RUNNING, PAUSED, INTERRUPTED, WAITING, SUCCEEDED, FAILED, CANCELLED, FETCHING, WAITING_FOR_GPU)
FINAL = frozenset({SUCCEEDED, FAILED, CANCELLED})

# (from, to) -> when it happens. The only place a job's state may change.
TRANSITIONS: dict[tuple[str, str], str] = {
    (QUEUED, RUNNING): "a device is free and the job is first in line (priority, then arrival)",
    (QUEUED, PAUSED): "lorad pause on a job that has not started",
    (QUEUED, CANCELLED): "lorad cancel",
    (QUEUED, FAILED): "its job directory is gone or unreadable: no trainer can start",
    (RUNNING, SUCCEEDED): "the trainer exited 0 with its adapter written",
    (RUNNING, FAILED): "exit 65 (invalid job), or the retry budget is spent",
    (RUNNING, QUEUED): "the trainer crashed or hung; retried after a backoff",
    (RUNNING, INTERRUPTED): "daemon shutdown or restart, power policy, drain, outage, preempted by higher priority",
    (RUNNING, WAITING): "exit 74, disk full: waits for free space; never counted as a crash",
    (WAITING, QUEUED): "free space is back on the job's disk (or lorad retry)",
    (WAITING, PAUSED): "lorad pause while it waits",
    (WAITING, CANCELLED): "lorad cancel while it waits",
    (FAILED, QUEUED): "lorad retry: resumes from its last checkpoint with a fresh retry budget",
    (RUNNING, PAUSED): "lorad pause: the trainer checkpointed and exited",
    (RUNNING, CANCELLED): "lorad cancel: the trainer was stopped",
    (INTERRUPTED, QUEUED): "requeued at once to resume from its last checkpoint",
    (INTERRUPTED, CANCELLED): "lorad cancel while interrupted",
    (PAUSED, QUEUED): "lorad resume",
    (PAUSED, CANCELLED): "lorad cancel",
    (FETCHING, QUEUED): "its checkpoint is downloaded from the mirror and verified (lorad submit --from)",
    (FETCHING, FAILED): "the mirror's checkpoints are refused (another job's settings, a newer lorad's format)",
    (FETCHING, CANCELLED): "lorad cancel while it downloads",
    (FAILED, FETCHING): "lorad retry of a job brought over with --from whose checkpoint never landed: downloads again",
    (RUNNING, WAITING_FOR_GPU): "its GPU was quarantined (lost, Xid, ECC, unknown error): never counted as a crash",
    (WAITING_FOR_GPU, QUEUED): "enough healthy GPUs again (another one, or this one back or cleared)",
    (WAITING_FOR_GPU, PAUSED): "lorad pause while it waits for a GPU",
    (WAITING_FOR_GPU, CANCELLED): "lorad cancel while it waits for a GPU",
}

# The one way out of a final state: a person asks for it (`lorad retry`); the daemon never leaves one by itself.
REOPEN = frozenset({(FAILED, QUEUED), (FAILED, FETCHING)})


class IllegalTransition(Exception):
    pass


def check(src: str, dst: str) -> str:
    """Return why (src → dst) is allowed, or raise IllegalTransition."""
    why = TRANSITIONS.get((src, dst))
    if why is None:
        raise IllegalTransition(f"a job cannot go from {src} to {dst}")
    return why
