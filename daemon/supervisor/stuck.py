"""Trainers that outlive SIGKILL: a process in an uninterruptible call (a hung GPU driver) never dies.

Nothing waits for such a process: every wait for an exit is bounded (`kill_wait_s` after the SIGKILL). Past
it, the process is given up on and listed here with its pid and GPUs: one error line in the log, one event
in its job's events.jsonl, a note in `lorad status` and in systemd's STATUS, and its GPUs stay out of
scheduling until the process is gone (it may still hold their memory). Its job is settled like a crash and
waits on its trainer.lock, which the stuck process still holds, so it never gets a second trainer. The other
GPUs keep serving, and each tick looks again whether the process has gone.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from daemon.system import proc
from daemon.system.log import job_event


@dataclass
class StuckTrainer:
    pid: int
    start: int | None  # /proc start time: the identity, so a reused pid is not taken for it
    devices: list[int | None]
    job_id: str | None
    workdir: Path | None
    kill_wait_s: float
    since: float = field(default_factory=time.time)

    def gpus_text(self) -> str:
        gpus = [d for d in self.devices if d is not None]
        return "GPU " + ", ".join(map(str, gpus)) if gpus else "the CPU slot"


def describe(s: StuckTrainer) -> str:
    return (f"stuck: trainer pid {s.pid}{f' of job {s.job_id}' if s.job_id else ''} did not exit "
            f"{s.kill_wait_s:g} s after SIGKILL (a hung driver?); {s.gpus_text()} kept out of scheduling until it is "
            "gone")


class StuckTrainers:
    def __init__(self, log):
        self.log = log
        self._by_pid: dict[int, StuckTrainer] = {}
        self._lock = threading.Lock()  # `lorad status` reads it from a connection thread

    def add(self, s: StuckTrainer) -> str:
        """Give up on a process that outlived SIGKILL; returns the one-line description that was reported."""
        with self._lock:
            self._by_pid[s.pid] = s
        msg = describe(s)
        self.log.error("trainer_stuck", pid=s.pid, job=s.job_id, devices=s.devices, message=msg)
        if s.workdir is not None and s.job_id is not None:
            job_event(s.workdir, s.job_id, "trainer_stuck", level="error", pid=s.pid, devices=s.devices, message=msg)
        return msg

    def sweep(self) -> None:
        """Forget those that have gone at last (collecting the exit of our own children), freeing their GPUs."""
        with self._lock:
            entries = list(self._by_pid.values())
        for s in entries:
            try:
                os.waitpid(s.pid, os.WNOHANG)  # our child: collect it once it is a zombie; never blocks
            except ChildProcessError:
                pass
            if proc.alive(s.pid, s.start):
                continue
            with self._lock:
                self._by_pid.pop(s.pid, None)
            self.log.info("stuck_trainer_gone", pid=s.pid, job=s.job_id, devices=s.devices,
                          stuck_s=round(time.time() - s.since, 1))
            if s.workdir is not None and s.job_id is not None:
                job_event(s.workdir, s.job_id, "stuck_trainer_gone", pid=s.pid, devices=s.devices)

    def devices(self) -> set[int | None]:
        with self._lock:
            return {d for s in self._by_pid.values() for d in s.devices}

    def notes(self) -> list[str]:
        with self._lock:
            return [describe(s) for s in self._by_pid.values()]
