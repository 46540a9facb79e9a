"""The supervisor: the loop that decides what runs, and acts on what the trainers report.

`tick()` is the service loop's one step, with named sub-steps in a fixed order:

    reap        children that exited → succeeded / failed / retried / paused / ... (daemon/supervisor/exit_policy.py)
    heartbeats  progress lines from the children; hung trainers are killed
    requests    pause / cancel / drain asked for over the socket → SIGTERM
    inbox       complete job files → accepted or rejected
    disk waits  jobs that found the disk full → queued again once their disk has the space (daemon/supervisor/disk_wait.py)
    policy      power, schedules, UPS (daemon/power/run_policy.py) → may_start, stop, checkpoint now
    spawn       a free device and the first queued job (priority, then arrival) → a new trainer

One trainer's life (spawn, stdout, heartbeats, hang, reap) is daemon/supervisor/trainer.py; a job whose trainer.lock
someone else holds, daemon/supervisor/lock_contention.py; writes retried until they land, daemon/store/bookkeeping.py; what
systemd is told, daemon/supervisor/systemd_status.py; the clean stop, daemon/supervisor/shutdown.py.
"""

from __future__ import annotations

import os
import queue
import shutil
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
from daemon.supervisor import cluster, disk_wait, gang, scheduling, trainer
from daemon.supervisor.exit_policy import decide_exit, describe_exit
from daemon.supervisor.lock_contention import TrainerLockContention
from daemon.supervisor.notifications import event_of_exit
from daemon.supervisor.shutdown import shut_down
from daemon.supervisor.stuck import StuckTrainer, StuckTrainers
from daemon.supervisor.systemd_status import SystemdReporter, status_line
from daemon.supervisor.trainer import Child
from daemon.system import proc
from daemon.system.lock import write_pid
from daemon.system.log import job_event
from engine.training.stop import EXIT_STOPPED

PROGRESS_FLUSH_S = 1.0  # step heartbeats reach the DB at most this often (checkpoints at once)


