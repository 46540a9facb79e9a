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
from collections.abc import Callable
from typing import Any

from daemon.supervisor import zygote
from daemon.supervisor.warm_fingerprint import REPO, fingerprint
from engine.distributed.liveness import LIVENESS_DIR
from engine.memory_plan.attempt import BUDGET_ENV, PLAN_ENV

WARMING_WAIT_S = 30.0  # a queued job waits this long for a zygote still importing, then starts cold
ANSWER_WAIT_S = 30.0
STATUS_LOST = 255  # a warm trainer that outlived its zygote: its exit status went to init (treated as a crash)
# What may differ between the zygote's environment and a trainer's: read after import (CUDA at its first use,
# OMP_NUM_THREADS re-applied by the child, the liveness dir by engine.run, the memory plan's inputs by the recipe). Anything else may have been read
# while the zygote imported (HF_HOME, PYTORCH_*, ...): a trainer that needs it different starts cold.
PER_TRAINER_ENV = {LIVENESS_DIR, "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "OMP_NUM_THREADS", PLAN_ENV, BUDGET_ENV}


def forkable(cmd: list[str]) -> bool:
    """A command the zygote can run: one `python -m engine.run` process (not torchrun, not a test's script)."""
    return cmd[:3] == [sys.executable, "-m", "engine.run"]


class WarmPopen:
    """A trainer forked by the zygote, as the supervisor uses a Popen: pid, stdout, poll, wait, send_signal.

    poll() sees the exit (reported by the zygote) without collecting it; wait() collects it (returncode set, the
    zygote frees the pid), so that Child.reap() can SIGKILL the trainer's group before its pid can be reused.
    """

    def __init__(self, parent: Zygote, pid: int, args: list[str], stdout) -> None:
        self.parent, self.pid, self.args, self.stdout = parent, pid, args, stdout
        self.returncode: int | None = None
        self._pidfd: int | None = None
        try:
            self._pidfd = os.pidfd_open(pid)  # its end, if the zygote dies before it
        except OSError:
            pass

    def poll(self) -> int | None:
        if self.returncode is not None:
            return self.returncode
        code = self.parent.exits.get(self.pid)
        if code is None and self.parent.dead.is_set() and self._pidfd is not None:
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
            self.parent.release(self.pid)
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


class Zygote:
    """One zygote process, the daemon's side: its socket, a reader thread for its messages, its live children."""

    def __init__(self, env: dict[str, str], popen_kwargs: dict[str, Any], log: Callable[..., None]) -> None:
        self.log = log
        self.ready, self.dead = threading.Event(), threading.Event()
        self.answers: queue.Queue = queue.Queue()
        self.exits: dict[int, int] = {}  # reported by the zygote, not yet collected
        self.live: set[int] = set()  # forked, not yet collected
        self.fp: str | None = None
        self.retired = False  # replaced: it forks no more, and goes once its last child is collected
        self.lock = threading.Lock()
        self.started_at = time.monotonic()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "daemon.supervisor.zygote", str(theirs.fileno())],
                # Its imports' library noise stays out of the daemon's log; what goes wrong comes over the socket.
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
                pass_fds=(theirs.fileno(),), cwd=str(REPO), start_new_session=True, **popen_kwargs)
        except OSError:
            ours.close()
            raise
        finally:
            theirs.close()
        self.sock = ours
        threading.Thread(target=self._read, name="warm-trainer", daemon=True).start()

    def _read(self) -> None:
        try:
            while msg := self.sock.recv(zygote.MAX_MSG):
                m = json.loads(msg)
                if "ready" in m:
                    self.fp = m["ready"]
                    self.ready.set()
                    self.log("warm_trainer_ready", pid=m.get("pid"),
                             after_s=round(time.monotonic() - self.started_at, 2))
                elif "exited" in m:
                    self.exits[m["exited"]] = m["code"]
                else:
                    if "error" in m and not self.ready.is_set():
                        self.log("warm_trainer_failed", error=m["error"])
                    self.answers.put(m)
        except (OSError, ValueError):
            pass
        if not self.ready.is_set():
            self.log("warm_trainer_failed", error="it exited before its imports were done")
        self.dead.set()
        self.answers.put({"error": "the warm trainer is gone", "gone": True})

    def fork(self, req: dict[str, Any], fds: list[int]) -> int | None:
        """Ask for one trainer: its pid, or None (the reason logged). OSError if the zygote never answered."""
        with self.lock:
            try:
                self.sock.sendmsg([json.dumps(req).encode()],
                                  [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
            except OSError as e:
                self.log("warm_trainer_skipped", reason=f"request failed: {e}")
                return None
            try:
                ans = self.answers.get(timeout=ANSWER_WAIT_S)
            except queue.Empty:
                raise OSError("the warm trainer took the request and never answered") from None
            if ans.get("gone"):  # it may have died after forking: a trainer may hold the job's lock
                raise OSError("the warm trainer took the request and died before answering")
            if "pid" not in ans:
                self.log("warm_trainer_skipped", reason=ans.get("error"))
                return None
            self.live.add(int(ans["pid"]))
            return int(ans["pid"])

    def release(self, pid: int) -> None:
        """A child's status is collected: the zygote may free its pid; a retired zygote goes with its last."""
        with self.lock:
            self.exits.pop(pid, None)
            self.live.discard(pid)
            try:
                self.sock.send(json.dumps({"reap": pid}).encode())
            except OSError:
                pass
        if self.retired and not self.live:
            self.stop()

    def stop(self) -> None:
        """End it now, leaving any children alone (they lead sessions of their own): no wait for an EOF that a
        zygote still importing would read only when done."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # close() alone would wait for our reader's recv
        except OSError:
            pass
        self.sock.close()
        self.proc.kill()
        self.proc.wait()
        self.dead.set()


class WarmTrainer:
    """The daemon's warm trainer: the current zygote (started on demand), and replaced ones that still have
    children to report on."""

    def __init__(self, env: dict[str, str], popen_kwargs: dict[str, Any] | None = None,
                 log: Callable[..., None] | None = None, fingerprint_of: Callable[[], str] = fingerprint) -> None:
        self.env, self.popen_kwargs = env, dict(popen_kwargs or {})
        self.log = log or (lambda *a, **k: None)
        self.fingerprint_of = fingerprint_of
        self.lock = threading.Lock()
        self.current: Zygote | None = None

    def ensure(self) -> None:
        """Start a zygote in the background unless one is starting or up."""
        with self.lock:
            if self.current is None or self.current.dead.is_set():
                self._replace()

    def _replace(self) -> None:
        old, self.current = self.current, None
        if old is not None:
            old.retired = True
            if not old.live:
                old.stop()
        try:
            self.current = Zygote(self.env, self.popen_kwargs, self.log)
        except OSError as e:
            self.log("warm_trainer_failed", error=str(e))

    def warming(self) -> bool:
        """Starting, not yet ready, and not past the wait a queued job gives it."""
        z = self.current
        return (z is not None and not z.ready.is_set() and not z.dead.is_set()
                and time.monotonic() - z.started_at < WARMING_WAIT_S)

    def close(self) -> None:
        """Stop the zygote (not its children: they are trainers)."""
        with self.lock:
            if self.current is not None:
                self.current.stop()
                self.current = None

    def why_cold(self, cmd: list[str], env: dict[str, str]) -> str | None:
        """Why this trainer cannot be forked warm now; None if it can."""
        z = self.current
        if not forkable(cmd):
            return "not a single engine.run process"
        if z is None or z.dead.is_set():
            return "no warm trainer"
        if not z.ready.is_set():
            return "the warm trainer is still importing"
        differ = {k for k in env.keys() | self.env.keys() if env.get(k) != self.env.get(k)} - PER_TRAINER_ENV
        if differ:
            return f"environment read at import differs: {sorted(differ)[:5]}"
        if self.fingerprint_of() != z.fp:
            return "stale: lorad's files changed since it imported them"
        return None

    def spawn(self, cmd: list[str], cwd: str, env: dict[str, str], umask: int, stdout_w: int, stderr_fd: int,
              lock_fd: int) -> tuple[Zygote, int] | None:
        """A trainer forked warm (its zygote and pid), or None (cold start: the reason is logged; a stale or dead
        zygote is replaced in the background). Raises OSError if the zygote took the request and never answered
        (silent, or dead): a trainer may exist, so this start must fail rather than start a second one cold."""
        with self.lock:
            why = self.why_cold(cmd, env)
            if why is not None:
                self.log("warm_trainer_skipped", reason=why)
                if why.startswith("stale"):
                    self._replace()  # a dead one is restarted by ensure(), when a job is next queued
                return None
            z = self.current
            assert z is not None
            req = {"argv": cmd, "env": env, "cwd": cwd, "umask": umask, "lock_fd": lock_fd}
            try:
                pid = z.fork(req, [stdout_w, stderr_fd, lock_fd])
            except OSError:
                self._replace()
                raise
            return None if pid is None else (z, pid)
