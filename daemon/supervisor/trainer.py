"""One trainer's life, from spawn to reap: the child process, its heartbeats, its hang check, its stop.

    spawn       `python -m engine.run --job jobs/ID/job.yaml --workdir jobs/ID --progress json` in a session
                (and process group) of its own, with jobs/ID/trainer.lock passed in as an open file (so the
                lock outlives a killed daemon) and SIGUSR1 blocked until the engine's handler is in place
    reader      a thread turns its stdout JSON lines into (job id, attempt, event) on the heartbeat queue,
                each line bounded and each event checked first (daemon/supervisor/trainer_output.py)
    heartbeats  step, phase, resumed, checkpoint_committed, ... update what the daemon knows of it
    hang check  no heartbeat for too long (longer while it loads or saves) → SIGKILL to its group
    stop        SIGTERM to its group (it checkpoints and exits 75), SIGKILL once the grace is over
    reap        once it has exited, SIGKILL what it left in its process group (a data-loader or compile
                worker must not keep GPU memory), then collect its exit status

The supervisor (daemon/supervisor/loop.py) decides when each happens and writes the store; nothing here does.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from daemon.config.daemon import ConfigInvalid
from daemon.power.run_policy import RunningJob
from daemon.supervisor import gang, trainer_output
from daemon.supervisor.beats import BeatQueue
from daemon.supervisor.exit_policy import describe_exit
from daemon.supervisor.warm_trainer import WarmPopen, WarmTrainer
from daemon.system import proc
from daemon.system import trainer_user as trainer_user_mod
from daemon.system.file_tail import tail_lines
from daemon.system.paths import JOB_DIR_MODE, JOB_FILE_MODE
from daemon.system.safe_files import open_or_create
from engine.config.policy import JobPolicy
from engine.distributed.liveness import LIVENESS_DIR, RankWatch
from engine.training.stop import EXIT_OK, EXIT_STOPPED

if TYPE_CHECKING:
    from daemon.config.daemon import DaemonConfig

TRAINER_UMASK = 0o027  # the trainer's files: the group may read them, no one else may write them
TRAINER_LOG_MODE = 0o640  # its stderr, likewise
SLOW_PHASES = {"prepare", "load_model", "final_checkpoint", "urgent_checkpoint"}
STDERR_TAIL_BYTES = 4000
READER_JOIN_S = 2.0  # at reap: the last lines (done, invalid_job, stopped) come before EOF


def trainer_command(workdir: Path, policy: JobPolicy | None = None) -> list[str]:
    """The trainer's argv; with the daemon's policy, which the trainer enforces itself on the job.yaml it reads."""
    return [sys.executable, "-m", "engine.run", "--job", str(workdir / "job.yaml"), "--workdir", str(workdir),
            "--progress", "json", *(policy.argv() if policy is not None else [])]


RANKS_DIR = "ranks"  # jobs/ID/ranks/: every rank's liveness file (engine/distributed/liveness.py)


def trainer_env(extra: dict[str, str], devs: list[int | None], workdir: Path | None = None) -> dict[str, str]:
    """The daemon's environment, the configured `trainer_env`, the GPUs the trainer may see, and where its ranks
    keep their liveness files."""
    env = {**os.environ, **extra, "PYTHONUNBUFFERED": "1"}
    if workdir is not None:
        env[LIVENESS_DIR] = str(Path(workdir) / RANKS_DIR)
    if (visible := gang.visible_devices(devs)) is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
        # `dev` is an NVML index; CUDA numbers GPUs fastest-first unless told otherwise, which on a mixed
        # machine puts the trainer on another GPU than the one counted, capped and metered.
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    env.pop("NOTIFY_SOCKET", None)  # only the daemon talks to systemd
    return env


def power_section(doc: dict[str, Any]) -> dict[str, Any]:
    """The `power` section of the job as accepted (state.db's copy, daemon/supervisor/accepted_job.py), for the
    power policy; {} if it has none.

    No full validation here: it would import torch, and the trainer validates the job itself (exit 65).
    """
    power = doc.get("power")
    return dict(power) if isinstance(power, dict) else {}


class CannotEnter(OSError):
    """The trainer user cannot reach its job directory: a configuration error (the job fails, saying how to fix
    it), never a crash to retry."""

    def __str__(self) -> str:
        return str(self.args[0])


def spawn(cmd: list[str], workdir: Path, env: dict[str, str], lock_fd: int,
          cfg: DaemonConfig | None = None, warm: WarmTrainer | None = None) -> subprocess.Popen | WarmPopen:
    """Start a trainer leading a session of its own, stdout piped (heartbeats), stderr appended to trainer.log.

    It runs as the daemon's user; a root daemon (in a container, `run_as_root`) starts it as `trainer_user` when
    that names one (daemon/system/trainer_user.py). Its umask is its own
    (TRAINER_UMASK), not the daemon's: what it writes is readable by the socket group, not writable.
    With `warm`, it is forked from the warm trainer when that can be done (daemon/supervisor/warm_trainer.py),
    else started cold. Raises OSError when it cannot be started.
    """
    try:
        # `lorad serve` checked the name at start; the user may have been removed since.
        run_as = None if cfg is None else trainer_user_mod.resolve(cfg.trainer_user, os.geteuid())
    except ConfigInvalid as e:
        raise OSError(str(e)) from None  # refused like any failed start: the job is requeued, the reason shown
    trainer_user_mod.protect_job_files(workdir, JOB_DIR_MODE, JOB_FILE_MODE)
    extra: dict[str, Any] = {}
    if run_as is not None:
        if (why := trainer_user_mod.way_in(workdir, run_as)) is not None:
            raise CannotEnter(why)
        trainer_user_mod.hand_over(workdir, run_as)
        extra = run_as.popen_kwargs()
        env = {**env, **run_as.env()}  # root's HOME would send its caches (~/.cache, ~/.triton) where it cannot write
    # A "checkpoint now" (SIGUSR1, UPS on battery) reaching a trainer still importing torch would kill it:
    # that is SIGUSR1's default action. Started with it blocked (the mask survives exec), the signal waits,
    # pending, until the trainer's handler is in place (engine.training.stop.StopFlag.install unblocks it).
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    try:
        # By descriptor: the trainer user may have put a symlink at trainer.log (never followed, the start fails).
        fd = open_or_create(workdir / "trainer.log", os.O_WRONLY | os.O_APPEND, TRAINER_LOG_MODE)
        with open(fd, "ab") as err:
            if warm is not None and (p := _spawn_warm(warm, cmd, workdir, env, err.fileno(), lock_fd)) is not None:
                return p
            return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=err, cwd=workdir,
                                    env=env, start_new_session=True, pass_fds=(lock_fd,), umask=TRAINER_UMASK,
                                    **extra)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def _spawn_warm(warm: WarmTrainer, cmd: list[str], workdir: Path, env: dict[str, str], err_fd: int,
                lock_fd: int) -> WarmPopen | None:
    r, w = os.pipe2(os.O_CLOEXEC)
    try:
        forked = warm.spawn(cmd, str(workdir), env, TRAINER_UMASK, w, err_fd, lock_fd)
    except BaseException:
        os.close(r)
        raise
    finally:
        os.close(w)
    if forked is None:
        os.close(r)
        return None
    return WarmPopen(*forked, cmd, open(r, "rb"))


def last_error_line(stderr_path: Path) -> str | None:
    """The last meaningful line of a trainer's stderr: usually the exception of a traceback."""
    raw = tail_lines(stderr_path, STDERR_TAIL_BYTES) or []
    lines = [ln.strip() for ln in (r.decode(errors="replace") for r in raw) if ln.strip()]
    for ln in reversed(lines):
        if not ln.startswith(("warnings.warn", "File ", "^", "~")) and "Warning" not in ln:
            return ln[:500]
    return None


@dataclass
class Child:
    job_id: str
    name: str
    workdir: Path
    popen: subprocess.Popen | WarmPopen
    pid: int
    pid_start: int | None
    gpu: int | None  # the first of `devices` (power caps and metrics follow it)
    attempt: int
    start_step: int
    total: int
    power: dict[str, Any]
    started_at: float = field(default_factory=time.time)
    last_beat: float = field(default_factory=time.monotonic)
    slow_phase: bool = True  # until the first step: loading may take long
    step: int = 0
    loss: float | None = None
    val_loss: float | None = None  # the last `validation` event's (data.validation)
    val_step: int | None = None
    s_per_step: float | None = None
    eta_s: float | None = None
    checkpoint_step: int | None = None
    new_checkpoint: bool = False  # this attempt committed a checkpoint: the crash counter resets
    last_error: str | None = None
    stop_reason: str | None = None  # pause | cancel | shutdown | drain | policy:... | hung
    stop_deadline: float | None = None
    killed_at: float | None = None  # monotonic time of the first SIGKILL to its group
    training_recorded: bool = False  # its real start step is in the store and the earlier attempt's note cleared
    compile_fallbacks: int = 0  # compile_fallback events kept in the store this attempt (bounded: COMPILE_FALLBACKS)
    pid_recorded: bool = False  # the pid is in the store (jobs and attempts); retried every tick until it is
    dirty: bool = False
    flushed_at: float = 0.0
    reader: threading.Thread | None = None
    devices: list[int | None] = field(default_factory=list)  # every device the job's processes use (a gang)
    ranks: RankWatch = field(default_factory=RankWatch)  # its ranks' liveness files, timed on the monotonic clock
    refusals: trainer_output.Refusals = field(default_factory=trainer_output.Refusals)  # stdout lines dropped
    doc: dict[str, Any] = field(default_factory=dict)  # the job as accepted (daemon/supervisor/accepted_job.py)
    memory_plan: str | None = None  # the attempt's memory plan in words (its `memory_plan` event)
    oom: dict[str, Any] | None = None  # its `out_of_memory` event: where, what it needed, the plan it ran under
    stage: str | None = None  # a stage before training, in words: "captioning 12/40" (images) (eta_s is its ETA)
    held_for_review: bool = False  # it said `captions_ready`: it stops, held for its captions' review

    def __post_init__(self) -> None:
        if not self.devices:
            self.devices = [self.gpu]

    def running_job(self) -> RunningJob:
        return RunningJob(job_id=self.job_id, name=self.name, pid=self.pid, gpu=self.gpu, started_at=self.started_at,
                          step=self.step, total=self.total, s_per_step=self.s_per_step, power=self.power,
                          doc=self.doc)

    # ------------------------------------------------------------ stdout → heartbeats
    def start_reader(self, beats: BeatQueue, wake: threading.Event) -> None:
        self.reader = threading.Thread(target=self._read, args=(beats, wake), name=f"trainer-{self.job_id}",
                                       daemon=True)
        self.reader.start()

    def _read(self, beats: BeatQueue, wake: threading.Event) -> None:
        """Reader thread: the trainer's stdout, bounded lines of checked JSON events → the heartbeat queue; other
        lines are tolerated, bad events dropped (trainer_output.py) and the first of each kind queued as Refused."""
        assert self.popen.stdout is not None
        for item in trainer_output.lines(self.popen.stdout):
            try:
                ev = trainer_output.parse(item)
            except trainer_output.Refused as r:
                if self.refusals.first(r):
                    beats.put((self.job_id, self.attempt, r))
                    wake.set()
                continue
            if ev is not None:
                beats.put((self.job_id, self.attempt, ev))
                wake.set()
        self.popen.stdout.close()
        wake.set()

    def heard(self, ev: dict[str, Any], now: float) -> dict[str, Any]:
        """Take in one heartbeat. Returns the checkpoint columns it changes ({} for most events)."""
        self.last_beat = now
        kind = ev.get("event")
        if kind == "step":
            self.slow_phase, self.stage = False, None
            self.step = int(ev.get("step", self.step))
            self.total = int(ev.get("total", self.total))
            self.loss = ev.get("loss")
            self.s_per_step = ev.get("s_per_step")
            self.eta_s = ev.get("eta_s")
            self.dirty = True
        elif kind == "validation":
            self.val_loss, self.val_step = ev.get("loss"), ev.get("step")
            self.dirty = True
        elif kind == "phase":
            self.slow_phase = ev.get("phase") in SLOW_PHASES
            if self.stage is not None and ev.get("phase") != "prepare":  # the caption stage is over
                self.stage, self.eta_s, self.dirty = None, None, True
        elif kind in ("captioning", "captions_committed"):  # the caption stage's progress is the job's
            done, total = (0, int(ev.get("to_caption", 0))) if kind == "captioning" else (
                int(ev.get("done", 0)), int(ev.get("total", 0)))
            if total:
                self.stage, self.eta_s, self.dirty = f"captioning {done}/{total}", ev.get("eta_s"), True
        elif kind == "captions_ready":  # data.captioner.hold_for_review: the trainer exits next, held
            self.held_for_review = True
        elif kind == "resumed":
            self.step = self.start_step = int(ev.get("from_step", 0))
            self.dirty = True
        elif kind == "checkpoint_committed":
            step = int(ev.get("step", 0))
            new = self.checkpoint_step is None or step > self.checkpoint_step
            self.checkpoint_step = step
            self.dirty = True
            if not new:
                return {"last_checkpoint": ev.get("path"), "checkpoint_step": step}
            # Progress: the crash count starts again (in the store too, for a restart after an outage).
            self.new_checkpoint = True
            return {"last_checkpoint": ev.get("path"), "checkpoint_step": step, "retries": 0}
        elif kind in ("invalid_job", "disk_error", "internal_error"):
            self.last_error = str(ev.get("message", kind))
        elif kind == "memory_plan":
            self.memory_plan = str(ev.get("summary", ""))[:1000] or None
            self.dirty = True
        elif kind == "out_of_memory":
            self.oom = ev
            self.last_error = str(ev.get("message", kind))
        elif kind == "done":
            self.step = int(ev.get("step", self.step))
            self.dirty = True
        return {}

    def progress(self) -> dict[str, Any]:
        """The progress columns of its job row."""
        out = dict(step=self.step, total=self.total, loss=self.loss, s_per_step=self.s_per_step, eta_s=self.eta_s)
        if self.val_step is not None:  # a resumed attempt keeps the last value until it validates again
            out.update(val_loss=self.val_loss, val_step=self.val_step)
        if self.memory_plan is not None:
            out["memory_plan"] = self.memory_plan
        out["stage"] = self.stage
        return out

    # ------------------------------------------------------------ hang, stop, kill
    def check_hung(self, now: float, cfg: DaemonConfig) -> bool:
        """No heartbeat for longer than allowed: SIGKILL its group and remember why. True if it was killed now."""
        if self.stop_reason == "hung" or self.exited():
            return False
        if self.slow_phase:
            limit = cfg.startup_timeout_s
        else:
            limit = max(cfg.hang_timeout_s, cfg.hang_step_multiple * (self.s_per_step or 0.0))
        quiet = now - self.last_beat
        if quiet > limit:
            self.last_error = f"hung: no heartbeat for {quiet:.0f} s (limit {limit:.0f} s) at step {self.step}"
        elif silent := self.ranks.silent(self.workdir / RANKS_DIR, cfg.rank_silence_s, now):
            # Rank 0 may still be busy alone (samples, a save, the export): a rank of this machine has stopped.
            rank, seconds = silent[0]
            self.last_error = (f"hung: rank {rank} has shown no sign of life for {seconds:.0f} s (limit "
                               f"{cfg.rank_silence_s:.0f} s; its process is stopped or frozen) at step {self.step}")
        else:
            return False
        self.stop_reason = "hung"
        self.signal(signal.SIGKILL)
        return True

    def stopping(self, reason: str, grace_s: float) -> bool:
        """Record a stop and its deadline; False if it is stopping already (the first reason stands)."""
        if self.stop_reason is not None:
            return False
        self.stop_reason = reason
        self.stop_deadline = time.monotonic() + grace_s
        return True

    def overdue(self, now: float) -> bool:
        """Still running past its stop deadline: SIGKILL its group (once). True if it was killed now."""
        if self.stop_deadline is None or now < self.stop_deadline or self.exited():
            return False
        self.signal(signal.SIGKILL)
        self.stop_deadline = None
        return True

    def signal(self, sig: int) -> None:
        """Signal the whole process group the trainer leads."""
        if sig == signal.SIGKILL and self.killed_at is None:
            self.killed_at = time.monotonic()
        proc.signal_group(self.pid, sig)

    def outlived_kill(self, now: float, kill_wait_s: float) -> bool:
        """SIGKILLed more than kill_wait_s ago and still not exited: stuck in the kernel (a hung driver)."""
        return self.killed_at is not None and now - self.killed_at > kill_wait_s and not self.exited()

    # ------------------------------------------------------------ exit
    def exited(self) -> bool:
        """True once the trainer has exited. Its status is left uncollected (reap() collects it)."""
        if self.popen.returncode is not None:
            return True
        try:
            return os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
        except ChildProcessError:  # collected by someone else already
            return self.popen.poll() is not None

    def reap(self) -> int | None:
        """Its exit status once it has exited (None while it runs), with its process group killed first.

        Until its status is collected the exited trainer holds its pid, so no other process can have been
        given that number as a process group id yet: the SIGKILL reaches only what this trainer left behind.
        """
        if self.popen.returncode is None:
            if not self.exited():
                return None
            self.signal(signal.SIGKILL)
            self.popen.wait()
        if self.reader is not None:
            self.reader.join(timeout=READER_JOIN_S)
        return self.popen.returncode

    def exit_error(self, code: int) -> str | None:
        """What to record as the attempt's error: why it was killed as hung, or the exit and its last stderr line."""
        if self.stop_reason == "hung":
            return self.last_error
        if code in (EXIT_OK, EXIT_STOPPED):
            return None
        detail = self.last_error or last_error_line(self.workdir / "trainer.log")
        return f"{describe_exit(code)}: {detail}" if detail else describe_exit(code)
