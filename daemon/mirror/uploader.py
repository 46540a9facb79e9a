"""One job's uploader: a background thread that copies what the job commits to its mirror, one upload at a time.

Remote layout under MIRROR/KEY/ (KEY: the job id that first mirrored it):

    job.yaml                        the job as the daemon accepted it
    checkpoints/step-N/...          each file of a committed checkpoint, then its manifest.json LAST
    events/START-END.jsonl          events.jsonl appended in chunks (bytes START..END of the local file)
    output/...                      the final output, its lorad-output.json last

A remote checkpoint without its manifest is never used (daemon/mirror/restore.py), so a kill between files
leaves nothing that can be chosen. Each file's sha256 is checked against the local manifest before it goes:
a local file that no longer matches (pruned, damaged) is not uploaded. Only the newest committed checkpoint is
uploaded (commits that land during an upload are coalesced); remote pruning keeps the job's checkpoint.keep
newest complete ones, and runs only after the newer manifest has landed. A failure is retried with backoff,
forever: the mirror being down never fails the job, and the trainer never waits for it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from daemon.mirror.remote import CHUNK, MirrorError, Remote, check_key
from daemon.supervisor.disk_progress import committed_checkpoints
from daemon.system.log import job_event
from daemon.system.safe_files import open_at, opened_dir, read_fd

STEP_DIR = re.compile(r"^step-(\d{8})$")
EVENT_CHUNK = re.compile(r"^(\d{12})-(\d{12})\.jsonl$")
EVENTS_EVERY_S = 30.0  # events are appended at least this often while nothing else is to do
EVENT_CHUNK_MAX = 4 << 20
JOB_YAML_MAX = 1 << 20  # a remote job.yaml read back: larger than any job file the daemon accepts
MANIFEST_MAX = 16 << 20  # a remote manifest.json: a checkpoint of many thousand files, sizes and sha256s
OUTPUT_STAMP = "lorad-output.json"  # engine/checkpoint/output.py: written last into output/, so uploaded last


def debug_delay(var: str) -> float:
    """Fault-injection hooks for tests: a pause after each file sent (LORAD_DEBUG_MIRROR_FILE_DELAY_S, widening the
    window between two files of one upload) or fetched (LORAD_DEBUG_MIRROR_FETCH_DELAY_S, a slow link)."""
    try:
        return float(os.environ.get(var, "0"))
    except ValueError:
        return 0.0


def remote_steps(remote: Remote, key: str) -> list[str]:
    """The checkpoint-named directories of KEY on the remote, newest first (complete or not)."""
    return sorted((n for n in remote.listdir(f"{key}/checkpoints") if STEP_DIR.match(n)), reverse=True)


class JobMirror:
    """The uploader of one job; the supervisor tells it of commits and of the end, the status reads its lag."""

    def __init__(self, job_id: str, workdir: Path, key: str, remote: Remote, keep: int, job_text: str, log,
                 on_caught_up=None):
        self.job_id, self.workdir, self.key = job_id, Path(workdir), check_key(key)
        self.on_caught_up = on_caught_up  # (job id) → None, after a pass that left the mirror caught up
        self.remote, self.keep, self.job_text, self.log = remote, keep, job_text, log
        self.cond = threading.Condition()
        self.local_step: int | None = None  # the newest commit heard of
        self.commit_times: dict[int, float] = {}  # step → when its commit was heard (for the lag in seconds)
        self.remote_step: int | None = None  # the newest complete remote checkpoint
        self.want_output = False
        self.output_done = False
        self.last_upload_at: float | None = None
        self.last_error: str | None = None
        self.events_offset: int | None = None
        self.job_uploaded = False
        self._kick = True
        self._stop = False
        self.thread = threading.Thread(target=self._run, name=f"mirror-{job_id}", daemon=True)

    def start(self) -> JobMirror:
        self.thread.start()
        return self

    # ------------------------------------------------------------------ told by the supervisor
    def committed(self, step: int) -> None:
        with self.cond:
            if self.local_step is None or step > self.local_step:
                self.local_step = step
                self.commit_times[step] = time.time()
            self._kick = True
            self.cond.notify()

    def finished(self) -> None:
        """The job succeeded: its output goes next (and the events' last chunk)."""
        with self.cond:
            self.want_output = True
            self._kick = True
            self.cond.notify()

    def close(self, timeout: float = 0) -> None:
        with self.cond:
            self._stop = True
            self.cond.notify()
        if timeout:
            self.thread.join(timeout)

    # ------------------------------------------------------------------ read by the status
    def status(self) -> dict[str, Any]:
        with self.cond:
            behind = 0 if self.local_step is None else max(0, self.local_step - (self.remote_step or 0))
            unmirrored = [t for s, t in self.commit_times.items() if self.remote_step is None or s > self.remote_step]
            return {
                "mirror": self.remote.name, "key": self.key, "local_step": self.local_step,
                "remote_step": self.remote_step, "behind_steps": behind,
                "behind_s": round(time.time() - min(unmirrored), 1) if unmirrored else 0.0,
                "last_upload_at": self.last_upload_at, "last_error": self.last_error,
                "output_mirrored": self.output_done,
                "caught_up": behind == 0 and (self.output_done or not self.want_output),
            }

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        delay = self.remote.settings.retry_base_s
        while True:
            with self.cond:
                if not self._kick and not self._stop:
                    self.cond.wait(EVENTS_EVERY_S)
                if self._stop:
                    return
                self._kick = False
            try:
                self._pass()
            except Exception as e:  # noqa: BLE001 — whatever it is, the job goes on; said, retried with backoff
                self._failed(str(e) if isinstance(e, MirrorError) else f"{type(e).__name__}: {e}"[:500])
                with self.cond:
                    self.cond.wait(delay)  # the backoff; a stop ends it
                    self._kick = True
                delay = min(delay * 2, self.remote.settings.retry_max_s)
                continue
            delay = self.remote.settings.retry_base_s
            if self.on_caught_up is not None and self.status()["caught_up"]:
                self.on_caught_up(self.job_id)
            if self.last_error is not None:
                self.log.info("mirror_recovered", job=self.job_id, mirror=self.remote.name)
                job_event(self.workdir, self.job_id, "mirror_recovered", mirror=self.remote.name)
                self.last_error = None

    def _failed(self, error: str) -> None:
        if error != self.last_error:  # once per cause: a mirror that is down says so once, not every retry
            self.log.warning("mirror_failed", job=self.job_id, mirror=self.remote.name, error=error,
                             message="retried with backoff; training goes on")
            job_event(self.workdir, self.job_id, "mirror_failed", level="warning", mirror=self.remote.name,
                      error=error)
        self.last_error = error

    def _pass(self) -> None:
        if not self.job_uploaded:
            self._claim()
            self.remote.put(f"{self.key}/job.yaml", self.job_text.encode())
            self.job_uploaded = True
        if self.remote_step is None:
            self.remote_step = newest_remote(self.remote, self.key)
        local = committed_checkpoints(self.workdir)
        if local and (self.remote_step is None or local[0].step > self.remote_step):
            try:
                self._upload_checkpoint(local[0].step, local[0].path)
            except FileNotFoundError:
                # Pruned locally while it went (newer commits came): the next pass takes the newest, at once.
                with self.cond:
                    self._kick = True
                return
        self._prune()
        output = self.want_output and not self.output_done
        if output:
            self._upload_output()
        self._events()  # after the output: its own event goes with it
        if output:
            with self.cond:
                self.output_done = True

    def _upload_checkpoint(self, step: int, path: Path) -> None:
        name = path.name
        manifest_bytes = read_in_job(self.workdir, f"checkpoints/{name}/manifest.json", most=MANIFEST_MAX + 1)
        if len(manifest_bytes) > MANIFEST_MAX:
            raise MirrorError(f"{name}/manifest.json is larger than {MANIFEST_MAX} bytes: not uploaded")
        files = json.loads(manifest_bytes)["files"]
        delay = debug_delay("LORAD_DEBUG_MIRROR_FILE_DELAY_S")
        for rel, meta in files.items():
            # FileNotFoundError: pruned meanwhile → the next pass takes a newer one
            self.remote.put_stream(f"{self.key}/checkpoints/{name}/{rel}",
                                   checked_chunks(self.workdir, f"checkpoints/{name}/{rel}", meta["sha256"]))
            if delay:
                time.sleep(delay)
        self.remote.put(f"{self.key}/checkpoints/{name}/manifest.json", manifest_bytes)  # last: now it counts
        with self.cond:
            self.remote_step = step
            self.last_upload_at = time.time()
            self.commit_times = {s: t for s, t in self.commit_times.items() if s > step}
            if self.local_step is None or step > self.local_step:
                self.local_step = step
        self.log.info("mirror_uploaded", job=self.job_id, mirror=self.remote.name, step=step, files=len(files) + 1)

    def _claim(self) -> None:
        """The key's prefix is this job's, or empty: another job there (one of another machine with the same id)
        is never overwritten or pruned."""
        if "job.yaml" not in self.remote.listdir(self.key):  # a listing: its errors say most (a bad signature)
            return
        try:
            there = self.remote.get(f"{self.key}/job.yaml", JOB_YAML_MAX)
        except FileNotFoundError:
            return
        if there != self.job_text.encode():
            raise MirrorError(f"mirror {self.remote.name!r}: {self.key}/ holds another job (its job.yaml differs): "
                              f"nothing of this job is written there")

    def _prune(self) -> None:
        """Keep the newest `keep` complete remote checkpoints; torn ones older than the newest complete go too."""
        if self.remote_step is None:
            return
        names = [n for n in self.remote.listdir(f"{self.key}/checkpoints") if STEP_DIR.match(n)]
        kept = 0
        for n in sorted(names, reverse=True):
            step = int(n[5:])
            if step > self.remote_step:
                continue  # an upload cut short after the newest: replaced when that step is uploaded again
            if kept < self.keep and (step == self.remote_step
                                     or self.remote.exists(f"{self.key}/checkpoints/{n}/manifest.json")):
                kept += 1
                continue
            self.remote.remove(f"{self.key}/checkpoints/{n}")

    def _events(self) -> None:
        if self.events_offset is None:
            ends = [int(m.group(2)) for n in self.remote.listdir(f"{self.key}/events") if (m := EVENT_CHUNK.match(n))]
            self.events_offset = max(ends, default=0)
        try:
            data = read_in_job(self.workdir, "events.jsonl", self.events_offset, EVENT_CHUNK_MAX)
        except OSError:
            return  # not there yet, or not a regular file of the job's own (a planted symlink): nothing to send
        data = data[: data.rfind(b"\n") + 1]  # whole lines only
        if not data:
            return
        start, end = self.events_offset, self.events_offset + len(data)
        self.remote.put(f"{self.key}/events/{start:012d}-{end:012d}.jsonl", data)
        self.events_offset = end
        if len(data) >= EVENT_CHUNK_MAX // 2:
            self._kick = True  # more to send

    def _upload_output(self) -> None:
        names = files_in_job(self.workdir, "output")
        for rel in sorted(names, key=lambda n: n == OUTPUT_STAMP):  # its stamp last
            self.remote.put_stream(f"{self.key}/output/{rel}", chunks_in_job(self.workdir, f"output/{rel}"))
        self.last_upload_at = time.time()
        self.log.info("mirror_output_uploaded", job=self.job_id, mirror=self.remote.name, files=len(names))
        job_event(self.workdir, self.job_id, "mirror_output_uploaded", mirror=self.remote.name)


def open_in_job(workdir: Path, rel: str) -> int:
    """A read descriptor of workdir/REL reached through directory descriptors that never follow a symlink: the
    trainer user writes below the job directory, and must not make the daemon upload a file of someone else."""
    parts = rel.split("/")
    if not rel or rel.startswith("/") or any(part in ("", ".", "..") for part in parts):
        raise FileNotFoundError(f"{rel!r} is not a path inside the job")
    with opened_dir(Path(workdir)) as top:
        fds = [top]
        try:
            for d in parts[:-1]:
                fds.append(os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fds[-1]))
            return open_at(fds[-1], parts[-1])
        finally:
            for fd in fds[1:]:
                os.close(fd)


