"""Where a job goes when its trainer exits: a pure function of the exit code, why it was stopped and how
many times in a row it crashed. No processes, no store, no clock: the supervisor and start-up recovery
both ask it, and tests walk it as a table (tests/test_exit_policy.py).

    exit 0                               succeeded (whatever was asked meanwhile: it is done)
    stopped for cancel / pause           cancelled / paused
    stopped for shutdown, drain, policy  interrupted (resumed from its last checkpoint)
    exit 65                              failed: the job is invalid, never retried
    exit 75 nobody here asked for        interrupted (an operator's or the system's SIGTERM)
    anything else                        a crash: queued again after an exponential backoff, until
                                         crash retry_budget + 1 in a row fails the job
"""

from __future__ import annotations

import signal
from dataclasses import dataclass
from typing import TYPE_CHECKING

from daemon import states
from engine.stop import EXIT_INVALID, EXIT_OK, EXIT_STOPPED

if TYPE_CHECKING:
    from daemon.daemon_config import DaemonConfig


@dataclass(frozen=True)
class ExitDecision:
    state: str
    reason: str
    retry_in: float | None = None  # for RUNNING → QUEUED: the backoff


def decide_exit(code: int | None, stop_reason: str | None, retries: int, cfg: DaemonConfig,
                last_error: str | None) -> ExitDecision:
    """Where a job goes when its trainer exits. `retries` counts crashes in a row, this one included."""
    if code == EXIT_OK:
        return ExitDecision(states.SUCCEEDED, "finished")
    if stop_reason == "cancel":
        return ExitDecision(states.CANCELLED, "cancelled by the user")
    if stop_reason == "pause":
        return ExitDecision(states.PAUSED, "paused by the user")
    if stop_reason in ("shutdown", "drain") or (stop_reason or "").startswith("policy"):
        return ExitDecision(states.INTERRUPTED, stop_reason or "stopped")
    if code == EXIT_INVALID:
        return ExitDecision(states.FAILED, f"invalid job: {last_error or 'exit 65'}")
    if code == EXIT_STOPPED and stop_reason is None:
        # Someone else sent the trainer SIGTERM (an operator, a system shutdown): resumable, not a crash.
        return ExitDecision(states.INTERRUPTED, "the trainer was stopped from outside the daemon")
    if retries > cfg.retry_budget:
        return ExitDecision(states.FAILED, f"retry budget spent ({cfg.retry_budget}); last error: {last_error}")
    backoff = min(cfg.backoff_max_s, cfg.backoff_base_s * (2 ** (retries - 1)))
    return ExitDecision(states.QUEUED, f"crashed ({last_error}); retry {retries}/{cfg.retry_budget}", retry_in=backoff)


def describe_exit(code: int | None) -> str:
    """An exit status in words: `exit code 1`, `killed by SIGKILL`, `unknown exit` (the trainer was not ours)."""
    if code is None:
        return "unknown exit"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"
