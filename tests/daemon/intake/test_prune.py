"""rejected/ is pruned by age and count, by the service loop, a bounded batch at a time.

The rejections are made by the real intake (bad job files dropped in the inbox); their ages are set on the
error files, which is where a rejection's time is kept.
"""

from __future__ import annotations

import os
import time

from daemon.config.daemon import DaemonConfig
from daemon.intake.accept import Intake
from daemon.intake.prune import RejectedPruner
from daemon.intake.rejections import recent_rejections
from daemon.store.db import Store
from daemon.supervisor.loop import Supervisor
from tests.helpers.fakes import RecLog

DAY = 86400.0


class NoInbox:
    def poll(self):
        return []


def reject(intake: Intake, name: str, age_days: float) -> None:
    path = intake.inbox / name
    path.write_text("not: [a job\n")
    assert intake.take(path).error
    t = time.time() - age_days * DAY
    os.utime(intake.rejected / f"{name}.error.txt", (t, t))


def test_old_rejections_and_those_past_the_count_are_removed_with_their_error_files(tmp_path):
    cfg = DaemonConfig(allowed_roots=["{home}"], rejected_keep_days=30, rejected_keep=3)
    store = Store(tmp_path / "state.db")
    intake = Intake(tmp_path, cfg, store, RecLog())
    try:
        for i, age in enumerate([40, 31, 5, 4, 3, 2, 1]):
            reject(intake, f"bad{i}.yaml", age)
        (intake.rejected / "lonely.yaml").write_text("its error file was deleted by hand\n")
        os.utime(intake.rejected / "lonely.yaml", (time.time() - 50 * DAY,) * 2)
        outside = tmp_path / "precious"
        outside.write_text("not the daemon's to delete\n")
        (intake.rejected / "planted.yaml.error.txt").symlink_to(outside)  # a link is removed as a link
        os.utime(intake.rejected / "planted.yaml.error.txt", (time.time() - 60 * DAY,) * 2, follow_symlinks=False)
        (intake.rejected / ".bad9.yaml.error.txt.tmp-1").write_text("being written\n")

        log = RecLog()
        sup = Supervisor(tmp_path, cfg, store, [None], log, intake=intake, inbox=NoInbox(),
                         prune_rejected=RejectedPruner(intake.rejected, cfg.rejected_keep_days, cfg.rejected_keep, log))
        sup._spawn = lambda: None  # the inbox step is the one under test
        sup.tick()

        assert sup.healthy
        left = sorted(os.listdir(intake.rejected))
        assert left == [".bad9.yaml.error.txt.tmp-1", "bad4.yaml", "bad4.yaml.error.txt", "bad5.yaml",
                        "bad5.yaml.error.txt", "bad6.yaml", "bad6.yaml.error.txt"]
        assert outside.read_text() == "not the daemon's to delete\n"
        assert sup.log.named("rejected_pruned")[0]["files"] == 2 * 4 + 2
        shown, total = recent_rejections(intake.rejected, time.time(), 365 * DAY, 5)
        assert total == 3 and [r["file"] for r in shown] == ["bad6.yaml", "bad5.yaml", "bad4.yaml"]
    finally:
        store.close()


def test_a_backlog_is_cleared_a_batch_per_tick(tmp_path):
    from daemon.intake import prune

    rejected = tmp_path / "rejected"
    rejected.mkdir()
    old = time.time() - 100 * DAY
    for i in range(25):
        for name in (f"f{i}.yaml", f"f{i}.yaml.error.txt"):
            (rejected / name).write_text("x")
            os.utime(rejected / name, (old + i, old + i))
    removed = [prune.prune_rejected(rejected, time.time(), 30 * DAY, 1000, batch=20) for _ in range(4)]
    assert removed == [20, 20, 10, 0] and os.listdir(rejected) == []


def test_finished_jobs_events_are_pruned_by_age_and_count_and_a_live_jobs_never(tmp_path):
    """Issue 38 C: events of a job were never deleted. A finished job's go after finished_events_keep_days and
    beyond the newest finished_events_keep finished jobs; a job still queued or running keeps all of its (what
    `lorad status JOB` shows), and a finished one keeps its `imported` line."""
    store = Store(tmp_path / "state.db")
    (tmp_path / "rejected").mkdir()
    try:
        def job(jid: str, final: str | None, ended_days_ago: float) -> None:
            store.add_job(jid, jid, tmp_path / jid, 0, 4, "inbox:x.yaml")
            store.event(jid, "imported", from_tool="kohya")
            if final == "succeeded":
                store.begin_attempt(jid, 0)
                store.end_run(jid, 0, 4, None, lambda row: ([("succeeded", "done", {})], None))
            elif final == "cancelled":
                store.transition(jid, "queued", "cancelled", "lorad cancel")
            t = time.time() - ended_days_ago * DAY
            store.db.execute("UPDATE jobs SET updated_at=? WHERE id=?", (t, jid))
            store.db.execute("UPDATE events SET ts=? WHERE job_id=?", (t, jid))  # as old as the job's end

        job("old-done", "succeeded", 100)      # past the age
        job("old-live", None, 100)             # queued this long: not finished, kept whole
        job("recent-1", "cancelled", 3)        # within the age, but beyond the newest 2 finished
        job("recent-2", "succeeded", 2)
        job("recent-3", "cancelled", 1)
        store.begin_attempt("old-live", 0)     # and running now
        before = {j: len(store.events(j, limit=1000)) for j in ("old-live", "recent-2", "recent-3")}

        log = RecLog()
        RejectedPruner(tmp_path / "rejected", 30, 1000, log, store, finished=(30, 2))(time.monotonic())

        kinds = {j: [e["kind"] for e in store.events(j, limit=1000)]
                 for j in ("old-done", "old-live", "recent-1", "recent-2", "recent-3")}
        assert kinds["old-done"] == kinds["recent-1"] == ["imported"]
        assert {j: len(kinds[j]) for j in before} == before
        assert "transition" in kinds["old-live"] and "transition" in kinds["recent-2"]
        assert store.first_event("old-done", "imported")["data"] == {"from_tool": "kohya"}
        assert log.named("finished_events_pruned")[0]["events"] == 3 + 2  # accepted and its transitions (old-done: 2, recent-1: 1)
    finally:
        store.close()
