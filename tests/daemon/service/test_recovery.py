"""Start-up reconciliation: running jobs whose trainer is gone are requeued; live orphans are stopped first,
identified by pid AND process start time (a reused pid is someone else's process and is left alone), all at once.
A job the store still calls running was cut off by a crash (a clean stop records it as interrupted): that counts
as a crash of the job, with backoff and the retry budget."""

from __future__ import annotations

import errno
import subprocess
import sys
import textwrap
import time

import yaml

from daemon.config.daemon import DaemonConfig
from daemon.intake import accept as intake_mod
from daemon.intake.accept import Intake
from daemon.service.recovery import reconcile
from daemon.store import states
from daemon.store.db import Store
from daemon.supervisor.loop import Supervisor
from daemon.supervisor.trainer import Child
from daemon.system import proc
from daemon.system.log import setup
from tests.helpers.jobs import good_job

# Stands in for a trainer: exits 75 on SIGTERM, as engine.run does after its final checkpoint.
ORPHAN = "import signal, sys, time; signal.signal(signal.SIGTERM, lambda *a: sys.exit(75)); time.sleep(120)"


def running_job(store: Store, tmp_path, name: str, pid: int | None, start: int | None, requested: str | None = None):
    jid = store.new_id(name)
    store.add_job(jid, name, tmp_path / "jobs" / jid, 0, 10, "test")
    store.begin_attempt(jid, 0, pid=pid, pid_start=start, requested=requested)  # queued → running, attempt 1
    return jid


def spawn_orphan() -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", ORPHAN], start_new_session=True)
    time.sleep(0.3)  # let it install its handler
    return p


def test_a_running_job_cut_off_by_a_crash_is_requeued_as_a_crash_with_backoff(store, tmp_path):
    jid = running_job(store, tmp_path, "gone", 999_999, 1)
    t0 = time.time()
    r = reconcile(tmp_path, DaemonConfig(backoff_base_s=30, retry_budget=5), store, setup())
    job = store.get(jid)
    assert r.requeued == [jid] and job["state"] == states.QUEUED
    assert job["retries"] == 1 and t0 + 30 <= job["not_before"] <= time.time() + 30  # not straight back in
    assert job["pid"] is None and "the daemon or the host went down" in job["last_error"]
    last = [e["data"] for e in store.events(jid) if e["kind"] == "transition"][-1]
    assert (last["from"], last["to"]) == (states.RUNNING, states.QUEUED) and "retry 1/5" in last["reason"]
    a = store.attempts(jid)[-1]
    assert a["ended_at"] is not None and "the daemon or the host went down" in a["error"]


def test_a_job_that_keeps_taking_the_daemon_down_fails_once_its_retry_budget_is_spent(store, tmp_path):
    cfg = DaemonConfig(retry_budget=2, backoff_base_s=0)
    jid = running_job(store, tmp_path, "killer", None, None)
    seen = []
    for _ in range(3):  # it runs, the host or the daemon goes down with it, the daemon starts again
        reconcile(tmp_path, cfg, store, setup())
        seen.append(store.get(jid)["state"])
        if seen[-1] == states.QUEUED:
            store.begin_attempt(jid, 0)
    assert seen == [states.QUEUED, states.QUEUED, states.FAILED]
    last = [e["data"] for e in store.events(jid) if e["kind"] == "transition"][-1]
    assert last["reason"].startswith("retry budget spent (2); last error: cut off: the daemon or the host went down")


def test_a_clean_shutdown_is_not_a_crash(store, tmp_path):
    """`lorad serve` SIGTERM, systemctl stop, a reboot that stops the unit: the daemon stops every trainer and
    records its job as interrupted; the next start requeues it at once and counts nothing."""
    sup = Supervisor(tmp_path, DaemonConfig(stop_grace_s=5), store, [None], setup())
    jid = running_job(store, tmp_path, "clean", None, None)
    (tmp_path / "jobs" / jid).mkdir(parents=True)
    popen = subprocess.Popen([sys.executable, "-c", ORPHAN], stdout=subprocess.PIPE, start_new_session=True)
    time.sleep(0.3)
    c = Child(job_id=jid, name="clean", workdir=tmp_path / "jobs" / jid, popen=popen, pid=popen.pid, pid_start=None,
              gpu=None, attempt=1, start_step=0, total=10, power={})
    sup.children[jid] = c
    c.start_reader(sup.beats, sup.wake)
    sup.shutdown(5)
    assert store.get(jid)["state"] == states.INTERRUPTED
    reconcile(tmp_path, DaemonConfig(backoff_base_s=30), store, setup())
    job = store.get(jid)
    assert job["state"] == states.QUEUED and job["retries"] == 0 and job["not_before"] == 0


def test_a_live_orphan_with_the_recorded_pid_and_start_time_is_stopped_before_requeue(store, tmp_path):
    orphan = spawn_orphan()
    jid = running_job(store, tmp_path, "orphan", orphan.pid, proc.start_time(orphan.pid))
    r = reconcile(tmp_path, DaemonConfig(stop_grace_s=10), store, setup())
    assert orphan.wait(5) == 75  # asked to checkpoint and stop (SIGTERM), not killed
    assert r.orphans_stopped == [orphan.pid] and store.get(jid)["state"] == states.QUEUED


