"""The supervisor: runs queued jobs as trainer children and acts on what they report.

`tick()` is the service loop's one step, with named sub-steps in a fixed order:

    reap        children that exited → succeeded / failed / retried / paused / ...
    heartbeats  progress lines from the children; hung trainers are killed
    requests    pause / cancel / drain asked for over the socket → SIGTERM
    inbox       complete job files → accepted or rejected
    policy      power, schedules, UPS (daemon.policy) → may_start, stop, checkpoint now
    spawn       a free device and the first queued job → a new trainer

Each trainer runs in a session (and process group) of its own, holds an
flock on jobs/ID/trainer.lock for as long as it lives (passed as an open
file, so it outlives a killed daemon), and is started as

    python -m engine.run --job jobs/ID/job.yaml --workdir jobs/ID --progress json
"""

from __future__ import annotations

import fcntl
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import yaml

from daemon import proc, states
from daemon.lock import write_pid
from daemon.log import job_event
from daemon.notifications import event_of_exit
from daemon.policy import NullPolicy, Policy, RunningJob
from daemon.settings import DaemonConfig
from daemon.store import Store, UnknownJob
from engine.stop import EXIT_INVALID, EXIT_OK, EXIT_STOPPED

SLOW_PHASES = {"prepare", "load_model", "final_checkpoint", "urgent_checkpoint"}
PROGRESS_FLUSH_S = 1.0  # step heartbeats reach the DB at most this often (checkpoints at once)
STDERR_TAIL_BYTES = 4000
LOCK_BUSY_RETRY_S = 5.0  # a job whose trainer.lock is held by an earlier trainer waits this long between tries
PENDING_GIVE_UP_S = 10.0  # at shutdown: unwritten bookkeeping is retried this long after the last trainer is gone


@dataclass
class Child:
    job_id: str
    name: str
    workdir: Path
    popen: subprocess.Popen
    pid: int
    pid_start: int | None
    gpu: int | None
    attempt: int
    start_step: int
    total: int
    power: dict[str, Any]
    started_at: float = field(default_factory=time.time)
    last_beat: float = field(default_factory=time.monotonic)
    slow_phase: bool = True  # until the first step: loading may take long
    step: int = 0
    loss: float | None = None
    s_per_step: float | None = None
    eta_s: float | None = None
    checkpoint_step: int | None = None
    new_checkpoint: bool = False  # this attempt committed a checkpoint: the crash counter resets
    last_error: str | None = None
    stop_reason: str | None = None  # pause | cancel | shutdown | drain | policy:... | hung
    stop_deadline: float | None = None
    pid_recorded: bool = False  # the pid is in the store (jobs and attempts); retried every tick until it is
    dirty: bool = False
    flushed_at: float = 0.0
    reader: threading.Thread | None = None

    def running_job(self) -> RunningJob:
        return RunningJob(job_id=self.job_id, name=self.name, pid=self.pid, gpu=self.gpu, started_at=self.started_at,
                          step=self.step, total=self.total, s_per_step=self.s_per_step, power=self.power)


@dataclass
class Pending:
    """Bookkeeping to write for a job whose trainer is gone (it exited, or never started).

    The job stays `running` in the store until `write` succeeds; the supervisor retries it every tick, so one
    failed store write (disk full, a lock held too long) never leaves a job running with no trainer.
    """

    job_id: str
    gpu: int | None
    what: str
    write: Callable[[], None]
    failures: int = 0


@dataclass
class ExitDecision:
    state: str
    reason: str
    retry_in: float | None = None  # for RUNNING → QUEUED: the backoff


def decide_exit(code: int | None, stop_reason: str | None, retries: int, cfg: DaemonConfig,
                last_error: str | None) -> ExitDecision:
    """Where a job goes when its trainer exits. `retries` counts crashes in a row, this one included."""
    if code == EXIT_OK:
        return ExitDecision(states.SUCCEEDED, "finished")
    if stop_reason == "cancel":
        return ExitDecision(states.CANCELLED, "cancelled by the user")
    if stop_reason == "pause":
        return ExitDecision(states.PAUSED, "paused by the user")
    if stop_reason in ("shutdown", "drain") or (stop_reason or "").startswith("policy"):
        return ExitDecision(states.INTERRUPTED, stop_reason or "stopped")
    if code == EXIT_INVALID:
        return ExitDecision(states.FAILED, f"invalid job: {last_error or 'exit 65'}")
    if code == EXIT_STOPPED and stop_reason is None:
        # Someone else sent the trainer SIGTERM (an operator, a system shutdown): resumable, not a crash.
        return ExitDecision(states.INTERRUPTED, "the trainer was stopped from outside the daemon")
    if retries > cfg.retry_budget:
        return ExitDecision(states.FAILED, f"retry budget spent ({cfg.retry_budget}); last error: {last_error}")
    backoff = min(cfg.backoff_max_s, cfg.backoff_base_s * (2 ** (retries - 1)))
    return ExitDecision(states.QUEUED, f"crashed ({last_error}); retry {retries}/{cfg.retry_budget}", retry_in=backoff)


