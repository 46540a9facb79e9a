"""Job intake: read a job file defensively, validate it, and accept it (jobs/ID/) or reject it (rejected/).

The order of writes is what makes "a job file is never lost" true:
claim (rename inbox/NAME → incoming/), then either write rejected/NAME.error.txt
durably and rename the file next to it, or write jobs/ID/job.yaml durably,
insert the job row, then drop the claimed copy. A crash at any point leaves
the file in incoming/, and `recover()` finishes the work at start-up.

A write that fails (disk full, an I/O error, the store refusing) is not a
verdict on the job file: the file stays in incoming/ (a half-made jobs/ID/ is
removed), the error is logged in one line and listed by `lorad status`
(`stuck`), and the service loop calls `recover()` again every inbox_rescan_s
until it goes through.
"""

from __future__ import annotations

import os
import re
import shutil
import sqlite3
import stat
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from daemon.config.daemon import DaemonConfig, check_hub_repo
from daemon.intake.checks import PENDING, Checks
from daemon.intake.job_file import read_job_file
from daemon.intake.rejections import ERROR_SUFFIX, REJECTED_FILE_MODE, REJECTED_HEADER, capped
from daemon.store import states
from daemon.store.db import Store
from daemon.supervisor.cluster import check_submit
from daemon.system.log import job_event
from daemon.system.paths import JOB_DIR_MODE, JOB_FILE_MODE
from daemon.system.safe_files import write_durable
from engine.config.bounded import CheckTimedOut
from engine.config.job import JobConfig, dump_job, parse_job
from engine.config.reading import load_yaml_text
from engine.errors import JobInvalid
from engine.importers import Header, bounded_reader, detect, import_text, is_foreign_name, read_header
from engine.storage.fsio import RealFs, ensure_dir_durable

SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
JOB_SUFFIXES = (".yaml", ".yml")
# Names editors and copy tools use while a file is being written: never taken.
IGNORED_SUFFIXES = (".tmp", ".part", ".partial", ".swp", ".crdownload", "~")


@dataclass
class Outcome:
    name: str
    job_id: str | None = None
    error: str | None = None
    rejected_path: Path | None = None
    same_name: list[dict[str, Any]] = field(default_factory=list)  # unfinished jobs that already had this name
    stuck: bool = False  # neither accepted nor rejected (error says why): kept in incoming/, retried later
    pending: bool = False  # its check still runs (off the loop): kept in incoming/, asked again by poll_pending


def ignored(name: str) -> bool:
    """Hidden files and in-progress names are left alone: writers rename them in when complete."""
    return name.startswith(".") or name.endswith(IGNORED_SUFFIXES)


def safe_name(name: str) -> str:
    """A name that is harmless as a path component and in a terminal."""
    s = re.sub(r"[^A-Za-z0-9._-]", "_", name).lstrip("._-")[:120]
    return s or "job"


def imported_text(text: str, name: str, base_dir: Path, cfg: DaemonConfig, home: Path) -> str:
    """Another trainer's config (engine/importers/) as the lorad job it imports to; a lorad job as it is.

    The text was read bounded already; the side files an import names (a dataset TOML, ...) are read only inside
    the allowed roots, bounded the same way."""
    if detect(text, name) is None and not is_foreign_name(name):
        return text  # a lorad job (or not a job at all: validate_text says why)
    return import_text(text, name, base_dir, read=bounded_reader(cfg.job_policy(home).allows_path)).text


def validate_text(text: str, source: str, base_dir: Path, cfg: DaemonConfig, home: Path) -> JobConfig:
    """Everything a job must pass, in order of cost: size, YAML safety, daemon policy, roots, the engine's validator."""
    if len(text.encode("utf-8", errors="replace")) > cfg.max_job_file_bytes:
        raise JobInvalid(f"{source}: job file is larger than the {cfg.max_job_file_bytes}-byte limit")
    raw = load_yaml_text(text, source, cfg.max_yaml_aliases)
    if not isinstance(raw, dict):
        raise JobInvalid(f"{source}: the job file must be a YAML mapping of sections (name, model, data, ...), "
                         f"got {type(raw).__name__}")
    policy = cfg.job_policy(home)
    try:
        policy.check(raw, base_dir)  # the trainer checks it again, on the job.yaml it runs
    except JobInvalid as e:
        raise JobInvalid(f"{source}: {e}") from None
    job = parse_job(raw, base_dir, source=source)
    try:
        policy.check_parsed(job)  # the switches as the validator read them ('true', 1, ...)
    except JobInvalid as e:
        raise JobInvalid(f"{source}: {e}") from None
    check_submit(job, cfg.cluster)  # a job that spans machines: this daemon's part must be able to run
    if job.output.push_to_hub:  # only into the daemon config's hub_namespaces: its token writes there
        check_hub_repo(job.output.push_to_hub, cfg.hub_namespaces)
    return job