def test_a_reused_pid_is_not_our_trainer_and_is_left_alone(store, tmp_path):
    other = spawn_orphan()
    try:
        jid = running_job(store, tmp_path, "reused", other.pid, proc.start_time(other.pid) - 1)
        r = reconcile(tmp_path, DaemonConfig(stop_grace_s=10), store, setup())
        assert r.orphans_stopped == [] and other.poll() is None
        assert store.get(jid)["state"] == states.QUEUED
    finally:
        other.kill()
        other.wait()


def test_an_orphan_that_ignores_sigterm_is_killed_after_the_grace(store, tmp_path):
    stubborn = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, "
                                 "signal.SIG_IGN); time.sleep(120)"], start_new_session=True)
    time.sleep(0.3)
    running_job(store, tmp_path, "stubborn", stubborn.pid, proc.start_time(stubborn.pid))
    t0 = time.monotonic()
    reconcile(tmp_path, DaemonConfig(stop_grace_s=1.0), store, setup())
    assert stubborn.wait(5) == -9 and 1.0 <= time.monotonic() - t0 < 5


def test_what_the_user_asked_for_before_the_outage_wins(store, tmp_path):
    p = running_job(store, tmp_path, "p", None, None, requested="pause")
    c = running_job(store, tmp_path, "c", None, None, requested="cancel")
    reconcile(tmp_path, DaemonConfig(), store, setup())
    assert store.get(p)["state"] == states.PAUSED and store.get(c)["state"] == states.CANCELLED


def test_a_job_interrupted_by_a_clean_shutdown_is_requeued(store, tmp_path):
    jid = running_job(store, tmp_path, "shut", None, None)
    store.transition(jid, states.RUNNING, states.INTERRUPTED, "shutdown")
    reconcile(tmp_path, DaemonConfig(), store, setup())
    assert store.get(jid)["state"] == states.QUEUED


SLOW_TO_STOP = textwrap.dedent("""
    import signal, sys, time
    stop = []
    signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
    print("ready", flush=True)
    while not stop:
        time.sleep(0.01)
    time.sleep(float(sys.argv[1]))  # its final checkpoint
    sys.exit(75)
""")


def spawn_slow(save_s: float) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", SLOW_TO_STOP, str(save_s)], stdout=subprocess.PIPE, text=True,
                         start_new_session=True)
    assert p.stdout.readline().strip() == "ready"
    return p


def test_orphans_are_all_signalled_first_and_waited_for_together(store, tmp_path):
    orphans = [spawn_slow(0.8) for _ in range(3)]
    for i, o in enumerate(orphans):
        running_job(store, tmp_path, f"gpu{i}", o.pid, proc.start_time(o.pid))
    t0 = time.monotonic()
    r = reconcile(tmp_path, DaemonConfig(stop_grace_s=10), store, setup())
    took = time.monotonic() - t0
    assert [o.wait(5) for o in orphans] == [75, 75, 75]  # each committed its checkpoint
    assert sorted(r.orphans_stopped) == sorted(o.pid for o in orphans)
    assert took < 2.0, took  # about one save (0.8 s), not three in a row (2.4 s)


def test_orphans_that_ignore_sigterm_share_one_grace_period(store, tmp_path):
    stubborn = [subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, "
                                  "signal.SIG_IGN); time.sleep(120)"], start_new_session=True) for _ in range(2)]
    time.sleep(0.3)
    for i, o in enumerate(stubborn):
        running_job(store, tmp_path, f"stubborn{i}", o.pid, proc.start_time(o.pid))
    t0 = time.monotonic()
    reconcile(tmp_path, DaemonConfig(stop_grace_s=1.0), store, setup())
    took = time.monotonic() - t0
    assert [o.wait(5) for o in stubborn] == [-9, -9] and 1.0 <= took < 1.9, took  # not 2 x 1.0 s


def test_an_inbox_file_that_cannot_be_taken_never_stops_start_up(store, tmp_path, monkeypatch):
    intake = Intake(tmp_path, DaemonConfig(allowed_roots=["{home}", "/"]), store, setup())
    (intake.incoming / "1-full.yaml").write_text(yaml.safe_dump(good_job("full")))  # claimed before a crash

    def disk_full(path, data, mode):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(intake_mod, "write_durable", disk_full)
    r = reconcile(tmp_path, DaemonConfig(), store, setup(), intake)  # no exception: the daemon starts
    assert r.intake_finished == 0 and (intake.incoming / "1-full.yaml").exists()
    assert list((tmp_path / "jobs").iterdir()) == [] and store.jobs() == []  # no half-made job directory
    (stuck,) = intake.stuck
    assert stuck["file"] == "full.yaml" and "No space left on device" in stuck["error"]
    monkeypatch.undo()
    intake.recover()  # what the service loop does every inbox_rescan_s while a file is stuck
    assert [j["name"] for j in store.jobs()] == ["full"] and intake.stuck == []