class Supervisor:
    def __init__(self, home: Path, cfg: DaemonConfig, store: Store, devices: list[int | None], log,
                 intake=None, inbox=None, policy: Policy | None = None, notifier=None, notifications=None):
        self.home = Path(home)
        self.cfg = cfg
        self.store = store
        self.devices = devices
        self.log = log
        self.intake = intake
        self.inbox = inbox
        self.policy: Policy = policy or NullPolicy()
        self.notifier = notifier
        self.notifications = notifications  # daemon.supervisor.notifications.Notifications: webhook / command per event
        self.children: dict[str, Child] = {}
        self.pending = PendingWrites(log)  # job id → bookkeeping not yet written (trainer already gone)
        self.locks = TrainerLockContention(self.home, store, log)
        self.stuck = StuckTrainers(log)  # trainers that outlived SIGKILL; their GPUs are not scheduled
        self.systemd = SystemdReporter(notifier)
        self.beats: queue.Queue = queue.Queue()
        self.may_start = True
        self.notes: list[str] = []
        self.shutting_down = False
        self._checkpoint_now_prev = False
        self._outage_recorded = False
        self._next_intake_retry = 0.0
        self._next_disk_poll = 0.0
        self.free_bytes = disk_wait.free_bytes  # path → free bytes on its filesystem (tests give their own)
        self.healthy = True
        self.wake = threading.Event()
        self._step_errors: dict[str, tuple[str, int]] = {}  # step → (its failure as logged, failures since)

    # ================================================================ the tick
    def tick(self) -> None:
        ok = all([
            self._step("reap", self.reap),
            self._step("heartbeats", self.heartbeats),
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

    # ---------------------------------------------------------------- reap
    def reap(self) -> None:
        self.stuck.sweep()
        for job_id, c in list(self.children.items()):
            code = c.reap()
            if code is None:
                continue
            self._drain_beats(time.monotonic())
            # Gone: never signal it again (its pid may belong to someone else soon). Its job stays `running`
            # in the store until the exit is written, which the pending writes retry until it succeeds.
            del self.children[job_id]
            self.pending.add(job_id, c.devices, "trainer exit", lambda c=c, code=code: self._finish(c, code))
        self.pending.settle_all()

    def _finish(self, c: Child, code: int | None) -> None:
        error = c.exit_error(code)

        def plan(job: dict[str, Any]):
            # Runs inside the store's transaction, on the job as it is now: a pause or cancel that lands while
            # the exit is being written is either seen here or refused afterwards, never lost in between.
            stop_reason = None if c.stop_reason == "hung" else c.stop_reason
            if job["requested"] in ("pause", "cancel"):
                # The user's latest word wins over drain, a power policy or shutdown (and over an earlier pause),
                # and over an exit the trainer came to on its own just before the stop.
                stop_reason = job["requested"]
            elif stop_reason is None and self.shutting_down and code == EXIT_STOPPED:
                stop_reason = "shutdown"  # SIGTERM reached it with ours (systemd signals the whole unit)
            d = decide_exit(code, stop_reason, job["retries"], self.cfg, error, progressed=c.new_checkpoint)
            fields: dict[str, Any] = dict(pid=None, pid_start=None, gpu=None, step=c.step, retries=d.crashes,
                                          requested=None, last_error=error if error else job["last_error"])
            if d.state == states.WAITING:
                fields["wait_bytes"] = disk_wait.bytes_needed(c.workdir)
            if d.state == states.SUCCEEDED:
                fields.update(output=str(c.workdir / "output"), eta_s=0.0, last_error=None)
            if d.retry_in is not None:
                fields["not_before"] = time.time() + d.retry_in
            moves = [(d.state, d.reason, fields)]
            if d.state == states.INTERRUPTED and not self.shutting_down:
                # Interrupted is a waypoint: back in the queue at once (same transaction), resumed from its
                # last checkpoint.
                moves.append((states.QUEUED, "requeued to resume", {}))
            return moves, d

        d = self.store.end_run(c.job_id, code, c.step, error, plan)
        level = "info" if d.state in (states.SUCCEEDED, states.PAUSED, states.INTERRUPTED, states.CANCELLED) else "warning"
        getattr(self.log, level)("trainer_exited", job=c.job_id, exit=describe_exit(code),
                     state=d.state, reason=d.reason)
        job_event(c.workdir, c.job_id, "trainer_exited", level=level, exit_code=code, state=d.state, reason=d.reason,
                  retry_in_s=d.retry_in)
        if (what := event_of_exit(d.state, d.reason)) is not None:
            self._tell(what, c.job_id, c.name, state=d.state, reason=d.reason, step=c.step, total=c.total,
                       exit_code=code, workdir=str(c.workdir))
        self._tell_policy("on_job_end", c.job_id, code)

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

    def _give_up_on(self, c: Child) -> None:
        """A trainer SIGKILLed kill_wait_s ago that has not exited: listed as stuck, its job settled as a crash.

        Nothing waits for it (daemon/supervisor/stuck.py): its GPUs stay out of scheduling until it is gone, and its job
        waits on the trainer.lock it still holds.
        """
        del self.children[c.job_id]
        c.last_error = self.stuck.add(StuckTrainer(pid=c.pid, start=c.pid_start, devices=list(c.devices),
                                                   job_id=c.job_id, workdir=c.workdir,
                                                   kill_wait_s=self.cfg.kill_wait_s))
        c.stop_reason = "hung"
        self.pending.add(c.job_id, c.devices, "trainer exit", lambda c=c: self._finish(c, None))

    def _drain_beats(self, now: float) -> None:
        while True:
            try:
                job_id, attempt, ev = self.beats.get_nowait()
            except queue.Empty:
                break
            c = self.children.get(job_id)
            if c is None or c.attempt != attempt:
                continue
            self._beat(c, ev, now)

    def _beat(self, c: Child, ev: dict[str, Any], now: float) -> None:
        kind = ev.get("event")
        checkpoint = c.heard(ev, now)
        if checkpoint:
            self.store.update(c.job_id, **checkpoint)
        if kind in ("resumed", "step") and not c.training_recorded:
            self.store.attempt_training(c.job_id, c.attempt, c.start_step)
            c.training_recorded = True
        if kind == "phase" and ev.get("phase") == "final_checkpoint" and self.shutting_down \
                and self.notifier is not None:
            self.notifier.extend_timeout(self.cfg.stop_grace_s)
        if kind == "checkpoint_slow":
            self._tell("checkpoint_slow", c.job_id, c.name, step=ev.get("step"), seconds=ev.get("seconds"))
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
        for path in self.inbox.poll():
            self.intake.take(path)
        # A file that could not be taken (disk full, ...) waits in incoming/ (or in the inbox, for the next
        # rescan); it is tried again every inbox_rescan_s, and `lorad status` says it is stuck and why.
        now = time.monotonic()
        if self.intake.stuck and now >= self._next_intake_retry:
            self._next_intake_retry = now + self.cfg.inbox_rescan_s
            self.intake.recover()

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

    # ---------------------------------------------------------------- spawn
    def _spawn(self) -> None:
        if self.shutting_down or not self.may_start or self.store.get_meta("drain") == "1":
            return
        busy = {d for c in self.children.values() for d in c.devices} | self.pending.gpus() | self.stuck.devices()
        tried: set[str] = set()
        while True:
            job = self.store.next_queued(time.time())
            if job is None or job["id"] in tried:
                return
            tried.add(job["id"])
            gpus = gang.job_gpus(Path(job["workdir"]))
            plan = gang.plan_starts([gang.Want(job["id"], gpus)], self.devices, busy)
            if plan.impossible:
                self._fail_unstartable(job, f"resources.gpus: the job needs {gpus} devices at once and this machine "
                                            f"has {len(self.devices)} (daemon devices: {self.devices})")
                continue
            if (why := cluster.unrunnable(Path(job["workdir"]), self.cfg.cluster)) is not None:
                self._fail_unstartable(job, why)
                continue
            if not plan.starts:
                # The first in line waits for a whole gang, holding no device; the jobs behind it wait too. If
                # lower-priority work holds the devices it needs, that work yields (daemon/supervisor/scheduling.py).
                if len(tried) == 1:
                    self._preempt_for(job, gpus, busy)
                return
            devs = plan.starts[0][1]
            if self.start(job, devs, gpus):
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

    def start(self, job: dict[str, Any], devs: list[int | None], processes: int = 1) -> bool:
        """Start a trainer for a queued job on `devs` (its gang) with `processes` ranks. True if one runs now (and
        is tracked in self.children)."""
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
            return self._start_locked(job, devs, processes, lock_fd)
        finally:
            os.close(lock_fd)  # a started child has its own copy: it keeps the lock for as long as it lives

    def trainer_command(self, workdir: Path) -> list[str]:
        return trainer.trainer_command(workdir, self.cfg.job_policy(self.home))

    def _start_locked(self, job: dict[str, Any], devs: list[int | None], processes: int, lock_fd: int) -> bool:
        job_id, workdir = job["id"], Path(job["workdir"])
        dev = devs[0]
        try:
            # QUEUED → RUNNING and the attempt row: one transaction, so a failed write leaves the job queued.
            n = self.store.begin_attempt(job_id, job["step"], gpu=dev, not_before=0)
        except states.IllegalTransition:
            return False  # paused or cancelled over the socket in the meantime
        self.locks.started(job_id)
        env = trainer.trainer_env(self.cfg.trainer_env, devs, workdir)
        shutil.rmtree(workdir / trainer.RANKS_DIR, ignore_errors=True)  # the last attempt's: not this one's ranks
        power = trainer.power_section(workdir)
        try:
            # Several processes: torchrun through engine.launch, which keeps this contract (one exit code, signals
            # forwarded to every rank, no rank outliving it).
            cmd = cluster.launch_command(self.trainer_command(workdir), workdir, processes, self.cfg.cluster)
            popen = trainer.spawn(cmd, workdir, env, lock_fd, self.cfg)
        except OSError as e:
            msg = f"could not start the trainer: {e}"
            self.log.error("spawn_failed", job=job_id, error=msg)
            p = self.pending.add(job_id, devs, "failed start", lambda: self._requeue_unstarted(job_id, job["step"], msg))
            self.pending.settle(p)  # if this write fails too, the next tick's reap tries again
            return False
        # The trainer runs: track it (and read its stdout) before anything else can fail.
        c = Child(job_id=job_id, name=job["name"], workdir=workdir, popen=popen, pid=popen.pid,
                  pid_start=proc.start_time(popen.pid), gpu=dev, attempt=n, start_step=job["step"],
                  total=job["total"], power=power, step=job["step"], checkpoint_step=job["checkpoint_step"],
                  devices=devs)
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
                      processes=processes)
        job_event(workdir, job_id, "attempt_started", attempt=n, pid=popen.pid, gpu=dev)
        self._tell_policy("on_job_start", c.running_job())
        return True

    def _requeue_unstarted(self, job_id: str, step: int, msg: str) -> None:
        fields = dict(last_error=msg, gpu=None, pid=None, pid_start=None,
                      not_before=time.time() + self.cfg.backoff_base_s)
        self.store.end_run(job_id, None, step, msg, lambda job: ([(states.QUEUED, msg, fields)], None))

    # ---------------------------------------------------------------- systemd status, shutdown
    def status_line(self) -> str:
        return status_line(self.children.values(), queued=len(self.store.jobs((states.QUEUED,))),
                           draining=self.store.get_meta("drain") == "1",
                           stuck=self.intake.stuck if self.intake is not None else [], notes=self.notes)

    def shutdown(self, deadline_s: float) -> None:
        """SIGTERM every trainer, reap them as they checkpoint and exit, SIGKILL what is left at the deadline."""
        shut_down(self, deadline_s)
