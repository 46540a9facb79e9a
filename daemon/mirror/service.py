"""The daemon's mirrors: which job goes to which mirror, one uploader per job, the lag, and restores.

The supervisor tells it of each committed checkpoint (the trainer's `checkpoint_committed` heartbeat) and of a
job's success; it never waits for it. A job's mirror: the mirror it was restored from (its store row's source,
`mirror:NAME/KEY`, which the trainer user cannot rewrite), else its `output.mirror`, else the daemon's
`default_mirror`. A job is `succeeded` as soon as its trainer is done; until its output is mirrored, `lorad
status` says "done, mirror behind" (docs/mirror.md).

Across restarts: the jobs whose mirror may be behind are kept in state.db (meta `mirror_pending`, from the first
commit or success heard of until a job in a final state has its mirror caught up); at start (`resume`) each gets
its uploader again, which uploads what the remote lacks, a succeeded job's output last. Jobs still `fetching`
from a mirror (`lorad submit --from`) start their download again.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from daemon.config.daemon import DaemonConfig
from daemon.intake.checks import Checks
from daemon.mirror.fetcher import Fetch
from daemon.mirror.hub import HubPush, local_paths
from daemon.mirror.remote import MirrorError, Remote, check_key
from daemon.mirror.uploader import JobMirror
from daemon.store import states
from daemon.store.db import Store
from daemon.store.errors import UnknownJob
from daemon.supervisor.accepted_job import accepted_doc
from daemon.supervisor.disk_progress import committed_checkpoints
from daemon.system.log import job_event
from engine.config.checkpoint import CheckpointConfig
from engine.errors import JobInvalid

SOURCE_PREFIX = "mirror:"  # a restored job's store source: mirror:NAME/KEY
PENDING = "mirror_pending"  # state.db meta: the ids of the jobs whose mirror may be behind (a JSON list)


class Mirrors:
    def __init__(self, home: Path, cfg: DaemonConfig, store: Store, log):
        self.home, self.cfg, self.store, self.log = Path(home), cfg, store, log
        self.jobs: dict[str, JobMirror] = {}
        self.problems: dict[str, dict[str, Any]] = {}  # job id → a status that says why it has no uploader
        self.hub: dict[str, HubPush] = {}  # output.push_to_hub: one push per succeeded job that asks for it
        self.fetches: dict[str, Fetch] = {}  # lorad submit --from: the downloads of the jobs in state fetching
        self.lock = threading.Lock()
        self.pending: set[str] = set(json.loads(store.get_meta(PENDING) or "[]"))
        self.wake: Callable[[], None] = lambda: None  # the supervisor's: a fetched job is queued
        # A fetched job's files (data.path, ...) are read as the intake's are: in a worker with a deadline, so a
        # FIFO or a hung mount it names fails the fetch naming the path instead of pinning its thread for ever.
        self.checks = Checks(cfg.intake_check_s, log)

    # ------------------------------------------------------------------ across restarts
    def resume(self, wake: Callable[[], None] | None = None) -> None:
        """At start: uploaders for the jobs whose mirror may be behind, downloads for the jobs still fetching."""
        if wake is not None:
            self.wake = wake
        for job in self.store.jobs((states.FETCHING,)):
            try:
                self._fetch(job)
            except MirrorError as e:  # its mirror left the config: nothing could ever fetch it
                self.store.transition(job["id"], states.FETCHING, states.FAILED, str(e), last_error=str(e))
                self.log.error("mirror_fetch_refused", job=job["id"], error=str(e))
        for job_id in sorted(self.pending):
            try:
                job = self.store.get(job_id)
            except UnknownJob:
                self._settled(job_id)
                continue
            try:
                if (m := self._uploader(job_id)) is None:
                    self._settled(job_id)
                    continue
                if local := committed_checkpoints(Path(job["workdir"])):
                    m.committed(local[0].step)
                if job["state"] == states.SUCCEEDED:
                    m.finished()
            except Exception as e:  # noqa: BLE001 — one job's mirror never keeps the daemon from starting
                self.log.error("mirror_internal", job=job_id, error=f"{type(e).__name__}: {e}")

    def _behind(self, job_id: str) -> None:
        with self.lock:
            if job_id in self.pending:
                return
            self.pending.add(job_id)
            self.store.set_meta(PENDING, json.dumps(sorted(self.pending)))

    def _settled(self, job_id: str) -> None:
        with self.lock:
            if job_id not in self.pending:
                return
            self.pending.discard(job_id)
            self.store.set_meta(PENDING, json.dumps(sorted(self.pending)))

    def _caught_up(self, job_id: str) -> None:
        """Told by an uploader after a pass that left it caught up: a job that will commit nothing more is settled."""
        if job_id not in self.pending or (state := self.store.get(job_id)["state"]) not in states.FINAL:
            return
        if state == states.SUCCEEDED and not self.jobs[job_id].output_done:
            return  # its uploader may not have been told of the success yet: the output is still to go
        self._settled(job_id)

    # ------------------------------------------------------------------ which mirror
    def target(self, job: dict[str, Any]) -> tuple[str, str] | None:
        """(mirror name, remote key) a job uploads to, or None when it is not mirrored. The key is always the job's
        own id: a job restored from KEY (`--from`) only reads KEY, and mirrors itself under its own id."""
        if (origin := self.origin(job)) is not None:
            return origin[0], job["id"]
        name = (accepted_doc(self.store, job).get("output") or {}).get("mirror") or self.cfg.default_mirror
        return (name, job["id"]) if name else None

    @staticmethod
    def origin(job: dict[str, Any]) -> tuple[str, str] | None:
        """(mirror name, key) a job was restored from (its store source, mirror:NAME/KEY), else None."""
        src = job.get("source") or ""
        if not src.startswith(SOURCE_PREFIX):
            return None
        name, _, key = src[len(SOURCE_PREFIX):].partition("/")
        return name, key

    def remote(self, name: str, read_only: bool = False) -> Remote:
        if name not in self.cfg.mirrors:
            raise MirrorError(f"mirror {name!r} is not in this daemon's config (mirrors: {sorted(self.cfg.mirrors)})")
        return Remote(name, self.cfg.mirrors[name], read_only=read_only)

    def _uploader(self, job_id: str) -> JobMirror | None:
        with self.lock:
            if job_id in self.jobs or job_id in self.problems:
                return self.jobs.get(job_id)
            job = self.store.get(job_id)
            where = self.target(job)
            if where is None:
                self.problems[job_id] = {}
                return None
            try:
                remote = self.remote(where[0])
            except MirrorError as e:
                self.problems[job_id] = {"mirror": where[0], "last_error": str(e), "behind_steps": None}
                self.log.warning("mirror_unknown", job=job_id, error=str(e), message="the job trains on, unmirrored")
                job_event(Path(job["workdir"]), job_id, "mirror_failed", level="warning", error=str(e))
                return None
            doc = accepted_doc(self.store, job)
            keep = int((doc.get("checkpoint") or {}).get("keep") or CheckpointConfig.model_fields["keep"].default)
            text = self.store.accepted_text(job_id) or ""
            m = JobMirror(job_id, Path(job["workdir"]), where[1], remote, keep, text, self.log,
                          on_caught_up=self._caught_up).start()
            self.jobs[job_id] = m
            return m

    # ------------------------------------------------------------------ told by the supervisor
    def committed(self, job_id: str, step: int) -> None:
        try:
            if (m := self._uploader(job_id)) is not None:
                m.committed(step)
                self._behind(job_id)  # after: a store that cannot be written never holds up the upload
        except Exception as e:  # noqa: BLE001 — called from the supervisor's heartbeat step: never in its way
            self.log.error("mirror_internal", job=job_id, error=f"{type(e).__name__}: {e}")

    def finished(self, job_id: str) -> None:
        try:
            if (m := self._uploader(job_id)) is not None:
                m.finished()
                self._behind(job_id)
            job = self.store.get(job_id)
            doc = accepted_doc(self.store, job)
            repo = (doc.get("output") or {}).get("push_to_hub")
            if repo and job_id not in self.hub:
                self.hub[job_id] = HubPush(job_id, Path(job["workdir"]), repo, self.log, self.cfg.hub_namespaces,
                                           local_paths(doc, self.home)).start()
        except Exception as e:  # noqa: BLE001 — called from the reap step: never in its way
            self.log.error("mirror_internal", job=job_id, error=f"{type(e).__name__}: {e}")

    def close(self) -> None:
        for m in [*self.jobs.values(), *self.hub.values(), *self.fetches.values()]:
            m.close()

    # ------------------------------------------------------------------ read by status, the dashboard, /metrics
    def status(self, job_id: str) -> dict[str, Any] | None:
        m = self.jobs.get(job_id)
        out = m.status() if m is not None else dict(self.problems.get(job_id) or {})
        if (f := self.fetches.get(job_id)) is not None and not out:
            out = {} if f.done else f.status()
        if (h := self.hub.get(job_id)) is not None:
            out.update(h.status())
        return out or None

    def statuses(self) -> dict[str, dict[str, Any]]:
        return {job_id: s for job_id in [*self.problems, *self.jobs, *self.fetches] if (s := self.status(job_id))}

    # ------------------------------------------------------------------ submit
    def check_job(self, doc: dict[str, Any]) -> None:
        """At submit: the job's mirror exists in the config and answers (reachable, credentials, bucket)."""
        name = (doc.get("output") or {}).get("mirror") or self.cfg.default_mirror
        if name is None:
            return
        try:
            self.remote(name).check()
        except MirrorError as e:
            raise JobInvalid(f"{e} (output.mirror); the job was not queued") from None

    def resolve(self, ref: str) -> tuple[str, str]:
        """`--from` REF → (mirror name, key): MIRROR_URL/KEY, NAME/KEY, or KEY on the default mirror."""
        ref = ref.rstrip("/")
        for name, s in sorted(self.cfg.mirrors.items(), key=lambda kv: -len(kv[1].url)):
            if ref.startswith(s.url + "/"):
                return name, self._key(ref, ref[len(s.url) + 1:])
        name, _, key = ref.partition("/")
        if key and name in self.cfg.mirrors:
            return name, self._key(ref, key)
        if "/" not in ref and "://" not in ref and self.cfg.default_mirror:
            return self.cfg.default_mirror, self._key(ref, ref)
        raise JobInvalid(f"--from {ref}: no mirror of this daemon's config matches (MIRROR_URL/JOB, NAME/JOB, or a "
                         f"job key on the default mirror; mirrors: {sorted(self.cfg.mirrors)})")

    def _key(self, ref: str, key: str) -> str:
        """A `--from` key, checked before any path is built from it: a job id (never a path), and not a job of this
        daemon (its mirror prefix is that job's own: `lorad retry` or `resume` it instead)."""
        try:
            check_key(key)
        except MirrorError as e:
            raise JobInvalid(f"--from {ref[:200]!r}: {e}") from None
        try:
            self.store.get(key)
        except UnknownJob:
            return key
        raise JobInvalid(f"--from {ref[:200]!r}: {key} is a job of this daemon (its mirror is its own; `lorad status "
                         f"{key}`, `lorad retry {key}`): a mirror restores a job that is not here")

    def restore(self, ref: str, submit, validate, text: str | None = None) -> tuple[Any, str]:
        """Check REF at once (the job, the newest remote manifest's identity), accept its job as `fetching`, and
        download its newest usable checkpoint in the background (daemon/mirror/fetcher.py).

        submit(text, source, state) → the intake's outcome; validate(text) → the job's JobConfig."""
        from daemon.mirror.restore import probe

        name, key = self.resolve(ref)
        try:
            text, newest = probe(self.remote(name, read_only=True), key, validate, text)
        except MirrorError as e:
            raise JobInvalid(f"cannot restore from the mirror: {e}") from None
        out = submit(text, f"{SOURCE_PREFIX}{name}/{key}", states.FETCHING)
        self._fetch(self.store.get(out.job_id))
        what = f"its newest complete checkpoint is {newest}" if newest else "it has no complete checkpoint: step 0"
        return out, f"fetching; {what}; `lorad status {out.job_id}` shows the download"

    def refetch(self, job: dict[str, Any]) -> bool:
        """`lorad retry` of a job brought over with --from that failed before its checkpoint landed: it downloads
        again (state fetching) instead of training from step 0. False for any other job (the usual retry)."""
        if not (job.get("source") or "").startswith(SOURCE_PREFIX) or (Path(job["workdir"]) / "checkpoints").exists():
            return False
        self.store.transition(job["id"], states.FAILED, states.FETCHING, "lorad retry", retries=0, not_before=0,
                              last_error=None)
        try:
            self._fetch(self.store.get(job["id"]))
        except MirrorError as e:  # its mirror left the config
            self.store.transition(job["id"], states.FETCHING, states.FAILED, str(e), last_error=str(e))
            raise
        return True

    def _fetch(self, job: dict[str, Any]) -> None:
        from daemon.intake.accept import validate_text

        where = self.origin(job)
        assert where is not None  # a fetching job's source is always mirror:NAME/KEY
        text = self.store.accepted_text(job["id"]) or ""
        f = Fetch(job, where[1], self.remote(where[0], read_only=True), text,
                  lambda t: self.checks.run(lambda: validate_text(t, f"{job['name']}.yaml", self.home, self.cfg,
                                                                  self.home)), self.store,
                  self.log, self.home / "mirror-staging", lambda: self.wake())
        self.fetches[job["id"]] = f.start()
