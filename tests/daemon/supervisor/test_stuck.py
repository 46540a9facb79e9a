"""A trainer stuck in the kernel (a hung driver) outlives SIGKILL: nothing waits for it forever.

The simulation: a real process that keeps running, and a SIGKILL (or SIGTERM) to it that does not take
effect — what a process in an uninterruptible call looks like from the daemon. The signals to it are
swallowed by patching daemon.system.proc.signal_group for its pid only; everything else is real (the Popen, its
stdout, /proc, trainer.lock). The test then kills it for real, as a driver recovering would let it die.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from daemon.config.daemon import DaemonConfig
from daemon.service.recovery import reconcile
from daemon.store import states
from daemon.store.db import Store
from daemon.supervisor import lock_contention
from daemon.supervisor.loop import Supervisor
from daemon.system import proc
from daemon.system.log import setup
from engine.report.events import read_events
from tests.daemon.supervisor.test_supervisor import queue_job as queue
from tests.daemon.supervisor.test_supervisor import run_ticks
from tests.helpers.daemon import wait_until

# Speaks the trainer's contract; "hang" as argv[1]: one step, then silence forever (the GPU call never returns).
FAKE = textwrap.dedent("""
    import json, sys, time
    step = 0
    while True:
        step += 1
        print(json.dumps({"event": "step", "step": step, "total": 1000, "loss": 1.0, "s_per_step": 0.05}), flush=True)
        time.sleep(3600 if sys.argv[1] == "hang" else 0.05)
""")


@pytest.fixture
def unkillable(monkeypatch):
    """pids for which signals sent through daemon.system.proc have no effect (they stay in the kernel)."""
    pids: set[int] = set()
    real = proc.signal_group

    def signal_group(pid: int, sig: int) -> None:
        if pid not in pids:
            real(pid, sig)

    monkeypatch.setattr(proc, "signal_group", signal_group)
    return pids


def test_a_trainer_that_outlives_sigkill_is_reported_its_gpu_kept_out_and_the_other_gpu_keeps_serving(
        tmp_path, unkillable, monkeypatch):
    # The job waits on the lock its stuck trainer holds, retried every LOCK_BUSY_RETRY_S (5 s): when, is not the point.
    monkeypatch.setattr(lock_contention, "LOCK_BUSY_RETRY_S", 0.5)
    store = Store(tmp_path / "state.db")
    cfg = DaemonConfig(hang_timeout_s=0.5, hang_step_multiple=1, kill_wait_s=0.5, backoff_base_s=0, stop_grace_s=5)
    sup = Supervisor(tmp_path, cfg, store, [0, 1], setup())
    sup.trainer_command = lambda wd: [sys.executable, "-c", FAKE, "hang" if wd.name.startswith("hung") else "go"]
    stuck_pid = None
    try:
        a = queue(sup, tmp_path, "hung")
        run_ticks(sup, lambda: a in sup.children)
        stuck_pid = sup.children[a].pid
        unkillable.add(stuck_pid)
        assert sup.children[a].devices == [0]
        # Hung (no heartbeat), SIGKILLed, still there kill_wait_s later: given up on, not waited for.
        run_ticks(sup, lambda: a not in sup.children and store.get(a)["state"] == states.QUEUED)
        assert proc.alive(stuck_pid)
        assert f"stuck: trainer pid {stuck_pid} of job {a}" in store.get(a)["last_error"]
        stuck_events = [e for e in read_events(tmp_path / "jobs" / a) if e["event"] == "trainer_stuck"]
        assert stuck_events and stuck_events[0]["pid"] == stuck_pid and stuck_events[0]["devices"] == [0]
        sup.tick()
        assert any(f"pid {stuck_pid}" in n and "GPU 0 kept out of scheduling" in n for n in sup.notes)  # lorad status
        assert f"pid {stuck_pid}" in sup.status_line()  # systemd's STATUS

        # GPU 1 keeps serving; GPU 0 is not scheduled, and job `hung` waits on the lock its stuck trainer holds.
        b = queue(sup, tmp_path, "fine")
        run_ticks(sup, lambda: b in sup.children and sup.store.get(b)["step"] > 0)
        assert sup.children[b].devices == [1] and a not in sup.children
        for _ in range(10):
            sup.tick()
        assert a not in sup.children

        # The process goes at last: GPU 0 is free again, and the job resumes there.
        os.kill(stuck_pid, signal.SIGKILL)
        run_ticks(sup, lambda: a in sup.children)
        assert sup.children[a].devices == [0]
        assert not any("stuck" in n for n in sup.notes)
        assert any(e["event"] == "stuck_trainer_gone" for e in read_events(tmp_path / "jobs" / a))
    finally:
        if stuck_pid:
            try:
                os.kill(stuck_pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for c in sup.children.values():
            c.popen.kill()
            c.popen.wait()
        store.close()


def test_start_up_does_not_wait_forever_for_an_orphan_that_outlives_sigkill(tmp_path, unkillable):
    store = Store(tmp_path / "state.db")
    jid = store.new_id("orphan")
    wd = tmp_path / "jobs" / jid
    wd.mkdir(parents=True)
    store.add_job(jid, "orphan", wd, 0, 1000, "test")
    store.begin_attempt(jid, 0, gpu=1)
    # What find_trainers looks for: `engine.run ... --workdir JOBS/ID`, here on GPU 1.
    orphan = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", "engine.run", "--workdir",
                               str(wd)], env={**os.environ, "CUDA_VISIBLE_DEVICES": "1"}, start_new_session=True)
    try:
        wait_until(lambda: proc.start_time(orphan.pid) is not None, 5, "the orphan")
        store.record_trainer(jid, 1, orphan.pid, proc.start_time(orphan.pid))
        unkillable.add(orphan.pid)
        t0 = time.monotonic()
        r = reconcile(tmp_path, DaemonConfig(stop_grace_s=0.5, kill_wait_s=0.5), store, setup())
        assert time.monotonic() - t0 < 3  # the grace and the kill wait, not forever: the daemon gets to READY
        assert [(s.pid, s.devices, s.job_id) for s in r.stuck] == [(orphan.pid, [1], jid)]
        assert orphan.pid not in r.orphans_stopped
        assert store.get(jid)["state"] == states.QUEUED  # settled; it waits on the lock the orphan holds
        sup = Supervisor(tmp_path, DaemonConfig(), store, [0, 1], setup())
        for s in r.stuck:
            sup.stuck.add(s)
        assert sup.stuck.devices() == {1}
    finally:
        orphan.kill()
        orphan.wait()
        store.close()


def test_shutdown_does_not_wait_forever_for_a_trainer_that_outlives_sigkill(tmp_path, unkillable):
    store = Store(tmp_path / "state.db")
    cfg = DaemonConfig(kill_wait_s=0.5, stop_grace_s=0.5)
    sup = Supervisor(tmp_path, cfg, store, [0], setup())
    sup.trainer_command = lambda wd: [sys.executable, "-c", FAKE, "go"]
    pid = None
    try:
        jid = queue(sup, tmp_path, "x")
        run_ticks(sup, lambda: jid in sup.children)
        pid = sup.children[jid].pid
        unkillable.add(pid)  # neither its SIGTERM nor its SIGKILL takes effect
        t0 = time.monotonic()
        sup.shutdown(cfg.stop_grace_s)
        assert time.monotonic() - t0 < 5  # the grace and the kill wait, then the daemon exits
        assert not sup.children and proc.alive(pid)
        assert store.get(jid)["state"] != states.RUNNING and "did not exit" in store.get(jid)["last_error"]
    finally:
        if pid:
            os.kill(pid, signal.SIGKILL)
        store.close()
