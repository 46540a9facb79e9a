"""The supervisor: the loop that decides what runs, and acts on what the trainers report.

`tick()` is the service loop's one step, with named sub-steps in a fixed order:

    reap        children that exited → succeeded / failed / retried / paused / ... (daemon/supervisor/exit_policy.py)
    heartbeats  progress lines from the children; hung trainers are killed
    gpus        GPU health: trainers on a quarantined GPU stopped, jobs waiting for a GPU requeued
                (daemon/supervisor/gpu_path.py)
    requests    pause / cancel / drain asked for over the socket → SIGTERM
    inbox       complete job files → accepted or rejected
    disk waits  jobs that found the disk full → queued again once their disk has the space (daemon/supervisor/disk_wait.py)
    policy      power, schedules, UPS (daemon/power/run_policy.py) → may_start, stop, checkpoint now
    spawn       a free device and the first queued job (priority, then arrival) → a new trainer

The reap step is daemon/supervisor/reap_path.py, the spawn step daemon/supervisor/start_path.py (both mixed
into Supervisor). One trainer's life (spawn, stdout, heartbeats, hang, reap) is daemon/supervisor/trainer.py; a job whose trainer.lock
someone else holds, daemon/supervisor/lock_contention.py; writes retried until they land, daemon/store/bookkeeping.py; what
systemd is told, daemon/supervisor/systemd_status.py; the clean stop, daemon/supervisor/shutdown.py.
"""

from __future__ import annotations

import signal
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from daemon.config.daemon import DaemonConfig
from daemon.power.run_policy import NullPolicy, Policy
from daemon.store import states
from daemon.store.bookkeeping import PendingWrites
from daemon.store.db import Store
from daemon.supervisor import disk_wait
from daemon.supervisor.beats import BeatQueue
from daemon.supervisor.gpu_path import GpuSupervision
from daemon.supervisor.lock_contention import TrainerLockContention
from daemon.supervisor.reap_path import ReapPath
from daemon.supervisor.shutdown import shut_down
from daemon.supervisor.start_path import StartPath, warm_trainer_for
from daemon.supervisor.stuck import StuckTrainers
from daemon.supervisor.systemd_status import SystemdReporter, status_line
from daemon.supervisor.trainer import Child
from daemon.supervisor.trainer_output import Refused
from daemon.system.log import job_event

PROGRESS_FLUSH_S = 1.0  # step heartbeats reach the DB at most this often (checkpoints at once)
INTAKE_PER_TICK = 50  # inbox files taken per tick at most, and for at most INTAKE_BUDGET_S
INTAKE_BUDGET_S = 0.5
COMPILE_FALLBACKS = 4  # compile_fallback events stored per attempt (one per block type; a model has one or two)
# While a trainer runs, intake takes at most this share of the loop's time: on a 2-core machine a flood taken
# back to back cost the training job 20% of its step time (bench/inbox_flood.py); rested, the flood takes longer.
INTAKE_SHARE_WHILE_TRAINING = 0.25


