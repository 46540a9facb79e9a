"""Outages are not the job's fault; a full disk is a wait; the status is what the job directory says.

In-process: a real Store, reconcile() with an injected boot id, the Supervisor with small python scripts as
trainers and an injected free-space probe. No torch, no daemon process.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from daemon import protocol as p
from daemon.client.render import print_table
from daemon.config.daemon import DaemonConfig
from daemon.power.run_policy import Decision
from daemon.service.handlers import Context, dispatch
from daemon.service.recovery import CUT_OFF, reconcile
from daemon.store import states
from daemon.store.db import Store
from daemon.supervisor import disk_wait
from daemon.supervisor.loop import Supervisor
from daemon.supervisor.trainer import Child
from daemon.system.log import setup
from tests.helpers.daemon import wait_until

CFG = DaemonConfig(retry_budget=2, backoff_base_s=30)
FULL = "disk full while saving checkpoint step-00000020 in {wd}/checkpoints (0 MiB free); step-00000010 is intact"


def running_job(store: Store, tmp_path: Path, retries: int = 0, step: int = 0, checkpoint: int | None = None) -> str:
    jid = store.new_id("job")
    wd = tmp_path / "jobs" / jid
    wd.mkdir(parents=True)
    store.add_job(jid, "job", wd, 0, 100, "test")
    store.begin_attempt(jid, step, retries=retries, step=step, checkpoint_step=checkpoint)
    return jid


def committed(workdir: Path, step: int, size: int = 1000) -> Path:
    """A checkpoint as the engine commits it: files, then a manifest of their sizes (sparse: any size is cheap)."""
    d = workdir / "checkpoints" / f"step-{step:08d}"
    d.mkdir(parents=True)
    with open(d / "adapter.safetensors", "wb") as f:
        f.truncate(size)
    (d / "manifest.json").write_text(json.dumps({"format": 1, "step": step,
                                                 "files": {"adapter.safetensors": {"size": size, "sha256": "x"}}}))
    return d


# ------------------------------------------------------------------ 1. outages are not the job's fault
def test_a_job_cut_off_by_a_host_reboot_resumes_at_once_with_nothing_counted(store, tmp_path):
    store.set_meta("boot_id", "boot-A")
    jid = running_job(store, tmp_path, retries=2)  # one more counted crash would fail it (budget 2)
    r = reconcile(tmp_path, CFG, store, setup(), boot_id="boot-B")
    job = store.get(jid)
    assert r.requeued == [jid] and job["state"] == states.QUEUED
    assert job["not_before"] == 0 and job["retries"] == 2  # no backoff, no retry spent
    assert "the host rebooted" in job["last_error"] and store.get_meta("boot_id") == "boot-B"
    moves = [(e["data"]["from"], e["data"]["to"]) for e in store.events(jid) if e["kind"] == "transition"]
    assert moves[-2:] == [(states.RUNNING, states.INTERRUPTED), (states.INTERRUPTED, states.QUEUED)]


def test_a_job_cut_off_after_the_ups_announced_the_power_failing_resumes_at_once(store, tmp_path):
    store.set_meta("boot_id", "boot-A")
    store.set_meta("power_outage", "1")
    jid = running_job(store, tmp_path, retries=2)
    reconcile(tmp_path, CFG, store, setup(), boot_id="boot-A")  # same boot: the power came back before a reboot
    job = store.get(jid)
    assert (job["state"], job["not_before"], job["retries"]) == (states.QUEUED, 0, 2)
    assert "UPS" in job["last_error"] and store.get_meta("power_outage") == "0"


def test_a_cut_off_with_no_outage_behind_it_still_counts_as_a_crash(store, tmp_path):
    store.set_meta("boot_id", "boot-A")
    jid = running_job(store, tmp_path, retries=2)
    reconcile(tmp_path, CFG, store, setup(), boot_id="boot-A")
    job = store.get(jid)
    assert job["state"] == states.FAILED and job["retries"] == 3  # kept taking the daemon down: budget spent


def test_a_start_with_state_dbs_disk_full_is_not_stopped_by_the_outage_marks(store, tmp_path, monkeypatch):
    import sqlite3

    store.set_meta("boot_id", "boot-A")
    store.set_meta("power_outage", "1")

    def full(key, value):
        raise sqlite3.OperationalError("database or disk is full")

    monkeypatch.setattr(store, "set_meta", full)
    assert reconcile(tmp_path, CFG, store, setup(), boot_id="boot-B").requeued == []  # nothing to settle; no raise


def test_the_supervisor_records_a_ups_announced_outage_for_the_next_start(store, tmp_path):
    class Ups:
        decision = Decision(may_start=False, outage=True)

        def tick(self, now, running):
            return self.decision

        def __getattr__(self, hook):
            return lambda *a: None

    sup = Supervisor(tmp_path, CFG, store, [None], setup(), policy=Ups())
    sup.tick()
    assert store.get_meta("power_outage") == "1"
    Ups.decision = Decision()
    sup.tick()
    assert store.get_meta("power_outage") == "0"


# ------------------------------------------------------------------ 4. status from the job directory
def test_start_up_takes_step_and_last_checkpoint_from_the_job_directory_and_refunds_the_crash(store, tmp_path):
    store.set_meta("boot_id", "boot-A")
    jid = running_job(store, tmp_path, retries=2, step=35, checkpoint=23)
    wd = tmp_path / "jobs" / jid
    committed(wd, 38)
    newest = committed(wd, 50)
    (wd / "checkpoints" / "step-00000060.tmp-1-2").mkdir()  # a save cut short: not a checkpoint
    (wd / "events.jsonl").write_text("".join(json.dumps({"event": "step", "step": s}) + "\n" for s in (49, 50, 51))
                                     + '{"event": "step", "st')  # the kill tore the last line
    reconcile(tmp_path, CFG, store, setup(), boot_id="boot-A")
    job = store.get(jid)
    assert (job["step"], job["checkpoint_step"], job["last_checkpoint"]) == (51, 50, str(newest))
    assert store.attempts(jid)[-1]["end_step"] == 51
    # It committed checkpoints the store never heard of: progress, so this is crash 1, not crash 3 (failed).
    assert job["state"] == states.QUEUED and job["retries"] == 1


# ------------------------------------------------------------------ trainers as small scripts
SCRIPT = textwrap.dedent("""
    import json, sys
    for line in sys.argv[2:]:
        print(line, flush=True)
    sys.exit(int(sys.argv[1]))
