"""The seam between the supervisor and everything that decides *when* jobs may run (power, schedules, UPS).

The supervisor calls these hooks from its tick, in a fixed order; a policy
never touches processes itself — it returns a Decision and the supervisor acts
on it. `NullPolicy` is the default when no power features are configured.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Protocol


@dataclass
class RunningJob:
    job_id: str
    name: str
    pid: int
    gpu: int | None  # CUDA device index the trainer was given; None on a CPU-only machine
    started_at: float  # time.time() when this attempt started
    step: int = 0
    total: int = 0
    s_per_step: float | None = None
    power: dict[str, Any] = field(default_factory=dict)  # the job's `power` section (limit_w, max_slowdown)
    doc: dict[str, Any] = field(default_factory=dict)  # the whole job as accepted (state.db's copy; {}: unknown)


@dataclass
class Decision:
    may_start: bool = True  # False: start no new job (outside a run window, on battery, before an outage)
    stop_running: str | None = None  # a reason: SIGTERM every trainer (checkpoint, exit 75); jobs are requeued
    checkpoint_now: bool = False  # SIGUSR1 every trainer: commit a checkpoint now and keep training
    notes: list[str] = field(default_factory=list)  # human-readable reasons, shown in `lorad status`
    outage: bool = False  # the power is failing (UPS on battery): a host that goes down now is not the jobs' fault


class Policy(Protocol):
    def on_job_start(self, job: RunningJob) -> None: ...
    def on_heartbeat(self, job_id: str, event: dict[str, Any]) -> None: ...
    def on_job_end(self, job_id: str, exit_code: int | None) -> None: ...
    def tick(self, now: datetime, running: list[RunningJob]) -> Decision: ...
    def close(self) -> None: ...


class NullPolicy:
    def on_job_start(self, job: RunningJob) -> None:
        pass

    def on_heartbeat(self, job_id: str, event: dict[str, Any]) -> None:
        pass

    def on_job_end(self, job_id: str, exit_code: int | None) -> None:
        pass

    def tick(self, now: datetime, running: list[RunningJob]) -> Decision:
        return Decision()

    def close(self) -> None:
        pass