def chunks_in_job(workdir: Path, rel: str) -> Iterator[bytes]:
    """workdir/REL (opened as open_in_job does) in CHUNK-sized pieces: a large file never sits in memory whole."""
    fd = open_in_job(workdir, rel)
    try:
        while chunk := os.read(fd, CHUNK):
            yield chunk
    finally:
        os.close(fd)


def checked_chunks(workdir: Path, rel: str, sha256: str) -> Iterator[bytes]:
    """chunks_in_job, hashed as they go: MirrorError after the last one when they do not match `sha256` (a file
    changed since its commit; what was sent is never made part of a checkpoint, its manifest goes after it)."""
    h = hashlib.sha256()
    for chunk in chunks_in_job(workdir, rel):
        h.update(chunk)
        yield chunk
    if h.hexdigest() != sha256:
        raise MirrorError(f"{rel.removeprefix('checkpoints/')} no longer matches its checksum locally: not uploaded")


def read_in_job(workdir: Path, rel: str, offset: int = 0, most: int = EVENT_CHUNK_MAX) -> bytes:
    fd = open_in_job(workdir, rel)
    try:
        if offset:
            os.lseek(fd, offset, os.SEEK_SET)
        return read_fd(fd, most)
    finally:
        os.close(fd)


def files_in_job(workdir: Path, rel: str) -> list[str]:
    """The regular files below workdir/REL (relative to it), no symlink followed; [] when it is not there."""
    out = []
    try:
        with opened_dir(Path(workdir)) as top:
            for root, _dirs, files, root_fd in os.fwalk(rel, dir_fd=top, follow_symlinks=False):
                for name in files:
                    if stat.S_ISREG(os.stat(name, dir_fd=root_fd, follow_symlinks=False).st_mode):
                        out.append(f"{root}/{name}"[len(rel) + 1:])
    except OSError:
        return []
    return sorted(out)


def newest_remote(remote: Remote, key: str) -> int | None:
    """The newest remote checkpoint that has its manifest (None: none yet)."""
    for n in remote_steps(remote, key):
        if remote.exists(f"{key}/checkpoints/{n}/manifest.json"):
            return int(n[5:])
    return None
