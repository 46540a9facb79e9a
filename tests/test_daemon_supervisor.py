"""The supervisor's decisions, without torch: exit codes → states, the policy seam, the watchdog's health.

The children here are small python scripts that speak the trainer's contract (JSON heartbeats on stdout,
SIGTERM → exit 75, SIGUSR1 → "checkpoint now"); the real trainer is exercised in test_daemon_service.py.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from daemon import states
from daemon.log import setup
from daemon.policy import Decision
from daemon.settings import DaemonConfig
from daemon.store import Store
from daemon.supervisor import Child, Supervisor, decide_exit
from tests.daemon_helpers import wait_until

CFG = DaemonConfig(retry_budget=2, backoff_base_s=10, backoff_max_s=25)


@pytest.mark.parametrize("code, stop, retries, state, backoff", [
    (0, None, 0, states.SUCCEEDED, None),
    (0, "cancel", 0, states.SUCCEEDED, None),  # finished before the stop took effect: it is done
    (65, None, 0, states.FAILED, None),  # invalid job: never retried
    (75, "pause", 0, states.PAUSED, None),
    (-9, "pause", 0, states.PAUSED, None),  # killed after the grace: still what the user asked for
    (75, "cancel", 0, states.CANCELLED, None),
    (75, "shutdown", 0, states.INTERRUPTED, None),
    (75, "drain", 0, states.INTERRUPTED, None),
    (75, "policy: outside run window", 0, states.INTERRUPTED, None),
    (75, None, 0, states.INTERRUPTED, None),  # SIGTERM from outside the daemon
    (1, None, 1, states.QUEUED, 10),
    (-11, None, 2, states.QUEUED, 20),  # exponential
    (74, None, 2, states.QUEUED, 20),  # disk full: retried with backoff
    (1, None, 3, states.FAILED, None),  # budget of 2 retries spent
])
def test_exit_code_and_stop_reason_decide_the_next_state(code, stop, retries, state, backoff):
    d = decide_exit(code, stop, retries, CFG, "boom")
    assert d.state == state and d.retry_in == backoff
    states.check(states.RUNNING, d.state)  # every outcome is an edge of the table


def test_backoff_is_capped():
    assert decide_exit(1, None, 2, DaemonConfig(retry_budget=50, backoff_base_s=10, backoff_max_s=15), "x").retry_in == 15


FAKE_TRAINER = textwrap.dedent("""
    import json, signal, sys, time
    marks = open(sys.argv[1], "a")
    def usr1(*a):
        marks.write("usr1\\n"); marks.flush()
    def term(*a):
        print(json.dumps({"event": "stopped", "step": 3}), flush=True)
        sys.exit(75)
    signal.signal(signal.SIGUSR1, usr1)
    signal.signal(signal.SIGTERM, signal.SIG_IGN if sys.argv[2:] == ["stubborn"] else term)
    step = 0
    while True:
        step += 1
        print(json.dumps({"event": "step", "step": step, "total": 1000, "loss": 1.0, "s_per_step": 0.05}), flush=True)
        time.sleep(0.05)
