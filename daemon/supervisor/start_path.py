"""The supervisor's start path: the first queued job that fits on free devices → a new trainer.

Part of the Supervisor (daemon/supervisor/loop.py), which owns the state these methods use: the store, the
children, the pending writes, the devices. A job that cannot start on this machine fails here; one whose gang is
not free yet waits (and may make lower-priority work yield, daemon/supervisor/scheduling.py).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

from daemon.config.daemon import ConfigInvalid
from daemon.store import states
from daemon.supervisor import cluster, gang, scheduling, trainer
from daemon.supervisor.accepted_job import accepted_doc
from daemon.supervisor.lock_contention import LOCK_BUSY_RETRY_S
from daemon.supervisor.trainer import Child
from daemon.supervisor.warm_trainer import WarmTrainer, forkable
from daemon.system import proc
from daemon.system import trainer_user as trainer_user_mod
from daemon.system.lock import write_pid
from daemon.system.log import job_event
from engine.memory_plan.attempt import PLAN_ENV


def warm_trainer_for(cfg, log) -> WarmTrainer | None:
    """The daemon's warm trainer (not started yet): the trainer's environment and user; None when it is off."""
    if not cfg.warm_trainer:
        return None
    try:
        run_as = trainer_user_mod.resolve(cfg.trainer_user, os.geteuid())
    except ConfigInvalid:
        return None  # every start fails the same way, cold
    env = trainer.trainer_env(cfg.trainer_env, [None])
    kwargs = {}
    if run_as is not None:
        env, kwargs = {**env, **run_as.env()}, run_as.popen_kwargs()
    return WarmTrainer(env, kwargs, log=log.info)


class StartPath:
    """The spawn step and starting one trainer; mixed into Supervisor."""

    @property
    def longest_backoff_s(self) -> float:
        """The longest the daemon holds a queued job back on purpose: a crash's backoff, a busy trainer.lock."""
        return max(self.cfg.backoff_max_s, self.cfg.backoff_base_s, LOCK_BUSY_RETRY_S)

    def _spawn(self) -> None:
        if self.shutting_down or not self.may_start or self.store.get_meta("drain") == "1":
            return
        busy = {d for c in self.children.values() for d in c.devices} | self.pending.gpus() | self.stuck.devices()
        tried: set[str] = set()
        while True:
            job = self.store.next_queued(time.time(), longest_wait=self.longest_backoff_s)
            if job is None or job["id"] in tried:
                return
            if self.warm is not None and forkable(self.trainer_command(Path(job["workdir"]))):
                self.warm.ensure()  # a job could start: the zygote imports in the background
                if self.warm.warming():
                    return  # forked in a moment beats importing everything again in a cold trainer
            tried.add(job["id"])
            doc = accepted_doc(self.store, job)  # never jobs/ID/job.yaml: the trainer user may replace it
            gpus = gang.job_gpus(doc)
            busy |= self.gpu_out()  # quarantined GPUs (daemon/gpu_health/)
            short = self.vram_short(doc, [d for d in self.devices if d not in busy])
            plan = gang.plan_starts([gang.Want(job["id"], gpus)], self.devices, busy | set(short))
            if short and not plan.starts and not plan.impossible \
                    and gang.plan_starts([gang.Want(job["id"], gpus)], self.devices, busy).starts:
                self._say_vram_wait(job, short)  # gpu_memory_policy: wait; the jobs behind it wait too
                return
            if plan.impossible:
                self._fail_unstartable(job, f"resources.gpus: the job needs {gpus} devices at once and this machine "
                                            f"has {len(self.devices)} (daemon devices: {self.devices})")
                continue
            if (why := cluster.unrunnable(doc, Path(job["workdir"]), self.cfg.cluster)) is not None:
                self._fail_unstartable(job, why)
                continue
            if not plan.starts:
                # The first in line waits for a whole gang, holding no device; the jobs behind it wait too. If
                # lower-priority work holds the devices it needs, that work yields (daemon/supervisor/scheduling.py).
                if len(tried) == 1:
                    self._preempt_for(job, gpus, busy)
                return
            devs = plan.starts[0][1]
            if self.start(job, devs, gpus, doc):
                busy |= set(devs)
            # Not started (its directory is unusable, an earlier trainer holds it, ...): the next in line
            # may use these devices; start() left that job out of next_queued's answer.

    def _preempt_for(self, job: dict[str, Any], gpus: int, busy: set) -> None:
        if not self.cfg.preempt:
            return
        prio = {j["id"]: j["priority"] for j in self.store.jobs((states.RUNNING,))}
        running = [scheduling.Runner(c.job_id, prio.get(c.job_id, 0), len(c.devices), c.started_at,
                                     stopping=c.stop_reason is not None) for c in self.children.values()]
        need = 1 if self.devices == [None] else gpus
        free = len([d for d in self.devices if d not in busy])
        for jid in scheduling.to_preempt(scheduling.Waiter(job["id"], job["priority"], need), running, free):
            self.log.info("preempt", job=jid, priority=prio.get(jid, 0), for_job=job["id"], for_priority=job["priority"])
            self.stop(self.children[jid], f"preempt: yields to {job['id']} (priority {job['priority']})")

    def _fail_unstartable(self, job: dict[str, Any], msg: str) -> None:
        self.store.transition(job["id"], states.QUEUED, states.FAILED, msg, last_error=msg)
        self.log.error("job_unstartable", job=job["id"], error=msg)
        self._tell("failed", job["id"], job["name"], state=states.FAILED, reason=msg, workdir=str(job["workdir"]))

    def start(self, job: dict[str, Any], devs: list[int | None], processes: int = 1,
              doc: dict[str, Any] | None = None) -> bool:
        """Start a trainer for a queued job on `devs` (its gang) with `processes` ranks. True if one runs now (and
        is tracked in self.children). `doc`: the job as accepted (read from the store when not given)."""
        job_id, workdir = job["id"], Path(job["workdir"])
        try:
            lock_fd = self.locks.take(job_id, workdir)
        except OSError as e:
            msg = f"cannot use the job directory {workdir}: {e.strerror or e}"
            self.store.transition(job_id, states.QUEUED, states.FAILED, msg, last_error=msg)
            self.log.error("job_dir_unusable", job=job_id, error=msg)
            self._tell("failed", job_id, job["name"], state=states.FAILED, reason=msg, workdir=str(workdir))
            return False
        if lock_fd is None:
            return False  # an earlier trainer holds it: the job waits (lock_contention)
        try:
            return self._start_locked(job, devs, processes, lock_fd,
                                      accepted_doc(self.store, job) if doc is None else doc)
        finally:
            os.close(lock_fd)  # a started child has its own copy: it keeps the lock for as long as it lives

    def trainer_command(self, workdir: Path) -> list[str]:
        return trainer.trainer_command(workdir, self.cfg.job_policy(self.home))

    def _start_locked(self, job: dict[str, Any], devs: list[int | None], processes: int, lock_fd: int,
                      doc: dict[str, Any]) -> bool:
        job_id, workdir = job["id"], Path(job["workdir"])
        dev = devs[0]
        try:
            # QUEUED → RUNNING and the attempt row: one transaction, so a failed write leaves the job queued.
            n = self.store.begin_attempt(job_id, job["step"], gpu=dev, not_before=0)
        except states.IllegalTransition:
            return False  # paused or cancelled over the socket in the meantime
        self.locks.started(job_id)
        env = trainer.trainer_env(self.cfg.trainer_env, devs, workdir)
        env.update(self.vram_budget_env(job_id, workdir, devs))  # gpu_memory_policy: plan
        if job.get("memory"):  # floors after an out-of-memory (daemon/supervisor/oom_replan.py): this attempt's input
            env[PLAN_ENV] = job["memory"]
        shutil.rmtree(workdir / trainer.RANKS_DIR, ignore_errors=True)  # the last attempt's: not this one's ranks
        power = trainer.power_section(doc)
        try:
            # Several processes: torchrun through engine.launch, which keeps this contract (one exit code, signals
            # forwarded to every rank, no rank outliving it).
            cmd = cluster.launch_command(self.trainer_command(workdir), doc, workdir, processes, self.cfg.cluster)
            popen = trainer.spawn(cmd, workdir, env, lock_fd, self.cfg, self.warm)
        except OSError as e:
            msg = f"could not start the trainer: {e}"
            self.log.error("spawn_failed", job=job_id, error=msg)
            # A trainer user that cannot enter the job directory: every retry would fail the same way.
            to = states.FAILED if isinstance(e, trainer.CannotEnter) else states.QUEUED
            p = self.pending.add(job_id, devs, "failed start",
                                 lambda: self._requeue_unstarted(job_id, job["step"], msg, to))
            self.pending.settle(p)  # if this write fails too, the next tick's reap tries again
            return False
        # The trainer runs: track it (and read its stdout) before anything else can fail.
        c = Child(job_id=job_id, name=job["name"], workdir=workdir, popen=popen, pid=popen.pid,
                  pid_start=proc.start_time(popen.pid), gpu=dev, attempt=n, start_step=job["step"],
                  total=job["total"], power=power, step=job["step"], checkpoint_step=job["checkpoint_step"],
                  devices=devs, doc=doc)
        self.children[job_id] = c
        c.start_reader(self.beats, self.wake)
        try:
            write_pid(lock_fd, popen.pid)  # so that a refused `lorad run` can name the holder
        except OSError:
            pass
        try:
            self.store.record_trainer(job_id, n, popen.pid, c.pid_start)
            c.pid_recorded = True
        except Exception as e:  # noqa: BLE001 — heartbeats retry it every tick
            self.log.error("pid_not_recorded", job=job_id, pid=popen.pid, error=f"{type(e).__name__}: {e}")
        self.log.info("trainer_started", job=job_id, pid=popen.pid, attempt=n, gpu=dev, devices=devs,
                      processes=processes, warm=not isinstance(popen, subprocess.Popen))
        job_event(workdir, job_id, "attempt_started", attempt=n, pid=popen.pid, gpu=dev)
        self._tell_policy("on_job_start", c.running_job())
        return True

    def _requeue_unstarted(self, job_id: str, step: int, msg: str, to: str = states.QUEUED) -> None:
        fields = dict(last_error=msg, gpu=None, pid=None, pid_start=None,
                      not_before=time.time() + self.cfg.backoff_base_s)
        self.store.end_run(job_id, None, step, msg, lambda job: ([(to, msg, fields)], None))
