"""The exit policy as a table: (exit code, stop reason, crashes in a row) → (state, backoff, reason)."""

from __future__ import annotations

import signal

import pytest

from daemon.config.daemon import DaemonConfig
from daemon.store import states
from daemon.supervisor.exit_policy import decide_exit, describe_exit, same_error_in_a_row

CFG = DaemonConfig(retry_budget=2, backoff_base_s=10, backoff_max_s=25)


FULL = "disk full while saving checkpoint step-00000020 in /j/checkpoints (0 MiB free); the previous ... intact"


@pytest.mark.parametrize("code, stop, before, progressed, error, state, backoff, reason, crashes", [
    (0, None, 0, False, "boom", states.SUCCEEDED, None, "finished", 0),
    (0, "cancel", 0, False, "boom", states.SUCCEEDED, None, "finished", 0),  # finished before the stop: it is done
    (0, "shutdown", 2, False, "boom", states.SUCCEEDED, None, "finished", 0),
    (65, None, 0, False, "boom", states.FAILED, None, "invalid job: boom", 0),  # invalid job: never retried
    (65, None, 9, False, "boom", states.FAILED, None, "invalid job: boom", 9),  # ... whatever the crash count
    (75, "pause", 0, False, "boom", states.PAUSED, None, "paused by the user", 0),
    (-9, "pause", 0, False, "boom", states.PAUSED, None, "paused by the user", 0),  # killed after the grace
    (75, "cancel", 0, False, "boom", states.CANCELLED, None, "cancelled by the user", 0),
    (1, "cancel", 5, False, "boom", states.CANCELLED, None, "cancelled by the user", 5),  # crash while cancelling
    (75, "shutdown", 0, False, "boom", states.INTERRUPTED, None, "shutdown", 0),
    (-9, "shutdown", 0, False, "boom", states.INTERRUPTED, None, "shutdown", 0),  # killed at the deadline
    (75, "drain", 0, False, "boom", states.INTERRUPTED, None, "drain", 0),
    (75, "policy: outside run window", 0, False, "boom", states.INTERRUPTED, None, "policy: outside run window", 0),
    (75, "preempt: yields to b-1 (priority 9)", 1, False, "boom", states.INTERRUPTED, None,
     "preempt: yields to b-1 (priority 9)", 1),  # yielded to a higher priority: resumed later, nothing counted
    (75, None, 0, False, "boom", states.INTERRUPTED, None, "the trainer was stopped from outside the daemon", 0),
    # Cut off by an outage that is not the job's fault (host rebooted, UPS shutdown): resumed, nothing counted.
    (None, "outage", 2, False, "cut off", states.INTERRUPTED, None, "outage", 2),
    (1, None, 0, False, "boom", states.QUEUED, 10, "crashed (boom); retry 1/2", 1),
    (-11, None, 1, False, "boom", states.QUEUED, 20, "crashed (boom); retry 2/2", 2),  # exponential
    (None, None, 0, False, "boom", states.QUEUED, 10, "crashed (boom); retry 1/2", 1),  # exit unknown (cut off)
    (1, None, 2, False, "boom", states.FAILED, None, "retry budget spent (2); last error: boom", 3),  # spent
    # A crash after a new checkpoint: progress was made, the budget is refunded and this crash is the first.
    (1, None, 2, True, "boom", states.QUEUED, 10, "crashed (boom); retry 1/2", 1),
    (75, "pause", 2, True, "boom", states.PAUSED, None, "paused by the user", 0),
    # Disk full waits for space and never spends the budget; exit 74 for another cause is a crash.
    (74, None, 2, False, FULL, states.WAITING, None, f"disk full; waits for free space ({FULL})", 2),
    (74, None, 1, False, "cannot write (Read-only file system)", states.QUEUED, 20,
     "crashed (cannot write (Read-only file system)); retry 2/2", 2),
    # Its GPU was quarantined (daemon/supervisor/gpu_path.py): killed or crashed with it, the job waits for a GPU
    # and nothing is counted, not even with the budget already spent.
    (-9, "gpu: GPU 1 quarantined (Xid 79)", 2, False, "boom", states.WAITING_FOR_GPU, None,
     "gpu: GPU 1 quarantined (Xid 79)", 2),
    (75, "gpu: GPU 0 quarantined (row remap pending: the GPU needs a reset)", 0, False, None, states.WAITING_FOR_GPU,
     None, "gpu: GPU 0 quarantined (row remap pending: the GPU needs a reset)", 0),
    (0, "gpu: GPU 0 held (Xid 79)", 0, False, None, states.SUCCEEDED, None, "finished", 0),  # finished first
])
def test_exit_code_and_stop_reason_decide_the_next_state(code, stop, before, progressed, error, state, backoff,
                                                          reason, crashes):
    d = decide_exit(code, stop, before, CFG, error, progressed=progressed)
    assert (d.state, d.retry_in, d.reason, d.crashes) == (state, backoff, reason, crashes)
    states.check(states.RUNNING, d.state)  # every outcome is an edge of the table


