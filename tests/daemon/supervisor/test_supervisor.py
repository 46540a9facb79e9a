"""The supervisor's decisions, without torch: trainers' lives and exits, the policy seam, the watchdog's health.

The exit policy itself (exit code × stop reason × crashes → state) is a table in test_exit_policy.py.

The children here are small python scripts that speak the trainer's contract (JSON heartbeats on stdout,
SIGTERM → exit 75, SIGUSR1 → "checkpoint now"); the real trainer is exercised in test_daemon_service.py.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from daemon import protocol as p
from daemon.config.daemon import DaemonConfig
from daemon.power.run_policy import Decision
from daemon.service.handlers import Context, dispatch
from daemon.store import states
from daemon.store.db import Store
from daemon.supervisor import lock_contention, shutdown
from daemon.supervisor.loop import Supervisor
from daemon.supervisor.trainer import Child
from daemon.system import proc
from daemon.system.log import setup
from tests.helpers.daemon import job_events, wait_until

FAKE_TRAINER = textwrap.dedent("""
    import json, os, signal, sys, time
    marks = open(sys.argv[1], "a")
    flags = sys.argv[2:]
    if "oom_on_stop" in flags:
        marks.write("plan " + os.environ.get("LORAD_MEMORY_PLAN", "-") + "\\n"); marks.flush()
    stop = []
    def usr1(*a):
        marks.write("usr1\\n"); marks.flush()
    def term(*a):
        stop.append(1)
    signal.signal(signal.SIGUSR1, usr1)
    signal.signal(signal.SIGTERM, signal.SIG_IGN if "stubborn" in flags else term)
    step = 0
    while True:
        step += 1
        print(json.dumps({"event": "step", "step": step, "total": 1000, "loss": 1.0, "s_per_step": 0.05}), flush=True)
        if "checkpoints" in flags and step % 2 == 0:
            print(json.dumps({"event": "checkpoint_committed", "step": step, "path": f"ckpt-{step}"}), flush=True)
        if "slow_checkpoint" in flags and step == 2:
            print(json.dumps({"event": "checkpoint_slow", "step": step, "seconds": 31.0}), flush=True)
        if "finish" in flags and step == 3:
            sys.exit(0)
        time.sleep(0.05)
        if stop:
            if "oom_on_stop" in flags:  # the step it was in when SIGTERM came ran out of GPU memory
                plan = {"blocks": 19, "swap": 4, "keep": 0, "attention": 19, "recompute": 0, "samples": "on",
                        "micro_batch": 1, "grad_accum": 1, "summary": "swap 4/19 blocks"}
                print(json.dumps({"event": "out_of_memory", "step": step + 1, "phase": "step",
                                  "needed_bytes": 1 << 30, "plan": plan, "message": "out of GPU memory"}), flush=True)
                sys.exit(69)
            if "slow" in flags:
                time.sleep(0.5)  # the final checkpoint takes a while
            print(json.dumps({"event": "stopped", "step": step}), flush=True)
            sys.exit(75)
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
    # Whatever a test starts is the fake, never the real engine.
    s.trainer_command = lambda workdir: [sys.executable, "-c", FAKE_TRAINER, str(tmp_path / "marks")]
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
    sup.store.begin_attempt(jid, 0)  # queued → running, attempt 1
    popen = subprocess.Popen([sys.executable, "-c", FAKE_TRAINER, str(tmp_path / "marks"), *flags], stdout=subprocess.PIPE,
                             start_new_session=True)
    c = Child(job_id=jid, name="fake", workdir=wd, popen=popen, pid=popen.pid, pid_start=None, gpu=None, attempt=1,
              start_step=0, total=1000, power={})
    sup.children[jid] = c
    c.start_reader(sup.beats, sup.wake)
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



def test_a_backoff_the_wall_clock_was_set_back_under_does_not_hold_the_job_for_the_jump(sup, tmp_path):
    jid = queue_job(sup, tmp_path)
    sup.store.update(jid, not_before=time.time() + 30)  # a crash's 30 s backoff: the job waits
    sup.tick()
    assert sup.store.get(jid)["state"] == states.QUEUED and not sup.children
    # The clock set back a day during it (an NTP step): the backoff now ends a day from now, longer than any
    # backoff this daemon makes (backoff_max_s): it began before the jump, and the job starts.
    sup.store.update(jid, not_before=time.time() + 86400 + 30)
    sup.tick()
    assert sup.store.get(jid)["state"] == states.RUNNING and jid in sup.children