class Intake:
    def __init__(self, home: Path, cfg: DaemonConfig, store: Store, log):
        self.home = Path(home)
        self.cfg = cfg
        self.store = store
        self.log = log
        self.fs = RealFs()
        self.inbox = self.home / "inbox"
        self.incoming = self.home / "incoming"
        self.rejected = self.home / "rejected"
        for d in (self.inbox, self.incoming, self.rejected, self.home / "jobs"):
            ensure_dir_durable(self.fs, d)
        # Modes set explicitly, whatever the umask (the unit's 0007 makes directories group-writable). Only the
        # daemon writes in incoming/ and rejected/ (a group-writable rejected/ let a member plant a symlink the
        # daemon wrote through); the group may read them. jobs/ holds what trainers run: look, not rename or
        # create. The inbox, where the socket group drops files, keeps the group access its umask gave (none on a
        # personal install) and a setgid bit, never any access for others, and is sticky: none renames or
        # removes another's file.
        os.chmod(self.inbox, (stat.S_IMODE(os.stat(self.inbox).st_mode) & 0o2775) | stat.S_ISVTX)
        for d in (self.incoming, self.rejected, self.home / "jobs"):
            os.chmod(d, JOB_DIR_MODE)
        self._stuck: dict[str, dict[str, Any]] = {}  # path → {file, path, error, since, tries}
        self._stuck_lock = threading.Lock()  # `lorad status` reads it from a connection thread
        # Every job's paths are checked in a worker with a deadline (daemon/intake/checks.py). check_wait_s: how
        # long the caller of take()/recover() waits for one; None (the default) waits for the verdict, the
        # service loop sets a short wait and collects the rest with poll_pending() on later ticks.
        self.checks = Checks(cfg.intake_check_s, log)
        self.check_wait_s: float | None = None
        self._pending: dict[Path, tuple[str, str]] = {}  # claimed file → (its name, the text being checked)

    # ---------------------------------------------------------------- files that cannot be taken yet
    @property
    def stuck(self) -> list[dict[str, Any]]:
        """Inbox files that could be neither accepted nor rejected yet (oldest first), and why."""
        with self._stuck_lock:
            return sorted((dict(v) for v in self._stuck.values()), key=lambda v: v["since"])

    def _mark_stuck(self, path: Path, name: str, e: BaseException) -> Outcome:
        error = f"{type(e).__name__}: {e}"
        with self._stuck_lock:
            prev = self._stuck.get(str(path))
            self._stuck[str(path)] = {"file": name, "path": str(path), "error": error,
                                      "since": prev["since"] if prev else time.time(),
                                      "tries": (prev["tries"] if prev else 0) + 1}
        if prev is None or prev["error"] != error:  # one line per file and cause, not one per retry
            self.log.error("intake_stuck", file=name, path=str(path), error=error,
                           message=f"kept; retried every {self.cfg.inbox_rescan_s:g} s")
        return Outcome(name=name, error=error, stuck=True)

    def _unstick(self, path: Path) -> None:
        with self._stuck_lock:
            entry = self._stuck.pop(str(path), None)
        if entry is not None:
            self.log.info("intake_unstuck", file=entry["file"], tries=entry["tries"])

    # ---------------------------------------------------------------- inbox files
    def take(self, path: Path) -> Outcome | None:
        """Claim one inbox entry and accept or reject it. None when there is nothing to take."""
        name = path.name
        if ignored(name) or path.parent != self.inbox:
            return None
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return None  # taken already (an event and a rescan raced) or removed by its owner
        if stat.S_ISDIR(st.st_mode):
            return None
        claimed = self.incoming / f"{time.time_ns()}-{safe_name(name)}"
        try:
            os.rename(path, claimed)
        except FileNotFoundError:
            return None
        except OSError as e:  # still in the inbox: the next rescan tries again
            return self._mark_stuck(path, name, e)
        self._unstick(path)
        try:
            self.fs.fsync_dir(self.incoming)
            self.fs.fsync_dir(self.inbox)
        except OSError as e:
            return self._mark_stuck(claimed, name, e)
        return self._process_claimed(claimed, name)

    def recover(self) -> list[Outcome]:
        """Finish what a crash or a failed write left in incoming/: files claimed but not accepted or rejected.

        Run at start-up, and by the service loop while some file is stuck. One file that cannot be taken
        (disk full, ...) is marked stuck and left where it is; the others go on.
        """
        out = []
        accepted = {j["source"] for j in self.store.jobs()}
        present = sorted(self.incoming.iterdir())
        with self._stuck_lock:  # forget what someone removed by hand
            for key in [k for k in self._stuck if not os.path.lexists(k)]:
                del self._stuck[key]
        for p in present:
            if p.name in accepted:
                try:
                    p.unlink()  # accepted and recorded; only the claimed copy was left behind
                except FileNotFoundError:
                    pass
                except OSError as e:
                    out.append(self._mark_stuck(p, p.name.split("-", 1)[-1], e))
                    continue
                self._unstick(p)
                continue
            out.append(self._process_claimed(p, p.name.split("-", 1)[-1]))
        try:
            self.fs.fsync_dir(self.incoming)
        except OSError as e:
            self.log.error("intake_fsync_failed", path=str(self.incoming), error=str(e))
        return out

    def _process_claimed(self, claimed: Path, name: str) -> Outcome:
        try:
            out = self._decide(claimed, name)
        except (OSError, sqlite3.Error) as e:
            # Not the file's fault: it stays in incoming/ (no half-made jobs/ID/ is left) and is tried again.
            return self._mark_stuck(claimed, name, e)
        self._unstick(claimed)
        return out

    def poll_pending(self) -> list[Outcome]:
        """The files whose checks were still running: accepted or rejected once they have a verdict."""
        return [self._process_claimed(claimed, name) for claimed, (name, _) in list(self._pending.items())]

    def _decide(self, claimed: Path, name: str) -> Outcome:
        display = safe_name(name)
        try:
            if claimed in self._pending:  # asked again: the text read the first time is the one checked
                text, wait = self._pending[claimed][1], 0.0
            else:
                if not SAFE_NAME.match(name):
                    raise JobInvalid(f"file name {name!r} is not allowed: use letters, digits, '.', '_' and '-' "
                                     "only, starting with a letter or digit (no path separators or '..')")
                if not name.endswith(JOB_SUFFIXES) and not is_foreign_name(name):
                    raise JobInvalid(f"{name}: not a job file (the name must end in .yaml or .yml, or .toml or "
                                     ".json for another trainer's config)")
                text, wait = read_job_file(claimed, name, self.cfg, self.home), self.check_wait_s

            def check(text: str = text) -> tuple[str, JobConfig]:
                # Another trainer's config is imported in the same worker: its side files are reads too.
                text = imported_text(text, name, self.inbox, self.cfg, self.home)
                return text, validate_text(text, name, self.inbox, self.cfg, self.home)

            try:
                verdict = self.checks.verdict(str(claimed), check, wait)
            except CheckTimedOut as e:
                raise JobInvalid(f"{name}: {e}") from None
            finally:
                self._pending.pop(claimed, None)
            if verdict is PENDING:
                self._pending[claimed] = (name, text)
                return Outcome(name=name, pending=True)
            text, job = verdict
        except JobInvalid as e:
            return self._reject(claimed, display, str(e))
        except Exception as e:  # noqa: BLE001 — a job file must never take the daemon down
            return self._reject(claimed, display, f"{name}: could not be read or validated: {type(e).__name__}: {e}")
        job_id, same = self._accept(job, claimed.name, text)
        claimed.unlink()
        self.fs.fsync_dir(self.incoming)
        self.log.info("job_accepted", job=job_id, file=name)
        return Outcome(name=name, job_id=job_id, same_name=same)

    def _reject(self, claimed: Path, display: str, reason: str) -> Outcome:
        reason = capped(reason)
        dest = self.rejected / display
        n = 1
        while os.path.lexists(dest) or os.path.lexists(dest.with_name(dest.name + ERROR_SUFFIX)):
            n += 1
            dest = self.rejected / f"{display}.{n}"
        err = dest.with_name(dest.name + ERROR_SUFFIX)
        try:
            # An O_EXCL temp file of unpredictable name, renamed over err: nothing planted in rejected/ is followed.
            write_durable(err, f"{REJECTED_HEADER}{display}:\n{reason}\n".encode(), REJECTED_FILE_MODE)
            os.rename(claimed, dest)
        except OSError:
            # Leave nothing half-done in rejected/: the claimed file is still in incoming/ and is retried.
            try:
                err.unlink()
            except OSError:
                pass
            raise
        self.fs.fsync_dir(self.rejected)
        self.fs.fsync_dir(self.incoming)
        self.log.warning("job_rejected", file=display, reason=reason)
        self.store.event(None, "rejected", source=display, reason=reason)
        return Outcome(name=display, error=reason, rejected_path=dest)

    # ---------------------------------------------------------------- socket submissions
    def submit_text(self, name: str, text: str, source: str | None = None, state: str = states.QUEUED) -> Outcome:
        """`lorad submit`: the client sends the normalised job (absolute paths); validated again here.

        source: the store's record of where it came from (default submit:NAME); state: queued, or fetching for a
        job whose checkpoint is still to be downloaded from a mirror (daemon/mirror/fetcher.py)."""
        if not SAFE_NAME.match(name):
            raise JobInvalid(f"file name {name!r} is not allowed (letters, digits, '.', '_', '-'; no path separators)")
        text, job = self.validate(text, name)
        source = source or f"submit:{name}"
        job_id, same = self._accept(job, source, text, state)
        self.log.info("job_accepted", job=job_id, file=source)
        return Outcome(name=name, job_id=job_id, same_name=same)

    def validate(self, text: str, name: str) -> tuple[str, JobConfig]:
        """(the job's text, imported where it is another trainer's config; the validated job) for a job sent over
        the socket (paths already absolute), in a worker with a deadline: the connection's thread waits at most
        intake_check_s (daemon/intake/checks.py)."""
        def check() -> tuple[str, JobConfig]:
            imported = imported_text(text, name, self.home, self.cfg, self.home)
            return imported, validate_text(imported, name, self.home, self.cfg, self.home)

        try:
            return self.checks.run(check)
        except CheckTimedOut as e:
            raise JobInvalid(f"{name}: {e}") from None

    def _accept(self, job: JobConfig, source: str, original: str,
                state: str = states.QUEUED) -> tuple[str, list[dict[str, Any]]]:
        """(the new job's id, the unfinished jobs that already had its name: its name alone no longer tells)."""
        same = self.store.unfinished_named(job.name)
        job_id = self.store.new_id(job.name)
        workdir = self.home / "jobs" / job_id
        try:
            # Born private (not under whatever umask the daemon has: the unit's 0007 would make it group-writable),
            # so no one else can open a file in it while job.yaml is written; then readable, never writable, by
            # the group. What decides what a trainer does is the daemon's to write.
            os.mkdir(workdir, 0o700)
            self.fs.fsync_dir(workdir.parent)
            text = dump_job(job)
            for name, data in (("submitted.yaml", original), ("job.yaml", text)):
                write_durable(workdir / name, data.encode(), JOB_FILE_MODE)
            os.chmod(workdir, JOB_DIR_MODE)
            # The job the daemon acts on from now on is state.db's copy: the trainer user may replace job.yaml.
            self.store.add_job(job_id, job.name, workdir, job.priority, job.train.steps, source, text=text, state=state)
        except BaseException:
            self._discard_partial(job_id, workdir)
            raise
        job_event(workdir, job_id, "accepted", file=source.split("-", 1)[-1] if source[:1].isdigit() else source)
        if (header := read_header(original)) is not None:
            self._imported(job_id, workdir, header)
        if same:
            ids = [j["id"] for j in same]
            self.log.warning("job_name_in_use", job=job_id, name=job.name, unfinished=ids)
            job_event(workdir, job_id, "name_in_use", level="warning", name=job.name, unfinished=ids,
                      message="refer to these jobs by id")
        return job_id, same

    def _imported(self, job_id: str, workdir: Path, h: Header) -> None:
        """An imported job: where from, and what was not carried over, in its events (lorad status and logs)."""
        fields = {"from_tool": h.tool, "from_file": h.source, "not_carried_over": h.dropped, "notes": h.notes}
        self.store.event(job_id, "imported", **fields)
        job_event(workdir, job_id, "imported", **fields,
                  message=f"imported from {h.tool}; {len(h.dropped)} settings not carried over")

    def _discard_partial(self, job_id: str, workdir: Path) -> None:
        """A jobs/ID/ whose job row was never written belongs to no job: remove it (the file is retried)."""
        try:
            self.store.get(job_id)
            return  # recorded after all: keep it
        except Exception:  # noqa: BLE001 — UnknownJob, or a store that cannot even be read: not recorded
            pass
        shutil.rmtree(workdir, ignore_errors=True)
