"""rejected/ pruned by age and count, so a flood of bad job files cannot fill the disk or slow every scan of it.

A rejection is rejected/NAME with rejected/NAME.error.txt (daemon/intake/accept.py); its time is the error
file's mtime (the job file keeps the mtime it was dropped with, which may be old). Those older than
`rejected_keep_days`, and all but the newest `rejected_keep`, are removed, both files together. The
supervisor calls a RejectedPruner from its inbox step (daemon/supervisor/loop.py) every PRUNE_EVERY_S, at
most PRUNE_BATCH files a call, so a large backlog is cleared over several ticks and never stalls one. The
rejection events in state.db (events of no job) are kept to the same age and count, and the events of finished
jobs to `finished_events_keep_days` after the job ended and the newest `finished_events_keep` finished jobs
(Store.prune_finished_events: a job not finished keeps them all).
Names are removed relative to the directory's descriptor and never followed: a symlink planted in rejected/
is removed as a link, whatever it points at. Hidden names (a rejection being written) are left alone.
"""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

from daemon.intake.rejections import ERROR_SUFFIX

PRUNE_BATCH = 500
PRUNE_EVERY_S = 60.0


def _rejections(dfd: int) -> list[tuple[float, list[str]]]:
    """(time, names) per rejection in the directory; a file whose partner is gone stands alone."""
    mtimes: dict[str, float] = {}
    with os.scandir(dfd) as it:
        for e in it:
            if e.name.startswith("."):
                continue
            try:
                st = e.stat(follow_symlinks=False)
            except OSError:
                continue
            if not stat.S_ISDIR(st.st_mode):
                mtimes[e.name] = st.st_mtime
    groups, claimed = [], set()
    # Longest names first: "a.error.txt.error.txt" claims the rejected file "a.error.txt" before that one is
    # taken for an error file itself.
    for name in sorted((n for n in mtimes if n.endswith(ERROR_SUFFIX)), key=len, reverse=True):
        if name in claimed:
            continue
        partner = name[: -len(ERROR_SUFFIX)]
        names = [name] + ([partner] if partner in mtimes and partner not in claimed else [])
        claimed.update(names)
        groups.append((mtimes[name], names))
    groups += [(t, [n]) for n, t in mtimes.items() if n not in claimed]
    return groups


def prune_rejected(rejected: Path, now: float, keep_s: float, keep: int, batch: int = PRUNE_BATCH) -> int:
    """Remove the rejections older than keep_s seconds and all but the newest `keep`, oldest first, at most
    about `batch` files; returns how many files were removed."""
    try:
        dfd = os.open(rejected, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return 0
    removed = 0
    try:
        groups = sorted(_rejections(dfd), key=lambda g: g[0], reverse=True)  # newest first
        doomed = [names for i, (t, names) in enumerate(groups) if i >= keep or now - t > keep_s]
        for names in reversed(doomed):
            if removed >= batch:
                break
            for name in names:
                try:
                    os.unlink(name, dir_fd=dfd)
                    removed += 1
                except FileNotFoundError:
                    pass
    finally:
        os.close(dfd)
    return removed


class RejectedPruner:
    """prune_rejected every PRUNE_EVERY_S (the first call at once), a batch per tick while a backlog lasts."""

    def __init__(self, rejected: Path, keep_days: float, keep: int, log, store=None,
                 finished: tuple[float, int] | None = None):
        self.rejected = Path(rejected)
        self.finished = finished  # (days, jobs): the finished jobs' events kept this long, of this many jobs
        self.store = store  # daemon.store.db.Store: its rejection events are kept to the same age and count
        self.keep_days = keep_days
        self.keep = keep
        self.log = log
        self._next = 0.0

    def __call__(self, now: float) -> int:
        if now < self._next:
            return 0
        n = prune_rejected(self.rejected, time.time(), self.keep_days * 86400, self.keep)
        self._next = now + (0.0 if n >= PRUNE_BATCH else PRUNE_EVERY_S)
        events = self.store.prune_jobless_events(time.time() - self.keep_days * 86400, self.keep) if self.store else 0
        if n or events:
            self.log.info("rejected_pruned", files=n, events=events, keep_days=self.keep_days, keep=self.keep)
        if self.store is not None and self.finished is not None:
            days, jobs = self.finished
            done = self.store.prune_finished_events(time.time() - days * 86400, jobs)
            if done:
                self.log.info("finished_events_pruned", events=done, keep_days=days, keep_jobs=jobs)
                if done >= 5000:
                    self._next = now  # a backlog: the next batch on the next tick
        return n