""")


@pytest.fixture
def sup(store, tmp_path):
    class Hold:  # starts nothing on its own: the tests adopt their trainers
        def tick(self, now, running):
            return Decision(may_start=False)

        def __getattr__(self, hook):
            return lambda *a: None

    s = Supervisor(tmp_path, DaemonConfig(retry_budget=0, backoff_base_s=30), store, [None], setup(), policy=Hold())
    yield s
    for c in s.children.values():
        c.popen.kill()


def adopt(sup: Supervisor, jid: str, code: int, *events: dict) -> Child:
    """Attempt n of job `jid` run by a script that prints `events` and exits `code`, wired as start() does."""
    job = sup.store.get(jid)
    if job["state"] == states.QUEUED:
        sup.store.begin_attempt(jid, job["step"])
    n = sup.store.attempts(jid)[-1]["n"]
    popen = subprocess.Popen([sys.executable, "-c", SCRIPT, str(code), *(json.dumps(e) for e in events)],
                             stdout=subprocess.PIPE, start_new_session=True)
    c = Child(job_id=jid, name="job", workdir=Path(job["workdir"]), popen=popen, pid=popen.pid, pid_start=None,
              gpu=None, attempt=n, start_step=job["step"], total=100, power={}, step=job["step"],
              checkpoint_step=job["checkpoint_step"])
    sup.children[jid] = c
    c.start_reader(sup.beats, sup.wake)
    return c


def run_until_gone(sup: Supervisor, jid: str) -> dict:
    wait_until(lambda: (sup.tick(), jid not in sup.children)[1], 10, "the trainer's exit", poll=0.02)
    return sup.store.get(jid)


def test_a_full_disk_is_a_wait_that_never_spends_the_retry_budget(sup, store, tmp_path, capsys):
    jid = running_job(store, tmp_path)
    wd = tmp_path / "jobs" / jid
    committed(wd, 10, size=2_400_000_000)
    free = {"bytes": 0}
    sup.free_bytes = lambda path: free["bytes"]
    for _ in range(3):  # retry_budget 0: a single counted crash would fail the job
        adopt(sup, jid, 74, {"event": "disk_error", "message": FULL.format(wd=wd)})
        job = run_until_gone(sup, jid)
        assert job["state"] == states.WAITING and job["retries"] == 0 and job["wait_bytes"] == 2_400_000_000
        sup._next_disk_poll = 0
        sup.tick()
        assert store.get(jid)["state"] == states.WAITING  # no space yet: still waiting
        ctx = Context(home=tmp_path, store=store, intake=None, supervisor=None, started_at=0.0, socket_path=wd)
        print_table(json.loads(dispatch(ctx, p.Status()))["data"])
        assert "waiting: disk full, 2.4 GB needed" in capsys.readouterr().out
        free["bytes"] = 2_500_000_000  # space is back
        sup._next_disk_poll = 0
        sup.tick()
        job = store.get(jid)
        assert (job["state"], job["not_before"], job["wait_bytes"], job["retries"]) == (states.QUEUED, 0, None, 0)
        free["bytes"] = 0


def test_the_disk_is_polled_on_the_job_directorys_filesystem_every_few_seconds(sup, store, tmp_path):
    jid = running_job(store, tmp_path)
    adopt(sup, jid, 74, {"event": "disk_error", "message": "disk full (x); committed checkpoints are intact"})
    asked: list[Path] = []
    sup.free_bytes = lambda path: asked.append(path) or 0
    assert run_until_gone(sup, jid)["wait_bytes"] == disk_wait.NO_CHECKPOINT_NEED_BYTES  # no checkpoint to size it
    sup._next_disk_poll = 0
    for _ in range(5):
        sup.tick()
    assert asked == [tmp_path / "jobs" / jid]  # once per DISK_POLL_S, not once per tick


def test_lorad_retry_queues_a_failed_job_again_with_a_fresh_budget_in_its_own_directory(sup, store, tmp_path):
    jid = running_job(store, tmp_path)
    committed(tmp_path / "jobs" / jid, 20)
    adopt(sup, jid, 1, {"event": "checkpoint_committed", "step": 20, "path": "p"}, {"event": "step", "step": 23})
    job = run_until_gone(sup, jid)
    assert job["state"] == states.FAILED  # retry_budget 0
    ctx = Context(home=tmp_path, store=store, intake=None, supervisor=None, started_at=0.0, socket_path=tmp_path)
    r = json.loads(dispatch(ctx, p.Retry(job=jid)))
    assert r["ok"] and r["data"]["message"] == "queued; it resumes from its checkpoint at step 20"
    job = store.get(jid)
    assert (job["state"], job["retries"], job["workdir"]) == (states.QUEUED, 0, str(tmp_path / "jobs" / jid))
    again = json.loads(dispatch(ctx, p.Retry(job=jid)))
    assert not again["ok"] and "only a failed job" in again["message"]


def test_lorad_retry_is_a_cli_verb():
    from daemon.client.cli import build_parser
    from daemon.client.verbs import cmd_retry

    assert build_parser().parse_args(["retry", "job-1a2b"]).fn is cmd_retry


def test_a_new_attempt_records_where_it_really_resumed_and_clears_the_stale_note(sup, store, tmp_path):
    jid = running_job(store, tmp_path, step=35)
    store.update(jid, last_error=CUT_OFF)
    adopt(sup, jid, 75, {"event": "resumed", "from_step": 50}, {"event": "step", "step": 51})  # stopped from outside
    job = run_until_gone(sup, jid)
    assert store.attempts(jid)[-1]["start_step"] == 50  # "50→51", not "35→51"
    assert job["last_error"] is None


def test_a_state_db_from_before_the_disk_wait_gains_its_column_when_opened(tmp_path):
    s = Store(tmp_path / "old.db")
    s.db.execute("ALTER TABLE jobs DROP COLUMN wait_bytes")  # as an older lorad created it
    s.close()
    s = Store(tmp_path / "old.db")
    try:
        assert "wait_bytes" in {r["name"] for r in s.db.execute("PRAGMA table_info(jobs)")}
    finally:
        s.close()
