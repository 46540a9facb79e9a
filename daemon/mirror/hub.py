"""`output.push_to_hub: REPO`: a succeeded job's final adapter uploaded to the Hugging Face Hub, in the background.

Never part of success: the job is `succeeded` before the push starts, and a push that fails (the network, a
token without write access, a repo name taken) is said once per cause (the daemon's log, the job's events,
`lorad status`) and retried with backoff until it lands or the daemon stops. The token is huggingface_hub's own
(HF_TOKEN, or `hf auth login`'s file): lorad never reads or writes it.

Where it may write: only repos under the daemon config's `hub_namespaces` (none by default). A job naming another
is refused at intake (daemon/config/daemon.py `check_hub_repo`), and the push checks again before it calls the
Hub at all, so the daemon's token is never used on any other repo whatever a job file says.

What goes: the output is copied out of the job's directory first, through descriptors that never follow a symlink
(daemon/mirror/uploader.py), so the trainer user cannot make the daemon publish someone else's file; and no
absolute path of this machine goes with it (`stage`): in the text files (lorad-output.json, README.md,
adapter_config.json) and in the safetensors headers' metadata, each one is cut to its last part.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from daemon.config.daemon import check_hub_repo
from daemon.mirror.uploader import chunks_in_job, files_in_job, open_in_job
from daemon.system.log import job_event
from engine.errors import JobInvalid

TEXT_SUFFIXES = (".json", ".md", ".txt", ".yaml", ".yml")
TEXT_MAX = 16 << 20  # a text file of the output larger than this is not published (an adapter's are kilobytes)
HEADER_MAX = 100 << 20  # safetensors' own limit on a header
# An absolute path: "/" not preceded by what would make it part of a URL or a relative path, then 2+ parts.
ABSOLUTE = re.compile(r"(?<![\w.:/~-])/(?:[\w.@+%=,-]+/)+[\w.@+%=,-]*")


def local_paths(doc: Any, *more: Path) -> list[str]:
    """The absolute paths a job's config names (model, data, ...) and `more`, longest first."""
    found: set[str] = {str(p) for p in more}

    def walk(v: Any) -> None:
        if isinstance(v, dict):
            for x in v.values():
                walk(x)
        elif isinstance(v, list):
            for x in v:
                walk(x)
        elif isinstance(v, str) and v.startswith("/") and len(v) > 1:
            found.add(v.rstrip("/"))

    walk(doc)
    return sorted(found, key=len, reverse=True)


def scrub_paths(text: str, paths: list[str]) -> str:
    """TEXT with every absolute path cut to its last part: the known ones first (they may hold spaces), then any."""
    for p in paths:
        text = text.replace(p, os.path.basename(p) or ".")
    return ABSOLUTE.sub(lambda m: os.path.basename(m.group(0).rstrip("/")) or ".", text)


def stage(workdir: Path, staging: Path, paths: list[str]) -> list[str]:
    """The job's output/ copied into staging (streamed, through descriptors), its absolute paths scrubbed; the
    files staged."""
    names = files_in_job(workdir, "output")
    for rel in names:
        dest = staging / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        if rel.endswith(TEXT_SUFFIXES):
            data = b"".join(_bounded(chunks_in_job(workdir, f"output/{rel}"), TEXT_MAX, rel))
            dest.write_text(scrub_paths(data.decode("utf-8", errors="replace"), paths), encoding="utf-8")
        elif rel.endswith(".safetensors"):
            _stage_safetensors(workdir, f"output/{rel}", dest, paths)
        else:
            with open(dest, "wb") as f:
                for chunk in chunks_in_job(workdir, f"output/{rel}"):
                    f.write(chunk)
    return names


def _bounded(chunks, most: int, rel: str):
    n = 0
    for chunk in chunks:
        n += len(chunk)
        if n > most:
            raise ValueError(f"output/{rel} is larger than {most} bytes: not published")
        yield chunk


