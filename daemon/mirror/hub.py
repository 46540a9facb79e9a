"""`output.push_to_hub: REPO`: a succeeded job's final adapter uploaded to the Hugging Face Hub, in the background.

Never part of success: the job is `succeeded` before the push starts, and a push that fails (the network, a
token without write access, a repo name taken) is said once per cause (the daemon's log, the job's events,
`lorad status`) and retried with backoff until it lands or the daemon stops. The token is huggingface_hub's own
(HF_TOKEN, or `hf auth login`'s file): lorad never reads or writes it. The output is copied out of the job's
directory first, through descriptors that never follow a symlink (daemon/mirror/uploader.py), so the trainer user
cannot make the daemon publish someone else's file.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from daemon.mirror.uploader import files_in_job, read_in_job
from daemon.system.log import job_event

RETRY_BASE_S = 10.0
RETRY_MAX_S = 900.0


class HubPush:
    """One job's push: a thread that tries until the output is on the Hub (or it is closed)."""

    def __init__(self, job_id: str, workdir: Path, repo: str, log, retry_base_s: float = RETRY_BASE_S,
                 retry_max_s: float = RETRY_MAX_S, endpoint: str | None = None):
        self.job_id, self.workdir, self.repo, self.log = job_id, Path(workdir), repo, log
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
            for rel in files_in_job(self.workdir, "output"):
                (staging / rel).parent.mkdir(parents=True, exist_ok=True)
                (staging / rel).write_bytes(read_in_job(self.workdir, f"output/{rel}"))
            api = HfApi(endpoint=self.endpoint)
            api.create_repo(self.repo, private=True, exist_ok=True)
            api.upload_folder(repo_id=self.repo, folder_path=staging,
                              commit_message=f"lorad: {self.job_id}, trained {time.strftime('%Y-%m-%d')}")
        finally:
            shutil.rmtree(staging, ignore_errors=True)
