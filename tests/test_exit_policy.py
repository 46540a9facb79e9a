"""The exit policy as a table: (exit code, stop reason, crashes in a row) → (state, backoff, reason)."""

from __future__ import annotations

import signal

import pytest

from daemon import states
from daemon.daemon_config import DaemonConfig
from daemon.exit_policy import decide_exit, describe_exit

CFG = DaemonConfig(retry_budget=2, backoff_base_s=10, backoff_max_s=25)


@pytest.mark.parametrize("code, stop, retries, state, backoff, reason", [
    (0, None, 0, states.SUCCEEDED, None, "finished"),
    (0, "cancel", 0, states.SUCCEEDED, None, "finished"),  # finished before the stop took effect: it is done
    (0, "shutdown", 0, states.SUCCEEDED, None, "finished"),
    (65, None, 0, states.FAILED, None, "invalid job: boom"),  # invalid job: never retried
    (65, None, 9, states.FAILED, None, "invalid job: boom"),  # ... whatever the crash count
    (75, "pause", 0, states.PAUSED, None, "paused by the user"),
    (-9, "pause", 0, states.PAUSED, None, "paused by the user"),  # killed after the grace: still what was asked
    (75, "cancel", 0, states.CANCELLED, None, "cancelled by the user"),
    (1, "cancel", 5, states.CANCELLED, None, "cancelled by the user"),  # a crash while cancelling: cancelled
    (75, "shutdown", 0, states.INTERRUPTED, None, "shutdown"),
    (-9, "shutdown", 0, states.INTERRUPTED, None, "shutdown"),  # killed at the shutdown deadline: resumable
    (75, "drain", 0, states.INTERRUPTED, None, "drain"),
    (75, "policy: outside run window", 0, states.INTERRUPTED, None, "policy: outside run window"),
    (75, None, 0, states.INTERRUPTED, None, "the trainer was stopped from outside the daemon"),
    (1, None, 1, states.QUEUED, 10, "crashed (boom); retry 1/2"),
    (-11, None, 2, states.QUEUED, 20, "crashed (boom); retry 2/2"),  # exponential
    (74, None, 2, states.QUEUED, 20, "crashed (boom); retry 2/2"),  # disk full: retried with backoff
    (None, None, 1, states.QUEUED, 10, "crashed (boom); retry 1/2"),  # exit unknown (cut off by an outage)
    (1, None, 3, states.FAILED, None, "retry budget spent (2); last error: boom"),  # budget of 2 retries spent
])
def test_exit_code_and_stop_reason_decide_the_next_state(code, stop, retries, state, backoff, reason):
    d = decide_exit(code, stop, retries, CFG, "boom")
    assert (d.state, d.retry_in, d.reason) == (state, backoff, reason)
    states.check(states.RUNNING, d.state)  # every outcome is an edge of the table


def test_backoff_is_capped():
    assert decide_exit(1, None, 2, DaemonConfig(retry_budget=50, backoff_base_s=10, backoff_max_s=15), "x").retry_in == 15


def test_retry_budget_is_how_many_times_a_crashed_job_is_retried():
    """retry_budget: N → crashes 1..N are retried (with backoff), crash N+1 in a row fails the job."""
    cfg = DaemonConfig(retry_budget=3)
    outcomes = [decide_exit(1, None, n, cfg, "boom").state for n in range(1, 5)]
    assert outcomes == [states.QUEUED] * 3 + [states.FAILED]
    assert decide_exit(1, None, 1, DaemonConfig(retry_budget=0), "boom").state == states.FAILED  # 0: never retried


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