def _stage_safetensors(workdir: Path, rel: str, dest: Path, paths: list[str]) -> None:
    """A safetensors file with its header's __metadata__ scrubbed; the tensors streamed as they are (offsets in
    the header count from the end of the header, so only its length changes)."""
    fd = open_in_job(workdir, rel)
    try:
        with os.fdopen(fd, "rb", closefd=False) as src, open(dest, "wb") as out:
            raw_len = src.read(8)
            (n,) = struct.unpack("<Q", raw_len) if len(raw_len) == 8 else (HEADER_MAX + 1,)
            if n > HEADER_MAX:
                raise ValueError(f"{rel}: not a safetensors file (header of {n} bytes): not published")
            header = json.loads(src.read(n))
            md = header.get("__metadata__")
            if isinstance(md, dict):
                header["__metadata__"] = {k: scrub_paths(v, paths) if isinstance(v, str) else v for k, v in md.items()}
            new = json.dumps(header, separators=(",", ":")).encode()
            new += b" " * (-len(new) % 8)  # the data stays 8-byte aligned, as safetensors writes it
            out.write(struct.pack("<Q", len(new)) + new)
            shutil.copyfileobj(src, out, 1 << 20)
    finally:
        os.close(fd)


RETRY_BASE_S = 10.0
RETRY_MAX_S = 900.0


class HubPush:
    """One job's push: a thread that tries until the output is on the Hub (or it is closed)."""

    def __init__(self, job_id: str, workdir: Path, repo: str, log, namespaces: list[str], paths: list[str] = (),
                 retry_base_s: float = RETRY_BASE_S, retry_max_s: float = RETRY_MAX_S, endpoint: str | None = None):
        self.job_id, self.workdir, self.repo, self.log = job_id, Path(workdir), repo, log
        self.namespaces = list(namespaces)  # the daemon config's hub_namespaces: where the token may write
        # What never leaves the machine: the paths its job names (local_paths), its directory.
        self.paths = sorted({*paths, str(self.workdir)}, key=len, reverse=True)
        self.endpoint = endpoint  # None: huggingface_hub's (HF_ENDPOINT, else the Hub)
        self.retry_base_s, self.retry_max_s = retry_base_s, retry_max_s
        self.pushed = False
        self.error: str | None = None
        self.tries = 0
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name=f"hub-{job_id}", daemon=True)

    def start(self) -> HubPush:
        self.thread.start()
        return self

    def close(self) -> None:
        self._stop.set()

    def status(self) -> dict[str, Any]:
        return {"hub_repo": self.repo, "hub_pushed": self.pushed, "hub_error": self.error}

    def _run(self) -> None:
        try:
            check_hub_repo(self.repo, self.namespaces)  # again: the config may have changed since the job was accepted
        except JobInvalid as e:
            self.error = str(e)  # never retried: nothing is sent anywhere
            self.log.error("hub_push_refused", job=self.job_id, repo=self.repo, error=self.error)
            job_event(self.workdir, self.job_id, "hub_push_refused", level="error", repo=self.repo, error=self.error)
            return
        delay = self.retry_base_s
        while not self._stop.is_set():
            self.tries += 1
            try:
                self._push()
            except Exception as e:  # noqa: BLE001 — network, permission, a bad name: reported and retried
                error = f"{type(e).__name__}: {e}"[:500]
                if error != self.error:
                    self.log.warning("hub_push_failed", job=self.job_id, repo=self.repo, error=error,
                                     message="retried with backoff; the job's success does not depend on it")
                    job_event(self.workdir, self.job_id, "hub_push_failed", level="warning", repo=self.repo,
                              error=error)
                self.error = error
                self._stop.wait(delay)
                delay = min(delay * 2, self.retry_max_s)
                continue
            self.pushed, self.error = True, None
            self.log.info("hub_pushed", job=self.job_id, repo=self.repo, tries=self.tries)
            job_event(self.workdir, self.job_id, "hub_pushed", repo=self.repo)
            return

    def _push(self) -> None:
        from huggingface_hub import HfApi

        staging = Path(tempfile.mkdtemp(prefix="lorad-hub-"))
        try:
            stage(self.workdir, staging, self.paths)
            api = HfApi(endpoint=self.endpoint)
            api.create_repo(self.repo, private=True, exist_ok=True)
            api.upload_folder(repo_id=self.repo, folder_path=staging,
                              commit_message=f"lorad: {self.job_id}, trained {time.strftime('%Y-%m-%d')}")
        finally:
            shutil.rmtree(staging, ignore_errors=True)