RANK_ZERO_BUSY_ALONE = textwrap.dedent("""
    import json, os, subprocess, sys, time
    from engine.distributed.liveness import Liveness
    # Rank 0 keeps its heartbeats coming (as while it renders samples) beside a rank 1 that the test stops.
    rank1 = subprocess.Popen([sys.executable, "-c", "from engine.distributed.liveness import Liveness; import time; "
                              "Liveness.from_env().start(); time.sleep(600)"], env={**os.environ, "RANK": "1"})
    open(sys.argv[1], "w").write(str(rank1.pid))
    Liveness.from_env().start()
    step = 0
    while True:
        step += 1
        print(json.dumps({"event": "heartbeat", "phase": "samples", "prompt": step}), flush=True)
        time.sleep(0.1)
""")


def test_a_stopped_rank_is_a_hung_job_while_rank_0_still_sends_heartbeats(sup, tmp_path):
    sup.cfg = DaemonConfig(hang_timeout_s=600, rank_silence_s=1.5, backoff_base_s=60)
    pid_file = tmp_path / "rank1.pid"
    sup.trainer_command = lambda workdir: [sys.executable, "-c", RANK_ZERO_BUSY_ALONE, str(pid_file)]
    jid = queue_job(sup, tmp_path)
    run_ticks(sup, lambda: jid in sup.children and pid_file.exists() and
              len(list((tmp_path / "jobs" / jid / "ranks").glob("rank-*"))) == 2, timeout=30)
    rank1 = int(pid_file.read_text())
    try:
        time.sleep(2.5)  # both ranks alive past the limit: no hang
        assert jid in sup.children and sup.store.get(jid)["state"] == states.RUNNING
        c, stopped_at = sup.children[jid], time.monotonic()
        os.kill(rank1, signal.SIGSTOP)
        run_ticks(sup, lambda: not sup.children, timeout=30)
    finally:
        try:
            os.kill(rank1, signal.SIGKILL)
        except ProcessLookupError:
            pass
    job = sup.store.get(jid)
    assert job["state"] == states.QUEUED and job["retries"] == 1
    assert "hung: rank 1 has shown no sign of life" in job["last_error"], job["last_error"]
    assert c.last_beat > stopped_at  # rank 0 kept sending heartbeats after rank 1 stopped (hang_timeout_s is 600)


LEAVES_A_GRANDCHILD = textwrap.dedent("""
    import subprocess, sys
    # A worker in the trainer's own process group (as a data-loader or compile worker would be), left behind.
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], stdout=subprocess.DEVNULL)
    open(sys.argv[1], "w").write(str(worker.pid))
    sys.exit(1)
""")