""")


class FakePolicy:
    def __init__(self):
        self.decision = Decision()
        self.seen: list[str] = []

    def on_job_start(self, job):
        self.seen.append(f"start {job.job_id}")

    def on_heartbeat(self, job_id, event):
        if event.get("event") == "step" and "beat" not in self.seen:
            self.seen.append("beat")

    def on_job_end(self, job_id, exit_code):
        self.seen.append(f"end {exit_code}")

    def tick(self, now, running):
        return self.decision

    def close(self):
        pass


class FakeNotifier:
    enabled = True
    watchdog_s = 0.3

    def __init__(self):
        self.sent: list[str] = []

    def watchdog(self):
        self.sent.append("WATCHDOG=1")

    def status(self, s):
        self.sent.append(f"STATUS={s}")

    def extend_timeout(self, s):
        self.sent.append("EXTEND")


@pytest.fixture
def sup(tmp_path):
    store = Store(tmp_path / "state.db")
    s = Supervisor(tmp_path, DaemonConfig(stop_grace_s=5), store, [None], setup(), policy=FakePolicy(),
                   notifier=FakeNotifier())
    yield s
    for c in s.children.values():
        c.popen.kill()
    store.close()


def adopt_fake(sup: Supervisor, tmp_path: Path, *flags: str) -> Child:
    """A running job whose 'trainer' is the fake script, wired in the way start() wires a real one."""
    jid = sup.store.new_id("fake")
    wd = tmp_path / "jobs" / jid
    wd.mkdir(parents=True)
    sup.store.add_job(jid, "fake", wd, 0, 1000, "test")
    sup.store.transition(jid, states.QUEUED, states.RUNNING)
    sup.store.start_attempt(jid, 0)
    popen = subprocess.Popen([sys.executable, "-c", FAKE_TRAINER, str(tmp_path / "marks"), *flags], stdout=subprocess.PIPE,
                             start_new_session=True)
    c = Child(job_id=jid, name="fake", workdir=wd, popen=popen, pid=popen.pid, pid_start=None, gpu=None, attempt=1,
              start_step=0, total=1000, power={})
    c.reader = threading.Thread(target=sup._read, args=(c,), daemon=True)
    sup.children[jid] = c
    c.reader.start()
    sup.policy.on_job_start(c.running_job())
    return c


def run_ticks(sup: Supervisor, until, timeout: float = 10):
    def once():
        sup.tick()
        return until()

    return wait_until(once, timeout, "the supervisor", poll=0.05)


def test_policy_stop_running_checkpoints_and_requeues_and_may_start_false_starts_nothing(sup, tmp_path):
    c = adopt_fake(sup, tmp_path)
    run_ticks(sup, lambda: sup.store.get(c.job_id)["step"] > 0)
    assert "beat" in sup.policy.seen
    sup.policy.decision = Decision(may_start=False, stop_running="outside the run window", notes=["window closed"])
    run_ticks(sup, lambda: not sup.children)
    job = sup.store.get(c.job_id)
    assert job["state"] == states.QUEUED  # running → interrupted → queued
    kinds = [e["data"]["to"] for e in sup.store.events(c.job_id) if e["kind"] == "transition"]
    assert kinds[-2:] == [states.INTERRUPTED, states.QUEUED]
    assert sup.policy.seen[-1] == "end 75"
    sup.tick()
    assert not sup.children and sup.store.get(c.job_id)["state"] == states.QUEUED  # may_start=False: nothing starts
    assert "window closed" in sup.status_line()


def test_checkpoint_now_sends_one_sigusr1_per_rising_edge(sup, tmp_path):
    c = adopt_fake(sup, tmp_path)
    run_ticks(sup, lambda: sup.store.get(c.job_id)["step"] > 0)
    sup.policy.decision = Decision(checkpoint_now=True)
    for _ in range(5):
        sup.tick()
    marks = tmp_path / "marks"
    wait_until(lambda: marks.exists() and marks.read_text().count("usr1") == 1, 5, "one SIGUSR1")
    time.sleep(0.3)
    assert marks.read_text().count("usr1") == 1
    sup.policy.decision = Decision()
    sup.tick()
    sup.policy.decision = Decision(checkpoint_now=True)
    sup.tick()
    wait_until(lambda: marks.read_text().count("usr1") == 2, 5, "a second SIGUSR1")


def test_a_hung_child_is_killed_as_a_group_and_retried(sup, tmp_path):
    sup.cfg = DaemonConfig(hang_timeout_s=0.5, hang_step_multiple=1, backoff_base_s=60)
    c = adopt_fake(sup, tmp_path)
    run_ticks(sup, lambda: sup.store.get(c.job_id)["step"] > 0)
    c.popen.send_signal(signal.SIGSTOP)
    run_ticks(sup, lambda: not sup.children)
    job = sup.store.get(c.job_id)
    assert job["state"] == states.QUEUED and job["retries"] == 1 and job["not_before"] > time.time() + 50
    assert "hung: no heartbeat" in job["last_error"]
    assert sup.store.attempts(c.job_id)[-1]["exit_code"] == -signal.SIGKILL


def test_the_watchdog_is_fed_only_while_every_step_works(sup, tmp_path):
    sup.tick()
    assert "WATCHDOG=1" in sup.notifier.sent
    sup.notifier.sent.clear()
    sup._last_watchdog = 0
    sup._spawn = lambda: 1 / 0  # a step that keeps failing
    for _ in range(3):
        sup.tick()
    assert "WATCHDOG=1" not in sup.notifier.sent and not sup.healthy


def test_pause_sends_sigterm_and_sigkill_after_the_grace(sup, tmp_path):
    sup.cfg = DaemonConfig(stop_grace_s=0.5)
    c = adopt_fake(sup, tmp_path, "stubborn")
    run_ticks(sup, lambda: sup.store.get(c.job_id)["step"] > 0)
    sup.store.update(c.job_id, requested="pause")  # what the pause handler writes
    t0 = time.monotonic()
    run_ticks(sup, lambda: not sup.children)
    assert time.monotonic() - t0 >= 0.5
    job = sup.store.get(c.job_id)
    assert job["state"] == states.PAUSED and job["requested"] is None
    assert sup.store.attempts(c.job_id)[-1]["exit_code"] == -signal.SIGKILL


def test_a_queued_job_whose_directory_vanished_fails_instead_of_jamming_the_loop(sup, tmp_path):
    jid = sup.store.new_id("lost")
    sup.store.add_job(jid, "lost", tmp_path / "jobs" / jid, 0, 10, "test")  # the directory never existed
    sup.tick()
    job = sup.store.get(jid)
    assert job["state"] == states.FAILED and "cannot use the job directory" in job["last_error"]
    assert sup.healthy and not sup.children
