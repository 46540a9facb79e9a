"""Start-up reconciliation: running jobs whose trainer is gone are requeued; live orphans are stopped first,
identified by pid AND process start time (a reused pid is someone else's process and is left alone)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from daemon import proc, states
from daemon.log import setup
from daemon.recovery import reconcile
from daemon.settings import DaemonConfig
from daemon.store import Store

# Stands in for a trainer: exits 75 on SIGTERM, as engine.run does after its final checkpoint.
ORPHAN = "import signal, sys, time; signal.signal(signal.SIGTERM, lambda *a: sys.exit(75)); time.sleep(120)"


@pytest.fixture
def store(tmp_path):
    s = Store(tmp_path / "state.db")
    yield s
    s.close()


def running_job(store: Store, tmp_path, name: str, pid: int | None, start: int | None, requested: str | None = None):
    jid = store.new_id(name)
    store.add_job(jid, name, tmp_path / "jobs" / jid, 0, 10, "test")
    store.transition(jid, states.QUEUED, states.RUNNING, pid=pid, pid_start=start, requested=requested)
    store.start_attempt(jid, 0)
    return jid


def spawn_orphan() -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", ORPHAN], start_new_session=True)
    time.sleep(0.3)  # let it install its handler
    return p


def test_a_running_job_without_a_trainer_is_requeued_and_its_attempt_closed(store, tmp_path):
    jid = running_job(store, tmp_path, "gone", 999_999, 1)
    r = reconcile(tmp_path, DaemonConfig(), store, setup())
    assert r.requeued == [jid] and store.get(jid)["state"] == states.QUEUED
    kinds = [e["data"]["to"] for e in store.events(jid) if e["kind"] == "transition"]
    assert kinds[-2:] == [states.INTERRUPTED, states.QUEUED]
    a = store.attempts(jid)[-1]
    assert a["ended_at"] is not None and "daemon stopped" in a["error"]


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
