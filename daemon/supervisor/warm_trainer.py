"""The warm trainer: one pre-imported trainer process (daemon/supervisor/zygote.py) that forks each new trainer,
so a job starts or resumes without paying Python's torch/transformers/diffusers imports.

    start       in the background, when a job is queued (a daemon that never trains never pays its imports), as
                the trainer's user with the trainer's environment
    use         trainer.spawn() asks it first; the answer is a WarmPopen, which the supervisor treats as a Popen
    fallback    cold start (subprocess.Popen, as before) whenever it is off, still importing past its wait, dead,
                erroring, asked for an environment it cannot apply after import, or stale: lorad's files on disk
                differ from what it imported (warm_fingerprint.py) -- then it is replaced by a new one
    daemon dies the zygote reads EOF and exits, leaving its children alone: orphans, reconciled as today
"""

from __future__ import annotations

import array
import json
import os
import queue
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any, Callable

from daemon.supervisor import zygote
from daemon.supervisor.warm_fingerprint import fingerprint
from engine.distributed.liveness import LIVENESS_DIR

WARMING_WAIT_S = 30.0  # a queued job waits this long for a zygote still importing, then starts cold
ANSWER_WAIT_S = 30.0
STATUS_LOST = 255  # a warm trainer that outlived its zygote: its exit status went to init (treated as a crash)
# What may differ between the zygote's environment and a trainer's: read after import (CUDA at its first use,
# OMP_NUM_THREADS re-applied by the child, the liveness dir by engine.run). Anything else may have been read
# while the zygote imported (HF_HOME, PYTORCH_*, ...): a trainer that needs it different starts cold.
PER_TRAINER_ENV = {LIVENESS_DIR, "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "OMP_NUM_THREADS"}


def forkable(cmd: list[str]) -> bool:
    """A command the zygote can run: one `python -m engine.run` process (not torchrun, not a test's script)."""
    return cmd[:3] == [sys.executable, "-m", "engine.run"]


class WarmPopen:
    """A trainer forked by the zygote, as the supervisor uses a Popen: pid, stdout, poll, wait, send_signal.

    poll() sees the exit (reported by the zygote) without collecting it; wait() collects it (returncode set, the
    zygote frees the pid), so that Child.reap() can SIGKILL the trainer's group before its pid can be reused.
    """

    def __init__(self, owner: WarmTrainer, pid: int, args: list[str], stdout) -> None:
        self.owner, self.pid, self.args, self.stdout = owner, pid, args, stdout
        self.returncode: int | None = None
        self._pidfd: int | None = None
        try:
            self._pidfd = os.pidfd_open(pid)  # its end, if the zygote dies before it
        except OSError:
            pass

    def poll(self) -> int | None:
        if self.returncode is not None:
            return self.returncode
        code = self.owner.exit_code(self.pid)
        if code is None and not self.owner.alive() and self._pidfd is not None:
            if select.select([self._pidfd], [], [], 0)[0]:
                code = STATUS_LOST
        return code

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.01)
        if self.returncode is None:
            self.returncode = code
            self.owner.release(self.pid)
            if self._pidfd is not None:
                os.close(self._pidfd)
        return code

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class WarmTrainer:
    """The daemon's side of one zygote at a time; thread-safe spawn, a reader thread for its messages."""

    def __init__(self, env: dict[str, str], popen_kwargs: dict[str, Any] | None = None,
                 log: Callable[..., None] | None = None, fingerprint_of: Callable[[], str] = fingerprint) -> None:
        self.env, self.popen_kwargs = env, dict(popen_kwargs or {})
        self.log = log or (lambda *a, **k: None)
        self.fingerprint_of = fingerprint_of
        self.lock = threading.Lock()
        self.proc: subprocess.Popen | None = None
        self.sock: socket.socket | None = None
        self.ready = threading.Event()
        self.dead = threading.Event()
        self.started_at = 0.0
        self.fp: str | None = None
        self.answers: queue.Queue = queue.Queue()
        self.exits: dict[int, int] = {}

    # ------------------------------------------------------------ its life
    def ensure(self) -> None:
        """Start a zygote in the background unless one is starting or up."""
        with self.lock:
            if self.proc is not None and not self.dead.is_set():
                return
            self._start()

    def _start(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.ready, self.dead, self.answers, self.exits, self.fp = threading.Event(), threading.Event(), queue.Queue(), {}, None
        self.started_at = time.monotonic()
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "daemon.supervisor.zygote", str(theirs.fileno()), "x" * zygote.PADDING],
                # Its imports' library noise stays out of the daemon's log; what goes wrong comes over the socket.
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=self.env, pass_fds=(theirs.fileno(),),
                cwd=str(zygote_root()), start_new_session=True, **self.popen_kwargs)
        except OSError as e:
            self.log("warm_trainer_failed", error=str(e))
            self.proc, self.sock = None, None
            ours.close()
            self.dead.set()
            return
        finally:
            theirs.close()
        self.sock = ours
        threading.Thread(target=self._read, args=(ours, self.ready, self.dead, self.answers, self.exits),
                         name="warm-trainer", daemon=True).start()

    def _read(self, sock, ready, dead, answers, exits) -> None:
        try:
            while msg := sock.recv(zygote.MAX_MSG):
                m = json.loads(msg)
                if "ready" in m:
                    self.fp = m["ready"]
                    ready.set()
                    self.log("warm_trainer_ready", pid=m.get("pid"), after_s=round(time.monotonic() - self.started_at, 2))
                elif "exited" in m:
                    exits[m["exited"]] = m["code"]
                else:
                    if "error" in m and not ready.is_set():
                        self.log("warm_trainer_failed", error=m["error"])
                    answers.put(m)
        except (OSError, ValueError):
            pass
        if not ready.is_set():
            self.log("warm_trainer_failed", error="it exited before its imports were done")
        dead.set()
        answers.put({"error": "the warm trainer is gone"})

    def alive(self) -> bool:
        return not self.dead.is_set()

    def warming(self) -> bool:
        """Starting, not yet ready, and not past the wait a queued job gives it."""
        return (self.proc is not None and not self.ready.is_set() and not self.dead.is_set()
                and time.monotonic() - self.started_at < WARMING_WAIT_S)

    def close(self) -> None:
        """Stop the zygote (not its children: they are trainers)."""
        with self.lock:
            self._drop()

    def _drop(self) -> None:
        if self.sock is not None:
            try:
                self.sock.shutdown(socket.SHUT_RDWR)  # EOF: it exits by itself (close alone would wait for our reader)
            except OSError:
                pass
            self.sock.close()
        if self.proc is not None:
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc, self.sock = None, None
        self.dead.set()

    # ------------------------------------------------------------ exits
    def exit_code(self, pid: int) -> int | None:
        return self.exits.get(pid)

    def release(self, pid: int) -> None:
        self.exits.pop(pid, None)
        try:
            with self.lock:
                if self.sock is not None:
                    self.sock.send(json.dumps({"reap": pid}).encode())
        except OSError:
            pass

    # ------------------------------------------------------------ a trainer
    def why_cold(self, cmd: list[str], env: dict[str, str]) -> str | None:
        """Why this trainer cannot be forked warm now; None if it can."""
        if self.proc is None or self.dead.is_set():
            return "no warm trainer"
        if not self.ready.is_set():
            return "the warm trainer is still importing"
        if not forkable(cmd):
            return "not a single engine.run process"
        differ = {k for k in env.keys() | self.env.keys() if env.get(k) != self.env.get(k)} - PER_TRAINER_ENV
        if differ:
            return f"environment read at import differs: {sorted(differ)[:5]}"
        if self.fingerprint_of() != self.fp:
            return "stale: lorad's files changed since it imported them"
        return None

    def spawn(self, cmd: list[str], cwd: str, env: dict[str, str], umask: int, stdout_w: int, stderr_fd: int,
              lock_fd: int) -> int | None:
        """The pid of a trainer forked warm, or None (cold start: the reason is logged; a stale or broken
        zygote is replaced in the background). Raises OSError if the zygote took the request and never
        answered: a trainer may exist, so this start must fail rather than start a second one cold."""
        with self.lock:
            why = self.why_cold(cmd, env)
            if why is not None:
                self.log("warm_trainer_skipped", reason=why)
                if why.startswith("stale") or self.dead.is_set():
                    self._drop()
                    self._start()
                return None
            assert self.sock is not None
            req = {"argv": cmd, "env": env, "cwd": cwd, "umask": umask, "lock_fd": lock_fd}
            fds = array.array("i", [stdout_w, stderr_fd, lock_fd])
            try:
                self.sock.sendmsg([json.dumps(req).encode()], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
            except OSError as e:
                self.log("warm_trainer_skipped", reason=f"request failed: {e}")
                self._drop()
                return None
            try:
                ans = self.answers.get(timeout=ANSWER_WAIT_S)
            except queue.Empty:
                self._drop()
                raise OSError("the warm trainer took the request and never answered") from None
            if "pid" not in ans:
                self.log("warm_trainer_skipped", reason=ans.get("error"))
                return None
            return int(ans["pid"])


def zygote_root():
    from daemon.supervisor.warm_fingerprint import REPO

    return REPO
