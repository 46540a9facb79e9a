"""`lorad submit --from`, the download: a background thread per job in state `fetching`.

Submit checks what it can at once (daemon/mirror/restore.py, `probe`) and accepts the job as `fetching`; this
thread downloads the newest usable remote checkpoint into home/mirror-staging/JOB_ID/ (walking back past torn or
corrupt ones, each with its reason), moves it into the job's directory, then queues the job. `lorad status` shows
its progress (files and bytes of the checkpoint being read). A network that fails is retried with backoff, like
the uploader; checkpoints the job cannot use (another job's settings, a newer lorad's format) end the job
`failed` with the reason. Nothing here is in the way of anything: the daemon may be SIGKILLed at any point, and
at its next start the download begins again from a clean staging folder (a job is queued only once its
checkpoint is in place, fsynced).
"""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from daemon.mirror.remote import MirrorError, Remote, check_key
from daemon.mirror.restore import Restored, describe, fetch
from daemon.store import states
from daemon.store.db import Store
from daemon.store.states import IllegalTransition
from daemon.system.log import job_event
from engine.errors import JobInvalid


class _Stopped(Exception):
    """The daemon stops, or the job was cancelled meanwhile: the download ends where it is."""


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


class Fetch:
    """The download of one fetching job; `status()` is read by `lorad status`, the dashboard and /metrics."""

    def __init__(self, job: dict[str, Any], key: str, remote: Remote, text: str, validate: Callable[[str], object],
                 store: Store, log, staging_root: Path, wake: Callable[[], None]):
        self.job_id, self.workdir, self.key = job["id"], Path(job["workdir"]), check_key(key)
        self.remote, self.text, self.validate = remote, text, validate
        self.store, self.log, self.wake = store, log, wake
        self.staging = staging_root / self.job_id
        self.progress = "starting"
        self.last_error: str | None = None
        self.done = False
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name=f"fetch-{self.job_id}", daemon=True)

    def start(self) -> Fetch:
        self.thread.start()
        return self

    def close(self, timeout: float = 0) -> None:
        self._stop.set()
        if timeout:
            self.thread.join(timeout)

    def status(self) -> dict[str, Any]:
        return {"mirror": self.remote.name, "key": self.key, "fetching": None if self.done else self.progress,
                "last_error": self.last_error}

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        delay = self.remote.settings.retry_base_s
        while not self._stop.is_set():
            try:
                self.staging.parent.mkdir(mode=0o700, exist_ok=True)
                shutil.rmtree(self.staging, ignore_errors=True)  # what a daemon killed mid-download left
                self.staging.mkdir(mode=0o700)
                got = fetch(self.remote, self.key, self.staging, self.validate, self.text, self._told)
                self._land(got)
                return
            except _Stopped:
                return
            except JobInvalid as e:
                self._fail(str(e))
                return
            except Exception as e:  # noqa: BLE001 — the network, the server, the disk: said once, retried
                self._failed(str(e) if isinstance(e, MirrorError) else f"{type(e).__name__}: {e}"[:500])
            self._stop.wait(delay)
            delay = min(delay * 2, self.remote.settings.retry_max_s)
        self.done = True

    def _told(self, name: str, files_done: int, files: int, bytes_done: int, total: int) -> None:
        self.progress = f"{name}: {files_done}/{files} files, {_mb(bytes_done)} of {_mb(total)}"
        if self._stop.is_set() or self.store.get(self.job_id)["state"] != states.FETCHING:
            raise _Stopped

    def _failed(self, error: str) -> None:
        if error != self.last_error:  # once per cause
            self.log.warning("mirror_fetch_failed", job=self.job_id, mirror=self.remote.name, error=error,
                             message="retried with backoff")
            job_event(self.workdir, self.job_id, "mirror_fetch_failed", level="warning", mirror=self.remote.name,
                      error=error)
        self.last_error = error
        self.progress = "retrying after an error"

    def _fail(self, reason: str) -> None:
        shutil.rmtree(self.staging, ignore_errors=True)
        self.done = True
        try:
            self.store.transition(self.job_id, states.FETCHING, states.FAILED, reason, last_error=reason)
        except IllegalTransition:
            return  # cancelled meanwhile
        self.log.warning("mirror_fetch_refused", job=self.job_id, error=reason)
        job_event(self.workdir, self.job_id, "mirror_fetch_refused", level="warning", error=reason)

    def _land(self, got: Restored) -> None:
        """The chosen checkpoint into the job's directory, durably, then the job into the queue."""
        dest = self.workdir / "checkpoints"
        for p in sorted(got.checkpoints.rglob("*")):
            fd = os.open(p, os.O_RDONLY | os.O_DIRECTORY if p.is_dir() else os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        shutil.rmtree(dest, ignore_errors=True)  # a landing cut short by a kill: this download replaces it
        got.checkpoints.rename(dest)
        fd = os.open(self.workdir, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        shutil.rmtree(self.staging, ignore_errors=True)
        said = describe(got)
        self.done = True
        try:
            self.store.transition(self.job_id, states.FETCHING, states.QUEUED, f"fetched from the mirror: {said}")
        except IllegalTransition:
            return  # cancelled meanwhile
        self.log.info("mirror_restored", job=self.job_id, mirror=self.remote.name, key=self.key, step=got.step,
                      skipped=got.skipped)
        job_event(self.workdir, self.job_id, "mirror_restored", mirror=self.remote.name, key=self.key,
                  step=got.step, skipped=[f"{n}: {why}" for n, why in got.skipped])
        self.wake()