def describe_exit(code: int | None) -> str:
    if code is None:
        return "unknown exit"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def last_error_line(stderr_path: Path) -> str | None:
    """The last meaningful line of a trainer's stderr: usually the exception of a traceback."""
    try:
        with open(stderr_path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - STDERR_TAIL_BYTES))
            lines = [ln.strip() for ln in f.read().decode(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return None
    for ln in reversed(lines):
        if not ln.startswith(("warnings.warn", "File ", "^", "~")) and "Warning" not in ln:
            return ln[:500]
    return None


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
        self.notifications = notifications  # daemon.notifications.Notifications: webhook / command per event
        self.children: dict[str, Child] = {}
        self.pending: dict[str, Pending] = {}  # job id → bookkeeping not yet written (trainer already gone)
        self._lock_holders_seen: dict[str, set[tuple[int, int] | None]] = {}  # job id → earlier trainers asked to stop
        self.beats: queue.Queue = queue.Queue()
        self.may_start = True
        self.notes: list[str] = []
        self.shutting_down = False
        self._checkpoint_now_prev = False
        self._next_intake_retry = 0.0
        self._last_watchdog = 0.0
        self._last_status = ""
        self.healthy = True
        self.wake = threading.Event()

    # ================================================================ the tick
    def tick(self) -> None:
        ok = all([
            self._step("reap", self._reap),
            self._step("heartbeats", self._heartbeats),
            self._step("requests", self._requests),
            self._step("inbox", self._inbox),
            self._step("policy", self._policy),
            self._step("spawn", self._spawn),
        ])
        # The systemd watchdog is fed only after a tick whose steps all worked.
        self.healthy = ok
        self._step("notify", self._notify)

    def _step(self, name: str, fn) -> bool:
        # One failing step must not stop the others (or the loop); a loop that keeps failing stops feeding
        # the watchdog, and systemd restarts the daemon.
        try:
            fn()
            return True
        except Exception as e:  # noqa: BLE001
            self.log.error("tick_step_failed", exc_info=True, step=name, error=f"{type(e).__name__}: {e}")
            return False

    # ---------------------------------------------------------------- reap
    def _reap(self) -> None:
        for job_id, c in list(self.children.items()):
            code = c.popen.poll()
            if code is None:
                continue
            if c.reader is not None:
                c.reader.join(timeout=2.0)  # the last lines (done, invalid_job, stopped) come before EOF
            self._drain_beats(time.monotonic())
            # Gone: never signal it again (its pid may belong to someone else soon). Its job stays `running`
            # in the store until the exit is written, which _settle_pending retries until it succeeds.
            del self.children[job_id]
            self.pending[job_id] = Pending(job_id, c.gpu, "trainer exit", lambda c=c, code=code: self._finish(c, code))
        self._settle_pending()

    def _settle_pending(self) -> None:
        """Write what is pending; raise (the tick is unhealthy) if some of it still fails."""
        failed = [e for p in list(self.pending.values()) if (e := self._settle(p)) is not None]
        if failed:
            raise RuntimeError(f"{len(failed)} job(s) not yet recorded: {failed[0]}")

    def _settle(self, p: Pending) -> str | None:
        try:
            p.write()
        except (states.IllegalTransition, UnknownJob) as e:
            # Written already (a retry after the transaction committed), or the job is gone: nothing to redo.
            self.log.warning("bookkeeping_dropped", job=p.job_id, what=p.what, error=str(e))
        except Exception as e:  # noqa: BLE001 — kept, and tried again on the next tick
            p.failures += 1
            if p.failures == 1:
                self.log.error("bookkeeping_failed", job=p.job_id, what=p.what, error=f"{type(e).__name__}: {e}",
                               message="the job stays running in the store; retried every tick")
            return f"{p.job_id} ({p.what}): {type(e).__name__}: {e}"
        if p.failures:
            self.log.info("bookkeeping_written", job=p.job_id, what=p.what, failed_tries=p.failures)
        del self.pending[p.job_id]
        return None

    def _finish(self, c: Child, code: int) -> None:
        if c.stop_reason == "hung":
            error = c.last_error
        elif code in (EXIT_OK, EXIT_STOPPED):
            error = None
        else:
            detail = c.last_error or last_error_line(c.workdir / "trainer.log")
            error = f"{describe_exit(code)}: {detail}" if detail else describe_exit(code)
        crash = code not in (EXIT_OK, EXIT_STOPPED, EXIT_INVALID) or c.stop_reason == "hung"

        def plan(job: dict[str, Any]):
            # Runs inside the store's transaction, on the job as it is now: a pause or cancel that lands while
            # the exit is being written is either seen here or refused afterwards, never lost in between.
            retries = 0 if c.new_checkpoint else job["retries"]
            if crash and c.stop_reason in (None, "hung"):
                retries += 1
            stop_reason = None if c.stop_reason == "hung" else c.stop_reason
            if job["requested"] in ("pause", "cancel"):
                # The user's latest word wins over drain, a power policy or shutdown (and over an earlier pause),
                # and over an exit the trainer came to on its own just before the stop.
                stop_reason = job["requested"]
            elif stop_reason is None and self.shutting_down and code == EXIT_STOPPED:
                stop_reason = "shutdown"  # SIGTERM reached it with ours (systemd signals the whole unit)
            d = decide_exit(code, stop_reason, retries, self.cfg, error)
            fields: dict[str, Any] = dict(pid=None, pid_start=None, gpu=None, step=c.step, retries=retries,
                                          requested=None, last_error=error if error else job["last_error"])
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
        try:
            self.policy.on_job_end(c.job_id, code)
        except Exception as e:  # noqa: BLE001
            self.log.error("policy_failed", hook="on_job_end", error=str(e))

    def _tell(self, event: str, job_id: str, name: str, **detail: Any) -> None:
        """A notification (webhook / command); only queued here, delivered on the notifier's own thread."""
        if self.notifications is not None:
            self.notifications.emit(event, job_id, name, **detail)

    # ---------------------------------------------------------------- heartbeats
    def _heartbeats(self) -> None:
        now = time.monotonic()
        try:
            self._drain_beats(now)
        finally:
            # Hang and stop deadlines hold even while the store refuses writes.
            for c in self.children.values():
                self._check_hung(c, now)
                if c.stop_deadline is not None and now >= c.stop_deadline and c.popen.poll() is None:
                    self.log.warning("trainer_kill", job=c.job_id, why=f"did not stop within {self.cfg.stop_grace_s} s")
                    proc.signal_group(c.pid, signal.SIGKILL)
                    c.stop_deadline = None
        for c in self.children.values():
            if not c.pid_recorded:
                self.store.record_trainer(c.job_id, c.attempt, c.pid, c.pid_start)
                c.pid_recorded = True
            if c.dirty and (now - c.flushed_at >= PROGRESS_FLUSH_S):
                self._flush(c)

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
        c.last_beat = now
        kind = ev.get("event")
        if kind == "step":
            c.slow_phase = False
            c.step = int(ev.get("step", c.step))
            c.total = int(ev.get("total", c.total))
            c.loss = ev.get("loss")
            c.s_per_step = ev.get("s_per_step")
            c.eta_s = ev.get("eta_s")
            c.dirty = True
        elif kind == "phase":
            c.slow_phase = ev.get("phase") in SLOW_PHASES
            if ev.get("phase") == "final_checkpoint" and self.shutting_down and self.notifier is not None:
                self.notifier.extend_timeout(self.cfg.stop_grace_s)
        elif kind == "resumed":
            c.step = c.start_step = int(ev.get("from_step", 0))
            c.dirty = True
        elif kind == "checkpoint_committed":
            step = int(ev.get("step", 0))
            new = c.checkpoint_step is None or step > c.checkpoint_step
            c.checkpoint_step = step
            if new:
                # Progress: the crash count starts again (in the store too, for a restart after an outage).
                c.new_checkpoint = True
                self.store.update(c.job_id, last_checkpoint=ev.get("path"), checkpoint_step=step, retries=0)
            else:
                self.store.update(c.job_id, last_checkpoint=ev.get("path"), checkpoint_step=step)
            c.dirty = True
        elif kind in ("invalid_job", "disk_error"):
            c.last_error = str(ev.get("message", kind))
        elif kind == "checkpoint_slow":
            self._tell("checkpoint_slow", c.job_id, c.name, step=ev.get("step"), seconds=ev.get("seconds"))
        elif kind == "done":
            c.step = int(ev.get("step", c.step))
            c.dirty = True
        if c.dirty and kind != "step":
            self._flush(c)
        try:
            self.policy.on_heartbeat(c.job_id, ev)
        except Exception as e:  # noqa: BLE001
            self.log.error("policy_failed", hook="on_heartbeat", error=str(e))

    def _flush(self, c: Child) -> None:
        self.store.update(c.job_id, step=c.step, total=c.total, loss=c.loss, s_per_step=c.s_per_step, eta_s=c.eta_s)
        c.dirty = False
        c.flushed_at = time.monotonic()

    def _check_hung(self, c: Child, now: float) -> None:
        if c.stop_reason == "hung" or c.popen.poll() is not None:
            return
        if c.slow_phase:
            limit = self.cfg.startup_timeout_s
        else:
            limit = max(self.cfg.hang_timeout_s, self.cfg.hang_step_multiple * (c.s_per_step or 0.0))
        quiet = now - c.last_beat
        if quiet > limit:
            c.last_error = f"hung: no heartbeat for {quiet:.0f} s (limit {limit:.0f} s) at step {c.step}"
            self.log.warning("trainer_hung", job=c.job_id, pid=c.pid, message=c.last_error)
            c.stop_reason = "hung"
            proc.signal_group(c.pid, signal.SIGKILL)

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
        if c.stop_reason is not None:
            return
        c.stop_reason = reason
        c.stop_deadline = time.monotonic() + self.cfg.stop_grace_s
        self.log.info("trainer_stop", job=c.job_id, reason=reason)
        job_event(c.workdir, c.job_id, "stop_requested", reason=reason)
        proc.signal_group(c.pid, signal.SIGTERM)

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

    # ---------------------------------------------------------------- policy
    def _policy(self) -> None:
        running = [c.running_job() for c in self.children.values()]
        d = self.policy.tick(datetime.now(timezone.utc), running)
        self.may_start = d.may_start
        self.notes = list(d.notes)
        if d.stop_running:
            for c in list(self.children.values()):
                self.stop(c, f"policy: {d.stop_running}")
        # On the rising edge only: a policy that keeps saying "checkpoint now" must not make a save per tick.
        if d.checkpoint_now and not self._checkpoint_now_prev:
            for c in self.children.values():
                self.log.info("checkpoint_now", job=c.job_id, notes=d.notes)
                proc.signal_group(c.pid, signal.SIGUSR1)
        self._checkpoint_now_prev = d.checkpoint_now

    # ---------------------------------------------------------------- spawn
    def _spawn(self) -> None:
        if self.shutting_down or not self.may_start or self.store.get_meta("drain") == "1":
            return
        busy = {c.gpu for c in self.children.values()} | {p.gpu for p in self.pending.values()}
        tried: set[str] = set()
        for dev in self.devices:
            if dev in busy:
                continue
            while True:
                job = self.store.next_queued(time.time())
                if job is None or job["id"] in tried:
                    return
                tried.add(job["id"])
                if self.start(job, dev):
                    break
                # Not started (its directory is unusable, an earlier trainer holds it, ...): the next in line
                # may use this device; start() left that job out of next_queued's answer.

    def start(self, job: dict[str, Any], dev: int | None) -> bool:
        """Start a trainer for a queued job on `dev`. True if one runs now (and is tracked in self.children)."""
        job_id, workdir = job["id"], Path(job["workdir"])
        try:
            lock_fd = os.open(workdir / "trainer.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:
            msg = f"cannot use the job directory {workdir}: {e.strerror or e}"
            self.store.transition(job_id, states.QUEUED, states.FAILED, msg, last_error=msg)
            self.log.error("job_dir_unusable", job=job_id, error=msg)
            self._tell("failed", job_id, job["name"], state=states.FAILED, reason=msg, workdir=str(workdir))
            return False
        try:
            try:
                fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                self._lock_busy(job_id, workdir)
                return False
            return self._start_locked(job, dev, lock_fd)
        finally:
            os.close(lock_fd)  # a started child has its own copy: it keeps the lock for as long as it lives

    def trainer_command(self, workdir: Path) -> list[str]:
        return [sys.executable, "-m", "engine.run", "--job", str(workdir / "job.yaml"), "--workdir", str(workdir),
                "--progress", "json"]

    def _lock_busy(self, job_id: str, workdir: Path) -> None:
        """An earlier trainer still holds the job: never start a second one. The job waits a little (others may
        start meanwhile); the holder, if it is one of our trainers, is asked once to checkpoint and stop."""
        self.store.update(job_id, not_before=time.time() + LOCK_BUSY_RETRY_S)
        seen = self._lock_holders_seen.setdefault(job_id, set())
        holders = [t for t in proc.find_trainers(self.home / "jobs") if t.workdir == workdir.resolve()]
        for t in holders:
            if (t.pid, t.start) not in seen:
                seen.add((t.pid, t.start))
                self.log.warning("trainer_still_running", job=job_id, pid=t.pid,
                                 message="an earlier trainer holds the job: asked it to stop (SIGTERM); waiting")
                proc.signal_group(t.pid, signal.SIGTERM)
        if not holders and None not in seen:
            seen.add(None)  # held by something we do not stop (`lorad run`, say): said once
            self.log.warning("trainer_lock_busy", job=job_id,
                             message="another process holds jobs/ID/trainer.lock; waiting for it")

    def _start_locked(self, job: dict[str, Any], dev: int | None, lock_fd: int) -> bool:
        job_id, workdir = job["id"], Path(job["workdir"])
        try:
            # QUEUED → RUNNING and the attempt row: one transaction, so a failed write leaves the job queued.
            n = self.store.begin_attempt(job_id, job["step"], gpu=dev, not_before=0)
        except states.IllegalTransition:
            return False  # paused or cancelled over the socket in the meantime
        self._lock_holders_seen.pop(job_id, None)
        env = {**os.environ, **self.cfg.trainer_env, "PYTHONUNBUFFERED": "1"}
        if dev is not None:
            env["CUDA_VISIBLE_DEVICES"] = str(dev)
            # `dev` is an NVML index; CUDA numbers GPUs fastest-first unless told otherwise, which on a mixed
            # machine puts the trainer on another GPU than the one counted, capped and metered.
            env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
        env.pop("NOTIFY_SOCKET", None)  # only the daemon talks to systemd
        cmd = self.trainer_command(workdir)
        power: dict[str, Any] = {}
        try:
            # Only the `power` section, for the policy; no full validation here (it would import torch, and
            # the trainer validates the job itself: exit 65).
            raw = yaml.safe_load((workdir / "job.yaml").read_text(encoding="utf-8"))
            power = dict(raw.get("power") or {}) if isinstance(raw, dict) else {}
        except (OSError, yaml.YAMLError):
            pass
        # A "checkpoint now" (SIGUSR1, UPS on battery) reaching a trainer still importing torch would kill it:
        # that is SIGUSR1's default action. Started with it blocked (the mask survives exec), the signal waits,
        # pending, until the trainer's handler is in place (engine.stop.StopFlag.install unblocks it).
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
        try:
            with open(workdir / "trainer.log", "ab") as err:
                popen = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=err,
                                         cwd=workdir, env=env, start_new_session=True, pass_fds=(lock_fd,))
        except OSError as e:
            msg = f"could not start the trainer: {e}"
            self.log.error("spawn_failed", job=job_id, error=msg)
            p = Pending(job_id, dev, "failed start", lambda: self._requeue_unstarted(job_id, job["step"], msg))
            self.pending[job_id] = p
            self._settle(p)  # if this write fails too, the next tick's reap tries again
            return False
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        # The trainer runs: track it (and read its stdout) before anything else can fail.
        c = Child(job_id=job_id, name=job["name"], workdir=workdir, popen=popen, pid=popen.pid,
                  pid_start=proc.start_time(popen.pid), gpu=dev, attempt=n, start_step=job["step"],
                  total=job["total"], power=power, step=job["step"], checkpoint_step=job["checkpoint_step"])
        c.reader = threading.Thread(target=self._read, args=(c,), name=f"trainer-{job_id}", daemon=True)
        self.children[job_id] = c
        c.reader.start()
        try:
            write_pid(lock_fd, popen.pid)  # so that a refused `lorad run` can name the holder
        except OSError:
            pass
        try:
            self.store.record_trainer(job_id, n, popen.pid, c.pid_start)
            c.pid_recorded = True
        except Exception as e:  # noqa: BLE001 — heartbeats retry it every tick
            self.log.error("pid_not_recorded", job=job_id, pid=popen.pid, error=f"{type(e).__name__}: {e}")
        self.log.info("trainer_started", job=job_id, pid=popen.pid, attempt=n, gpu=dev)
        job_event(workdir, job_id, "attempt_started", attempt=n, pid=popen.pid, gpu=dev)
        try:
            self.policy.on_job_start(c.running_job())
        except Exception as e:  # noqa: BLE001
            self.log.error("policy_failed", hook="on_job_start", error=str(e))
        return True

    def _requeue_unstarted(self, job_id: str, step: int, msg: str) -> None:
        fields = dict(last_error=msg, gpu=None, pid=None, pid_start=None,
                      not_before=time.time() + self.cfg.backoff_base_s)
        self.store.end_run(job_id, None, step, msg, lambda job: ([(states.QUEUED, msg, fields)], None))

    def _read(self, c: Child) -> None:
        """Reader thread: the trainer's stdout, JSON lines → the heartbeat queue; other lines are tolerated."""
        assert c.popen.stdout is not None
        for raw in c.popen.stdout:
            line = raw.strip()
            if not line.startswith(b"{"):
                continue
            try:
                ev = json.loads(line)
            except ValueError:
                continue
            if isinstance(ev, dict):
                self.beats.put((c.job_id, c.attempt, ev))
                self.wake.set()
        c.popen.stdout.close()
        self.wake.set()

    # ---------------------------------------------------------------- systemd status and watchdog
    def status_line(self) -> str:
        parts = []
        for c in self.children.values():
            sps = f", {c.s_per_step:.2f} s/step" if c.s_per_step else ""
            parts.append(f"{c.job_id} step {c.step}/{c.total}{sps}" + (f" (stopping: {c.stop_reason})" if c.stop_reason else ""))
        queued = len(self.store.jobs((states.QUEUED,)))
        if not parts:
            parts.append("idle")
        s = "; ".join(parts) + f"; {queued} queued"
        if self.store.get_meta("drain") == "1":
            s += "; draining"
        stuck = self.intake.stuck if self.intake is not None else []
        if stuck:
            s += f"; inbox stuck ({len(stuck)} file(s): {stuck[0]['error']})"
        if self.notes:
            s += "; " + "; ".join(self.notes)
        return s

    def _notify(self) -> None:
        if self.notifier is None or not self.notifier.enabled:
            return
        now = time.monotonic()
        wd = self.notifier.watchdog_s
        # Fed only from here, and only after a tick whose steps all worked.
        if wd and self.healthy and now - self._last_watchdog >= wd / 3:
            self.notifier.watchdog()
            self._last_watchdog = now
        s = self.status_line()
        if s != self._last_status:
            self.notifier.status(s)
            self._last_status = s

    # ---------------------------------------------------------------- shutdown
    def shutdown(self, deadline_s: float) -> None:
        """SIGTERM every trainer, reap them as they checkpoint and exit, SIGKILL what is left at the deadline.

        Exits that cannot be written (the store refuses) are retried for PENDING_GIVE_UP_S after the last
        trainer is gone; what is still unwritten then stays `running` in the store, and the next start's
        recovery settles it.
        """
        self.shutting_down = True
        for c in list(self.children.values()):
            self.stop(c, "shutdown")
            c.stop_deadline = time.monotonic() + deadline_s
        if self.children and self.notifier is not None:
            self.notifier.extend_timeout(deadline_s + 10)
        said: set[str] = set()
        alone_since: float | None = None
        while self.children or self.pending:
            for name, fn in (("reap", self._reap), ("heartbeats", self._heartbeats)):
                try:
                    fn()
                except Exception as e:  # noqa: BLE001 — shutting down: say it once, keep reaping
                    if f"{name}: {e}" not in said:
                        said.add(f"{name}: {e}")
                        self.log.error("shutdown_step_failed", step=name, error=f"{type(e).__name__}: {e}")
            if self.children:
                alone_since = None
            elif self.pending:
                alone_since = alone_since or time.monotonic()
                if time.monotonic() - alone_since >= PENDING_GIVE_UP_S:
                    self.log.error("bookkeeping_unwritten", jobs=sorted(self.pending),
                                   message="left running in the store; the next start's recovery settles them")
                    break
            self.wake.wait(0.1)
            self.wake.clear()
