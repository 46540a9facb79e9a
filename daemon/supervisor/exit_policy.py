"""Where a job goes when its trainer exits: a pure function of the exit code, why it was stopped, how many
times in a row it crashed before, and whether this attempt committed a new checkpoint. No processes, no store,
no clock: the supervisor and start-up recovery both ask it, and tests walk it as a table
(tests/daemon/supervisor/test_exit_policy.py).

    exit 0                               succeeded (whatever was asked meanwhile: it is done)
    stopped for cancel / pause           cancelled / paused
    stopped for shutdown, drain, policy,
      preemption, or cut off by an
      outage (reboot, UPS shutdown)      interrupted (resumed from its last checkpoint at once, nothing counted)
    stopped (or died) because its GPU
      was quarantined ("gpu: ...")      waiting_for_gpu (queued again once a healthy GPU is there, never counted)
    it said `captions_ready` (any exit   paused, held for its captions' review (data.captioner.hold_for_review):
      but 0, nothing asked)              `lorad resume` releases it (HELD_FOR_REVIEW is its reason and stage)
    exit 65                              failed: the job is invalid, never retried
    exit 69 (out of GPU memory)          queued again at once under a smaller memory plan (oom_replan.py), never
                                         counted; failed with one line naming what was tried when no lever is left
    exit 74 with a full disk             waiting for free space (retried when it returns, never counted)
    exit 75 nobody here asked for        interrupted (an operator's or the system's SIGTERM)
    exit 70, the same line a third time  failed: an internal error at the same step with the same message,
      in a row                           twice retried already, will not pass by itself (lorad retry)
    anything else                        a crash: queued again after an exponential backoff, until
                                         crash retry_budget + 1 in a row fails the job

Crashes in a row: an attempt that committed a new checkpoint made progress, so the count starts again with
its own crash (the budget is refunded); only a job that keeps failing without new checkpoints ends `failed`.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass
from typing import TYPE_CHECKING

from daemon.store import states
from engine.training.stop import (
    EXIT_INTERNAL,
    EXIT_INVALID,
    EXIT_IO,
    EXIT_OK,
    EXIT_OUT_OF_MEMORY,
    EXIT_STOPPED,
)

if TYPE_CHECKING:
    from daemon.config.daemon import DaemonConfig

RESUMABLE_STOPS = ("shutdown", "drain", "outage")
RESUMABLE_PREFIXES = ("policy", "preempt")  # "policy: ..." (power windows, the UPS), "preempt: yields to ..."
INTERNAL_REPEATS = 2  # an internal error seen this many times before, in a row, is not retried again
HELD_FOR_REVIEW = "captions ready for review"  # the reason, and the job's stage while it is held
GPU_FAULT_PREFIX = "gpu:"  # "gpu: GPU 1 quarantined (Xid 79)": set by daemon/supervisor/gpu_path.py


@dataclass(frozen=True)
class ExitDecision:
    state: str
    reason: str
    retry_in: float | None = None  # for RUNNING → QUEUED: the backoff
    crashes: int = 0  # crashes in a row after this exit (the job's `retries` column)


def disk_full(code: int | None, last_error: str | None) -> bool:
    """Exit 74 (EX_IOERR) saying the disk is full: the engine's disk_error messages all start with "disk full"."""
    return code == EXIT_IO and "disk full" in (last_error or "")


def same_error_in_a_row(error: str | None, previous: list[str | None]) -> int:
    """How many of the attempts just before this one (newest first) ended with this very error. An internal
    error's line names its step and message, so equal lines are the same error at the same step."""
    n = 0
    for before in previous:
        if error is None or before != error:
            break
        n += 1
    return n


def decide_exit(code: int | None, stop_reason: str | None, crashes_before: int, cfg: DaemonConfig,
                last_error: str | None, progressed: bool = False, repeats: int = 0,
                replanned: str | None = None, held: bool = False) -> ExitDecision:
    """Where a job goes when its trainer exits. `crashes_before`: crashes in a row before this attempt;
    `progressed`: this attempt committed a new checkpoint; `repeats`: the attempts just before that ended with
    this same error (same_error_in_a_row); `replanned`: after an out-of-memory (exit 69), the lever the re-plan
    pulled (None: none was left, and `last_error` says what was tried); `held`: the trainer said `captions_ready`."""
    before = 0 if progressed else crashes_before
    if code == EXIT_OK:
        return ExitDecision(states.SUCCEEDED, "finished", crashes=0)
    if stop_reason == "cancel":
        return ExitDecision(states.CANCELLED, "cancelled by the user", crashes=before)
    if stop_reason == "pause":
        return ExitDecision(states.PAUSED, "paused by the user", crashes=before)
    if (stop_reason or "").startswith(GPU_FAULT_PREFIX):
        # The GPU failed, not the job (daemon/gpu_health/): whatever the exit, no crash is counted.
        return ExitDecision(states.WAITING_FOR_GPU, stop_reason, crashes=before)
    if stop_reason in RESUMABLE_STOPS or (stop_reason or "").startswith(RESUMABLE_PREFIXES):
        return ExitDecision(states.INTERRUPTED, stop_reason or "stopped", crashes=before)
    if held:  # whatever ended it after it said so (its own exit 75, or a kill): nothing of training is lost
        return ExitDecision(states.PAUSED, HELD_FOR_REVIEW, crashes=before)
    if code == EXIT_INVALID:
        return ExitDecision(states.FAILED, f"invalid job: {last_error or 'exit 65'}", crashes=before)
    if code == EXIT_OUT_OF_MEMORY:
        if replanned is not None:
            return ExitDecision(states.QUEUED, f"out of GPU memory; re-planned: {replanned}", crashes=before)
        return ExitDecision(states.FAILED, last_error or "out of GPU memory; no lever left", crashes=before)
    if disk_full(code, last_error):
        return ExitDecision(states.WAITING, f"disk full; waits for free space ({last_error})", crashes=before)
    if code == EXIT_STOPPED and stop_reason is None:
        # Someone else sent the trainer SIGTERM (an operator, a system shutdown): resumable, not a crash.
        return ExitDecision(states.INTERRUPTED, "the trainer was stopped from outside the daemon", crashes=before)
    crashes = before + 1
    # Only repeats since the last progress or `lorad retry` (both start the crash count again) count.
    if code == EXIT_INTERNAL and min(repeats, before) >= INTERNAL_REPEATS:
        line = (last_error or "").removeprefix(f"{describe_exit(code)}: ").removeprefix("lorad: ")
        return ExitDecision(states.FAILED, f"{line} — the same error {repeats + 1} times in a row, not retried "
                                           f"again (lorad retry starts it again)", crashes=crashes)
    if crashes > cfg.retry_budget:
        return ExitDecision(states.FAILED, f"retry budget spent ({cfg.retry_budget}); last error: {last_error}",
                            crashes=crashes)
    backoff = min(cfg.backoff_max_s, cfg.backoff_base_s * (2 ** (crashes - 1)))
    return ExitDecision(states.QUEUED, f"crashed ({last_error}); retry {crashes}/{cfg.retry_budget}",
                        retry_in=backoff, crashes=crashes)


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