BUG = "exit code 70: lorad: internal error at step 7 (KeyError: 'x'); the traceback is in /j/trainer.log"
BIG = DaemonConfig(retry_budget=9, backoff_base_s=10, backoff_max_s=25)


@pytest.mark.parametrize("code, before, repeats, state, crashes", [
    (70, 0, 0, states.QUEUED, 1),  # the first time: a crash like any other, retried
    (70, 1, 1, states.QUEUED, 2),  # the second time
    (70, 2, 2, states.FAILED, 3),  # the third time in a row at the same step, same message: not retried
    (70, 0, 2, states.QUEUED, 1),  # repeats from before progress or `lorad retry` (crash count 0) do not count
    (1, 2, 2, states.QUEUED, 3),  # a crash that is not an internal error is the retry budget's business
])
def test_an_internal_error_repeated_at_the_same_step_fails_the_job_on_its_third_time(code, before, repeats, state,
                                                                                     crashes):
    d = decide_exit(code, None, before, BIG, BUG, repeats=repeats)
    assert (d.state, d.crashes) == (state, crashes)
    if state == states.FAILED:
        assert d.reason == ("internal error at step 7 (KeyError: 'x'); the traceback is in /j/trainer.log — the "
                            "same error 3 times in a row, not retried again (lorad retry starts it again)")


def test_only_the_same_error_in_the_attempts_just_before_counts_as_a_repeat():
    assert same_error_in_a_row(BUG, [BUG, BUG]) == 2
    assert same_error_in_a_row(BUG, [BUG, "exit code 1: boom", BUG]) == 1
    assert same_error_in_a_row(BUG.replace("step 7", "step 8"), [BUG, BUG]) == 0  # another step: progress
    assert same_error_in_a_row(None, [None, None]) == 0


def test_backoff_is_capped():
    assert decide_exit(1, None, 1, DaemonConfig(retry_budget=50, backoff_base_s=10, backoff_max_s=15), "x").retry_in == 15


def test_retry_budget_is_how_many_times_a_crashed_job_is_retried():
    """retry_budget: N → crashes 1..N are retried (with backoff), crash N+1 in a row fails the job."""
    cfg = DaemonConfig(retry_budget=3)
    outcomes = [decide_exit(1, None, n, cfg, "boom").state for n in range(0, 4)]
    assert outcomes == [states.QUEUED] * 3 + [states.FAILED]
    assert decide_exit(1, None, 0, DaemonConfig(retry_budget=0), "boom").state == states.FAILED  # 0: never retried


def test_a_job_that_commits_checkpoints_between_crashes_never_fails_one_that_does_not_does():
    cfg = DaemonConfig(retry_budget=1)
    crashes = 0
    for _ in range(10):  # crashes forever, but each attempt committed a new checkpoint first
        d = decide_exit(-9, None, crashes, cfg, "oom", progressed=True)
        assert d.state == states.QUEUED
        crashes = d.crashes
    assert decide_exit(-9, None, crashes, cfg, "oom").state == states.FAILED  # no new checkpoint this time


@pytest.mark.parametrize("code, words", [
    (None, "unknown exit"),
    (0, "exit code 0"),
    (75, "exit code 75"),
    (-signal.SIGKILL, "killed by SIGKILL"),
    (-signal.SIGSEGV, "killed by SIGSEGV"),
    (-200, "killed by signal 200"),  # no such signal name
])
def test_an_exit_status_is_described_in_words(code, words):
    assert describe_exit(code) == words


@pytest.mark.parametrize("stop, before, replanned, state, reason, crashes", [
    # Out of GPU memory with a lever left: queued again at once, under the new plan; no crash counted, even with
    # the budget spent before it.
    (None, 0, "blocks_to_swap 0→1", states.QUEUED, "out of GPU memory; re-planned: blocks_to_swap 0→1", 0),
    (None, 2, "samples skipped", states.QUEUED, "out of GPU memory; re-planned: samples skipped", 2),
    # No lever left: failed with the re-plan's one line, still no crash counted
    (None, 1, None, states.FAILED, "out of GPU memory ... no lever left; tried: micro-batch 2→1", 1),
    # the user's stop wins over the re-plan
    ("pause", 0, "blocks_to_swap 0→1", states.PAUSED, "paused by the user", 0),
])
def test_out_of_memory_is_a_replan_that_never_spends_the_budget(stop, before, replanned, state, reason, crashes):
    error = "out of GPU memory ... no lever left; tried: micro-batch 2→1"
    d = decide_exit(69, stop, before, CFG, error, replanned=replanned)
    assert (d.state, d.retry_in, d.reason, d.crashes) == (state, None, reason, crashes)
    states.check(states.RUNNING, d.state)