class Supervisor(ReapPath, StartPath, GpuSupervision):
    def __init__(self, home: Path, cfg: DaemonConfig, store: Store, devices: list[int | None], log,
                 intake=None, inbox=None, policy: Policy | None = None, notifier=None, notifications=None,
                 prune_rejected=None, mirrors=None, health=None):
        self.home = Path(home)
        self.cfg = cfg
        self.store = store
        self.devices = devices
        self.log = log
        self.intake = intake
        self.inbox = inbox
        self.prune_rejected = prune_rejected  # daemon.intake.prune.RejectedPruner: called from the inbox step
        self.policy: Policy = policy or NullPolicy()
        self.notifier = notifier
        self.notifications = notifications  # daemon.supervisor.notifications.Notifications: webhook / command per event
        self.mirrors = mirrors  # daemon.mirror.service.Mirrors: told of commits and successes, never waited for
        self.health = health  # daemon.gpu_health.watcher.HealthWatcher: GPUs that are out are not scheduled
        self.gpu_notes: dict[str, str] = {}
        self.children: dict[str, Child] = {}
        self.pending = PendingWrites(log)  # job id → bookkeeping not yet written (trainer already gone)
        self.locks = TrainerLockContention(self.home, store, log)
        self.stuck = StuckTrainers(log)  # trainers that outlived SIGKILL; their GPUs are not scheduled
        self.systemd = SystemdReporter(notifier)
        self.beats = BeatQueue()
        self._beats_lost_said = False
        self.may_start = True
        self.notes: list[str] = []
        self.shutting_down = False
        self._checkpoint_now_prev = False
        self._outage_recorded = False
        self._next_intake_retry = 0.0
        self._intake_rest_until = 0.0  # a flood while trainers run: the next batch not before this (monotonic)
        self._backlog: dict[Path, None] = {}  # inbox files found but not taken yet, oldest first
        self._next_disk_poll = 0.0
        self.free_bytes = disk_wait.free_bytes  # path → free bytes on its filesystem (tests give their own)
        self.healthy = True
        self.warm = warm_trainer_for(cfg, log)  # started when a job is queued (daemon/supervisor/warm_trainer.py)
        self.wake = threading.Event()
        self._step_errors: dict[str, tuple[str, int]] = {}  # step → (its failure as logged, failures since)

    # ================================================================ the tick
    def tick(self) -> None:
        ok = all([
            self._step("reap", self.reap),
            self._step("heartbeats", self.heartbeats),
            self._step("gpus", self._gpus),
            self._step("requests", self._requests),
            self._step("inbox", self._inbox),
            self._step("disk waits", self._disk_waits),
            self._step("policy", self._policy),
            self._step("spawn", self._spawn),
        ])
        # The systemd watchdog is fed only after a tick whose steps all worked.
        self.healthy = ok
        self._step("notify", lambda: self.systemd.report(self.healthy, self.status_line))

    def _step(self, name: str, fn) -> bool:
        # One failing step must not stop the others (or the loop); a loop that keeps failing stops feeding
        # the watchdog, and systemd restarts the daemon.
        try:
            fn()
        except Exception as e:  # noqa: BLE001
            error = f"{type(e).__name__}: {e}"
            prev, n = self._step_errors.get(name, (None, 0))
            self._step_errors[name] = (error, n + 1)
            if error != prev:  # once per step and cause (a full disk under state.db fails every tick, 4× a second)
                self.log.error("tick_step_failed", exc_info=True, step=name, error=error,
                               message="said once; said again when the cause changes or the step recovers")
            return False
        if (failed := self._step_errors.pop(name, None)) is not None:
            self.log.info("tick_step_recovered", step=name, failed_ticks=failed[1], last_error=failed[0])
        return True

    # ---------------------------------------------------------------- telling others
    def _tell(self, event: str, job_id: str, name: str, **detail: Any) -> None:
        """A notification (webhook / command); only queued here, delivered on the notifier's own thread."""
        if self.notifications is not None:
            self.notifications.emit(event, job_id, name, **detail)

    def _tell_policy(self, hook: str, *args: Any) -> None:
        try:
            getattr(self.policy, hook)(*args)
        except Exception as e:  # noqa: BLE001 — power features must never stop training
            self.log.error("policy_failed", hook=hook, error=str(e))

    # ---------------------------------------------------------------- heartbeats
    def heartbeats(self) -> None:
        now = time.monotonic()
        try:
            self._drain_beats(now)
        finally:
            # Hang and stop deadlines hold even while the store refuses writes.
            for c in self.children.values():
                if c.check_hung(now, self.cfg):
                    self.log.warning("trainer_hung", job=c.job_id, pid=c.pid, message=c.last_error)
                if c.overdue(now):
                    self.log.warning("trainer_kill", job=c.job_id, why=f"did not stop within {self.cfg.stop_grace_s} s")
            for c in list(self.children.values()):
                if c.outlived_kill(now, self.cfg.kill_wait_s):
                    self._give_up_on(c)
        for c in self.children.values():
            if not c.pid_recorded:
                self.store.record_trainer(c.job_id, c.attempt, c.pid, c.pid_start)
                c.pid_recorded = True
            if c.dirty and (now - c.flushed_at >= PROGRESS_FLUSH_S):
                self._flush(c)

    def _drain_beats(self, now: float) -> None:
        self._say_beats_lost()
        while (item := self.beats.pop()) is not None:
            job_id, attempt, ev = item
            c = self.children.get(job_id)
            if c is None or c.attempt != attempt:
                continue
            if isinstance(ev, Refused):  # the first of its kind this attempt; the rest are only counted
                self.log.warning("trainer_output_refused", job=job_id, kind=ev.kind, reason=ev.reason,
                                 message="said once per kind and attempt; the line is dropped, the job goes on")
                job_event(c.workdir, job_id, "trainer_output_refused", level="warning", kind=ev.kind,
                          reason=ev.reason)
                continue
            self._beat(c, ev, now)

    def _say_beats_lost(self) -> None:
        if self._beats_lost_said or not (self.beats.merged or self.beats.dropped):
            return
        self._beats_lost_said = True
        self.log.warning("heartbeats_dropped", merged_steps=self.beats.merged, dropped=self.beats.dropped,
                         limit=self.beats.limit, message="the heartbeat queue was full (the loop fell behind its "
                         "trainers): oldest step events dropped for later ones first; said once")

    def _beat(self, c: Child, ev: dict[str, Any], now: float) -> None:
        kind = ev.get("event")
        checkpoint = c.heard(ev, now)
        if checkpoint:
            self.store.update(c.job_id, **checkpoint)
            if self.mirrors is not None:
                self.mirrors.committed(c.job_id, checkpoint["checkpoint_step"])
        if kind in ("resumed", "step") and not c.training_recorded:
            self.store.attempt_training(c.job_id, c.attempt, c.start_step)
            c.training_recorded = True
        if kind == "phase" and ev.get("phase") == "final_checkpoint" and self.shutting_down \
                and self.notifier is not None:
            self.notifier.extend_timeout(self.cfg.stop_grace_s)
        if kind == "checkpoint_slow":
            self._tell("checkpoint_slow", c.job_id, c.name, step=ev.get("step"), seconds=ev.get("seconds"))
        if kind == "compile_fallback" and c.compile_fallbacks < COMPILE_FALLBACKS:
            # A block type the trainer runs eagerly now (engine/frozen_base/compiling.py): kept for `lorad status
            # JOB`. Said once per block type by the engine; bounded here, as every trainer line is.
            c.compile_fallbacks += 1
            self.store.event(c.job_id, "compile_fallback", block=str(ev.get("block"))[:100],
                             reason=str(ev.get("reason"))[:300])
        if c.dirty and kind != "step":
            self._flush(c)
        self._tell_policy("on_heartbeat", c.job_id, ev)

    def _flush(self, c: Child) -> None:
        self.store.update(c.job_id, **c.progress())
        c.dirty = False
        c.flushed_at = time.monotonic()

    # ---------------------------------------------------------------- requests
    def _requests(self) -> None:
        draining = self.store.get_meta("drain") == "1"
        for c in list(self.children.values()):
            if c.stop_reason is not None:
                continue
            if draining:
                self.stop(c, "drain")
                continue
            req = self.store.get(c.job_id)["requested"]
            if req in ("pause", "cancel"):
                self.stop(c, req)

    def stop(self, c: Child, reason: str) -> None:
        """SIGTERM: the trainer finishes its step, commits a checkpoint and exits 75; SIGKILL after the grace."""
        if not c.stopping(reason, self.cfg.stop_grace_s):
            return
        self.log.info("trainer_stop", job=c.job_id, reason=reason)
        job_event(c.workdir, c.job_id, "stop_requested", reason=reason)
        c.signal(signal.SIGTERM)

    # ---------------------------------------------------------------- inbox
    def _inbox(self) -> None:
        if self.inbox is None or self.intake is None:
            return
        # A flood of files (10,000 dropped at once) is taken a budget at a time: the loop goes on serving
        # heartbeats, requests and the watchdog between batches, and each file is taken once (the backlog is
        # deduplicated against the inbox's rescans, which find files not taken yet again).
        for path in self.inbox.poll():
            if path not in self._backlog:
                self._backlog[path] = None
        if self._backlog and time.monotonic() >= self._intake_rest_until:
            self._take_batch()
        self.intake.poll_pending()  # files whose checks run off the loop (daemon/intake/checks.py)
        # A file that could not be taken (disk full, ...) waits in incoming/ (or in the inbox, for the next
        # rescan); it is tried again every inbox_rescan_s, and `lorad status` says it is stuck and why.
        now = time.monotonic()
        if self.intake.stuck and now >= self._next_intake_retry:
            self._next_intake_retry = now + self.cfg.inbox_rescan_s
            self.intake.recover()
        if self.prune_rejected is not None:
            self.prune_rejected(now)  # rejected/ kept to an age and a count (daemon/intake/prune.py)

    def _take_batch(self) -> None:
        started = time.monotonic()
        for _ in range(min(len(self._backlog), INTAKE_PER_TICK)):
            path = next(iter(self._backlog))
            del self._backlog[path]
            self.intake.take(path)
            if time.monotonic() >= started + INTAKE_BUDGET_S:
                break
        if not self._backlog:
            return
        if self.children:  # rest, so that the batches take at most their share beside the trainers
            spent = time.monotonic() - started
            self._intake_rest_until = time.monotonic() + spent * (1 / INTAKE_SHARE_WHILE_TRAINING - 1)
        else:
            self.wake.set()  # more to take: the next tick comes at once, after the other steps

    # ---------------------------------------------------------------- disk waits
    def _disk_waits(self) -> None:
        """Jobs that found the disk full go back in the queue once their disk has the space they need."""
        now = time.monotonic()
        if now < self._next_disk_poll:
            return
        self._next_disk_poll = now + disk_wait.DISK_POLL_S
        for job in self.store.jobs((states.WAITING,)):
            try:
                free = self.free_bytes(Path(job["workdir"]))
            except OSError:
                continue  # its directory is unreachable now: keep waiting
            need = job["wait_bytes"] or disk_wait.NO_CHECKPOINT_NEED_BYTES
            if free < need:
                continue
            self.store.transition(job["id"], states.WAITING, states.QUEUED, f"disk space is back ({free} bytes free)",
                                  not_before=0, wait_bytes=None)
            self.log.info("disk_space_back", job=job["id"], free_bytes=free, needed_bytes=need)
            job_event(Path(job["workdir"]), job["id"], "requeued", reason="disk space is back", free_bytes=free)

    # ---------------------------------------------------------------- policy
    def _policy(self) -> None:
        running = [c.running_job() for c in self.children.values()]
        d = self.policy.tick(datetime.now(timezone.utc), running)
        self.may_start = d.may_start
        self.notes = [*self.stuck.notes(), *d.notes]
        if d.outage != self._outage_recorded:
            # For the next start-up: jobs cut off while the UPS said the power was failing resume uncounted.
            self.store.set_meta("power_outage", "1" if d.outage else "0")
            self._outage_recorded = d.outage
        if d.stop_running:
            for c in list(self.children.values()):
                self.stop(c, f"policy: {d.stop_running}")
        # On the rising edge only: a policy that keeps saying "checkpoint now" must not make a save per tick.
        if d.checkpoint_now and not self._checkpoint_now_prev:
            for c in self.children.values():
                self.log.info("checkpoint_now", job=c.job_id, notes=d.notes)
                c.signal(signal.SIGUSR1)
        self._checkpoint_now_prev = d.checkpoint_now

    # ---------------------------------------------------------------- systemd status, shutdown
    def status_line(self) -> str:
        return status_line(self.children.values(), queued=len(self.store.jobs((states.QUEUED,))),
                           draining=self.store.get_meta("drain") == "1",
                           stuck=self.intake.stuck if self.intake is not None else [], notes=self.notes)

    def shutdown(self, deadline_s: float) -> None:
        """SIGTERM every trainer, reap them as they checkpoint and exit, SIGKILL what is left at the deadline."""
        shut_down(self, deadline_s)
        if self.warm is not None:
            self.warm.close()
        if self.mirrors is not None:
            self.mirrors.close()