def test_reaping_a_trainer_kills_what_it_left_in_its_process_group(sup, tmp_path):
    pid_file = tmp_path / "worker.pid"
    sup.trainer_command = lambda workdir: [sys.executable, "-c", LEAVES_A_GRANDCHILD, str(pid_file)]
    jid = queue_job(sup, tmp_path)
    run_ticks(sup, lambda: jid in sup.children)
    run_ticks(sup, lambda: jid not in sup.children and sup.store.get(jid)["state"] == states.QUEUED)
    worker = int(pid_file.read_text())
    try:
        wait_until(lambda: not proc.alive(worker), 5, "the trainer's left-over worker to be killed")
    finally:
        try:
            os.kill(worker, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_the_watchdog_is_fed_only_while_every_step_works(sup, tmp_path):
    sup.tick()
    assert "WATCHDOG=1" in sup.notifier.sent
    sup.notifier.sent.clear()
    sup.systemd.last_watchdog = 0
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


# ---------------------------------------------------------------- the user's pause or cancel while a job is stopping
def ctx_for(sup: Supervisor, tmp_path: Path) -> Context:
    return Context(home=tmp_path, store=sup.store, intake=None, supervisor=sup, started_at=0, socket_path=tmp_path / "s")


def stop_for(sup: Supervisor, c: Child, why: str) -> None:
    """Make the running fake stop for a reason of the daemon's own (not the user's)."""
    if why == "drain":
        dispatch(ctx_for(sup, c.workdir.parent.parent), p.Drain(on=True))
        run_ticks(sup, lambda: c.stop_reason == "drain")
    elif why == "policy":
        sup.policy.decision = Decision(may_start=False, stop_running="outside the run window")
        run_ticks(sup, lambda: (c.stop_reason or "").startswith("policy"))
    else:
        sup.shutting_down = True
        sup.stop(c, "shutdown")  # what shutdown() does first


@pytest.mark.parametrize("why", ["drain", "policy", "shutdown"])
@pytest.mark.parametrize("verb, final", [("cancel", states.CANCELLED), ("pause", states.PAUSED)])
def test_a_pause_or_cancel_sent_while_the_job_is_already_stopping_wins(sup, tmp_path, why, verb, final):
    c = adopt_fake(sup, tmp_path, "slow")  # takes 0.5 s to checkpoint after SIGTERM
    run_ticks(sup, lambda: sup.store.get(c.job_id)["step"] > 0)
    stop_for(sup, c, why)
    req = p.Cancel(job=c.job_id) if verb == "cancel" else p.Pause(job=c.job_id)
    reply = json.loads(dispatch(ctx_for(sup, tmp_path), req))
    assert reply["ok"] and reply["data"]["message"].startswith(("cancelling", "pausing"))
    if why == "shutdown":
        sup.shutdown(5)
    else:
        run_ticks(sup, lambda: not sup.children and not sup.pending)
        for _ in range(3):
            sup.tick()  # nothing starts it again
    job = sup.store.get(c.job_id)
    assert job["state"] == final and job["requested"] is None and not sup.children
    assert sup.policy.seen[-1] == "end 75"  # the policy hears of the end (a power cap is restored)


def test_a_cancel_after_a_pause_that_is_still_in_progress_is_the_last_word(sup, tmp_path):
    c = adopt_fake(sup, tmp_path, "slow")
    run_ticks(sup, lambda: sup.store.get(c.job_id)["step"] > 0)
    dispatch(ctx_for(sup, tmp_path), p.Pause(job=c.job_id))
    run_ticks(sup, lambda: c.stop_reason == "pause")
    dispatch(ctx_for(sup, tmp_path), p.Cancel(job=c.job_id))
    run_ticks(sup, lambda: not sup.children and not sup.pending)
    assert sup.store.get(c.job_id)["state"] == states.CANCELLED


@pytest.mark.parametrize("why", ["pause", "shutdown"])
def test_an_out_of_memory_while_the_job_is_being_paused_or_stopped_keeps_its_replan(sup, tmp_path, why):
    """Exit 69 while a pause (or a shutdown) is under way: the stop wins, and the re-plan is kept for the next
    attempt, uncounted and logged as oom_replan, so the resumed job does not run out under the old plan again."""
    use_fake_trainers(sup, tmp_path, "oom_on_stop")
    jid = queue_job(sup, tmp_path)
    run_ticks(sup, lambda: sup.store.get(jid)["step"] > 0)
    if why == "pause":
        dispatch(ctx_for(sup, tmp_path), p.Pause(job=jid))
        run_ticks(sup, lambda: not sup.children and not sup.pending)
    else:
        sup.shutdown(5)
    job = sup.store.get(jid)
    assert job["state"] == (states.PAUSED if why == "pause" else states.INTERRUPTED), job
    assert sup.store.attempts(jid)[-1]["exit_code"] == 69 and job["retries"] == 0
    assert json.loads(job["memory"]) == {"swap_at_least": 8, "tried": ["blocks_to_swap 4→8"]}
    (ev,) = [e for e in sup.store.events(jid) if e["kind"] == "oom_replan"]
    assert ev["data"]["lever"] == "blocks_to_swap 4→8" and ev["data"]["before"] == "swap 4/19 blocks"
    if why == "pause":  # resumed: the next attempt runs under the new plan
        dispatch(ctx_for(sup, tmp_path), p.Resume(job=jid))
        run_ticks(sup, lambda: jid in sup.children)
        wait_until(lambda: (tmp_path / "marks").read_text().count("plan ") == 2, 10, "the second trainer")
        assert (tmp_path / "marks").read_text().splitlines()[-1] == "plan " + job["memory"]


# ---------------------------------------------------------------- store writes that fail are retried, never dropped
def fail_once(store: Store, method: str) -> list[str]:
    """store.<method> raises once (as SQLite does when the disk is full), then works again."""
    real = getattr(store, method)
    calls: list[str] = []

    def once(*a, **k):
        setattr(store, method, real)
        calls.append(method)
        raise sqlite3.OperationalError("database or disk is full")

    setattr(store, method, once)
    return calls


def test_an_exit_that_cannot_be_written_is_kept_and_written_on_a_later_tick(sup, tmp_path):
    c = adopt_fake(sup, tmp_path)
    c.popen.kill()
    c.popen.wait()
    calls = fail_once(sup.store, "end_run")
    sup.tick()
    assert calls and not sup.healthy  # the failed write shows (no watchdog ping for this tick) ...
    assert sup.store.get(c.job_id)["state"] == states.RUNNING and c.job_id in sup.pending  # ... and is kept
    sup.tick()
    job = sup.store.get(c.job_id)
    assert sup.healthy and not sup.pending and not sup.children
    assert job["state"] == states.QUEUED and job["retries"] == 1 and job["pid"] is None  # a crash, retried
    assert sup.store.attempts(c.job_id)[-1]["exit_code"] == -signal.SIGKILL


def test_an_exit_still_unwritten_at_shutdown_is_retried_and_then_left_to_recovery(sup, tmp_path, monkeypatch):
    monkeypatch.setattr(shutdown, "PENDING_GIVE_UP_S", 0.5)
    c = adopt_fake(sup, tmp_path)
    sup.store.end_run = lambda *a, **k: (_ for _ in ()).throw(sqlite3.OperationalError("disk I/O error"))
    t0 = time.monotonic()
    sup.shutdown(5)  # returns: a store that keeps failing does not hold the daemon's exit forever
    assert time.monotonic() - t0 < 5 and not sup.children and c.popen.poll() is not None
    assert sup.store.get(c.job_id)["state"] == states.RUNNING  # recovery counts it at the next start


def queue_job(sup: Supervisor, tmp_path: Path, name: str = "q", priority: int = 0) -> str:
    jid = sup.store.new_id(name)
    (tmp_path / "jobs" / jid).mkdir(parents=True)
    sup.store.add_job(jid, name, tmp_path / "jobs" / jid, priority, 1000, "test")
    return jid


def use_fake_trainers(sup: Supervisor, tmp_path: Path, *flags: str) -> None:
    sup.trainer_command = lambda workdir: [sys.executable, "-c", FAKE_TRAINER, str(tmp_path / "marks"), *flags]


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_start_whose_first_write_fails_leaves_the_job_queued_and_leaks_nothing(sup, tmp_path):
    use_fake_trainers(sup, tmp_path)
    jid = queue_job(sup, tmp_path)
    fds = open_fds()
    calls = fail_once(sup.store, "begin_attempt")
    sup.tick()
    assert calls and not sup.children and sup.store.get(jid)["state"] == states.QUEUED
    assert sup.store.attempts(jid) == [] and open_fds() == fds  # no attempt row, the trainer.lock fd closed
    sup.tick()
    assert jid in sup.children and sup.store.get(jid)["state"] == states.RUNNING


def test_a_trainer_whose_pid_cannot_be_recorded_is_tracked_and_its_pid_written_later(sup, tmp_path):
    use_fake_trainers(sup, tmp_path)
    jid = queue_job(sup, tmp_path)
    calls = fail_once(sup.store, "record_trainer")
    sup.tick()
    c = sup.children[jid]  # tracked at once: its stdout is read, it can be stopped
    assert calls and sup.store.get(jid)["pid"] is None
    run_ticks(sup, lambda: sup.store.get(jid)["step"] > 0)
    job = sup.store.get(jid)
    assert job["pid"] == c.pid and job["pid_start"] == proc.start_time(c.pid)
    assert sup.store.attempts(jid)[-1]["pid"] == c.pid


def test_a_trainer_that_cannot_be_started_is_requeued_even_if_that_write_fails_once(sup, tmp_path):
    sup.trainer_command = lambda workdir: [str(tmp_path / "no-such-python")]
    jid = queue_job(sup, tmp_path)
    calls = fail_once(sup.store, "end_run")
    sup.tick()
    assert calls and sup.store.get(jid)["state"] == states.RUNNING and jid in sup.pending and not sup.children
    sup.tick()
    job = sup.store.get(jid)
    assert job["state"] == states.QUEUED and "could not start the trainer" in job["last_error"]
    assert job["not_before"] > time.time() and not sup.pending
    assert sup.store.attempts(jid)[-1]["ended_at"] is not None


# ---------------------------------------------------------------- a job an earlier trainer still holds
HOLDER = textwrap.dedent("""
    import fcntl, signal, sys, time
    # argv: lock file, marks file, then "engine.run --workdir DIR" so that it looks like a trainer of this home
    lock = open(sys.argv[1], "a")
    fcntl.flock(lock, fcntl.LOCK_EX)
    marks = open(sys.argv[2], "a")
    def term(*a):
        marks.write("term\\n"); marks.flush()
    signal.signal(signal.SIGTERM, term)
    print("holding", flush=True)
    while True:
        time.sleep(0.05)
""")


@pytest.fixture
def holder(tmp_path):
    started = []

    def hold(jid: str) -> subprocess.Popen:
        wd = tmp_path / "jobs" / jid
        h = subprocess.Popen([sys.executable, "-c", HOLDER, str(wd / "trainer.lock"), str(tmp_path / "holder-marks"),
                              "engine.run", "--workdir", str(wd)], stdout=subprocess.PIPE, text=True,
                             start_new_session=True)
        assert h.stdout.readline().strip() == "holding"
        started.append(h)
        return h

    yield hold
    for h in started:
        h.kill()
        h.wait()


def test_a_job_held_by_an_earlier_trainer_waits_while_the_next_job_starts(sup, tmp_path, holder):
    use_fake_trainers(sup, tmp_path)
    first = queue_job(sup, tmp_path, "first", priority=5)
    second = queue_job(sup, tmp_path, "second")
    holder(first)
    sup.tick()
    assert list(sup.children) == [second]  # the one device went to the next in line
    job = sup.store.get(first)
    assert job["state"] == states.QUEUED and time.time() < job["not_before"] <= time.time() + 10


def test_the_earlier_trainer_is_asked_to_stop_once_and_the_job_starts_when_it_is_gone(sup, tmp_path, holder,
                                                                                        monkeypatch):
    monkeypatch.setattr(lock_contention, "LOCK_BUSY_RETRY_S", 0.1)  # tried again and again during the test
    use_fake_trainers(sup, tmp_path)
    jid = queue_job(sup, tmp_path)
    h = holder(jid)
    end = time.monotonic() + 1.5
    while time.monotonic() < end:
        sup.tick()
        time.sleep(0.02)
    assert not sup.children and (tmp_path / "holder-marks").read_text() == "term\n"  # one SIGTERM, not one per try
    h.kill()
    h.wait()
    run_ticks(sup, lambda: jid in sup.children)


# ---------------------------------------------------------------- crash counting and the retry budget
def test_a_new_checkpoint_resets_the_crash_count_in_the_store(sup, tmp_path):
    c = adopt_fake(sup, tmp_path, "checkpoints")
    sup.store.update(c.job_id, retries=3)  # crashed three times in a row before this attempt
    run_ticks(sup, lambda: sup.store.get(c.job_id)["checkpoint_step"])
    assert sup.store.get(c.job_id)["retries"] == 0  # an outage now counts as the first crash, not the fourth


def test_a_cancel_landing_while_an_interrupted_exit_is_written_waits_for_it_and_nothing_is_skipped(sup, tmp_path):
    """The exit (attempt closed, running → interrupted → queued) is one transaction: a cancel sent meanwhile is
    applied after it (queued → cancelled), and the exit's own steps (log, events, the policy's on_job_end) run."""
    c = adopt_fake(sup, tmp_path)
    run_ticks(sup, lambda: sup.store.get(c.job_id)["step"] > 0)
    real, replies = sup.store.end_run, []

    def end_run(job_id, code, step, error, plan):
        def plan_with_a_cancel_racing(job):
            t = threading.Thread(target=lambda: replies.append(dispatch(ctx_for(sup, tmp_path), p.Cancel(job=job_id))))
            t.start()
            t.join(0.3)  # the cancel has arrived and waits for the store
            return plan(job)

        return real(job_id, code, step, error, plan_with_a_cancel_racing)

    sup.store.end_run = end_run
    sup.policy.decision = Decision(may_start=False, stop_running="outside the run window")
    run_ticks(sup, lambda: not sup.children and not sup.pending and replies)
    assert json.loads(replies[0]).get("data", {}).get("state") == states.CANCELLED, replies[0]
    assert sup.store.get(c.job_id)["state"] == states.CANCELLED and sup.healthy
    assert sup.policy.seen[-1] == "end 75"
    assert [e["event"] for e in job_events(c.workdir)][-1] == "trainer_exited"


def test_trainers_start_with_the_checkpoint_signal_blocked_until_their_handler_is_in_place(sup, tmp_path):
    # SIGUSR1 ("checkpoint now") must not kill a trainer still importing torch: it starts blocked (pending),
    # engine.training.stop.StopFlag.install unblocks it. The daemon's own mask is left as it was.
    report = tmp_path / "sigblk"
    sup.trainer_command = lambda workdir: [sys.executable, "-c", (
        "import signal, sys; open(sys.argv[1], 'w').write(str(int(signal.SIGUSR1 in signal.pthread_sigmask("
        "signal.SIG_BLOCK, []))))"), str(report)]
    before = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    queue_job(sup, tmp_path)
    sup.tick()
    run_ticks(sup, lambda: report.exists() and report.read_text() != "")
    assert report.read_text() == "1"
    assert signal.pthread_sigmask(signal.SIG_BLOCK, []) == before


class RecNotifications:
    def __init__(self):
        self.sent: list[tuple[str, str, dict]] = []

    def emit(self, event, job_id, name=None, **detail):
        self.sent.append((event, job_id, detail))


def test_a_slow_checkpoint_a_power_stop_and_a_finished_job_are_notified(sup, tmp_path):
    sup.notifications = RecNotifications()
    c = adopt_fake(sup, tmp_path, "slow_checkpoint")
    run_ticks(sup, lambda: sup.notifications.sent)
    sup.policy.decision = Decision(stop_running="outside the run window", may_start=False)
    run_ticks(sup, lambda: not sup.children)
    sup.policy.decision = Decision(may_start=False)  # the stopped job stays queued
    done = adopt_fake(sup, tmp_path, "finish")
    run_ticks(sup, lambda: not sup.children)
    sent = sup.notifications.sent
    assert [(e, j) for e, j, _ in sent] == [("checkpoint_slow", c.job_id), ("stopped_by_power", c.job_id),
                                            ("succeeded", done.job_id)]
    assert sent[0][2]["seconds"] == 31.0 and sent[1][2]["reason"].startswith("policy")
    assert sent[2][2]["state"] == states.SUCCEEDED and sent[2][2]["exit_code"] == 0


def test_a_failing_tick_step_is_logged_once_per_cause_and_again_when_it_recovers(tmp_path, monkeypatch):
    from tests.helpers.fakes import RecLog

    store = Store(tmp_path / "state.db")
    log = RecLog()
    s = Supervisor(tmp_path, DaemonConfig(), store, [None], log, policy=FakePolicy())
    try:
        def full(now, **_):
            raise sqlite3.OperationalError("database or disk is full")

        monkeypatch.setattr(store, "next_queued", full)
        for _ in range(8):  # two seconds of a full state.db at 4 ticks a second
            s.tick()
        assert [kw["error"] for kw in log.named("tick_step_failed")] == ["OperationalError: database or disk is full"]
        monkeypatch.setattr(store, "next_queued", lambda now, **_: (_ for _ in ()).throw(sqlite3.OperationalError("locked")))
        s.tick()
        s.tick()
        assert len(log.named("tick_step_failed")) == 2  # a new cause is said once
        monkeypatch.undo()
        s.tick()
        s.tick()
        assert [(kw["step"], kw["failed_ticks"]) for kw in log.named("tick_step_recovered")] == [("spawn", 10)]
        assert len(log.named("tick_step_failed")) == 2
    finally:
        store.close()
