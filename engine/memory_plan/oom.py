"""An out-of-memory in words, and the test hook that raises a real one.

`torch.OutOfMemoryError` (torch.cuda.OutOfMemoryError) says what it tried to allocate: "CUDA out of memory. Tried
to allocate 2.00 GiB. GPU 0 has a total capacity of ...". needed_bytes reads that figure back, for the
`out_of_memory` event and the one-line failure when no lever is left.

$LORAD_DEBUG_OOM_AT_STEP=k (tests only; unset in real runs) raises the real torch.OutOfMemoryError inside optimizer
step k, after its first micro-batch's backward (gradients half accumulated: nothing of it may be committed), in
every attempt whose re-plan level (AttemptMemory.level(), the levers pulled so far) is below
$LORAD_DEBUG_OOM_UNTIL_LEVEL (default 1): a job that fits once one lever is pulled, or, with a large level, one
that never fits.

$LORAD_DEBUG_OOM_FILE=PATH (tests only): an out-of-memory at a moment another process picks, whatever the level.
Whichever trainer's optimizer step first finds PATH removes it and raises the same error there, once (the soak's
out_of_memory fault, bench/soak_faults.py, writes it while one trainer trains).

An out-of-memory while the frozen base is put on the device: engine/frozen_base/placing.py.
"""

from __future__ import annotations

import os
import re

import torch

OOM_AT_STEP_ENV = "LORAD_DEBUG_OOM_AT_STEP"
OOM_UNTIL_LEVEL_ENV = "LORAD_DEBUG_OOM_UNTIL_LEVEL"
OOM_FILE_ENV = "LORAD_DEBUG_OOM_FILE"
_UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}
_TRIED = re.compile(r"Tried to allocate ([0-9.]+) ?(B|KiB|MiB|GiB|TiB)")


def needed_bytes(error: BaseException) -> int | None:
    """The allocation that failed, from the error's message; None when it does not say."""
    m = _TRIED.search(str(error))
    return None if m is None else int(float(m.group(1)) * _UNITS[m.group(2)])


def first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or ["out of memory"])[0][:300]


def debug_oom(step: int, level: int) -> None:
    """Raise torch.OutOfMemoryError in optimizer step `step` as the test hook asks (module docstring)."""
    if trigger := os.environ.get(OOM_FILE_ENV, ""):
        try:
            os.unlink(trigger)  # claimed: one step raises for one trigger
        except FileNotFoundError:
            pass
        else:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate 2.00 GiB. (raised by {OOM_FILE_ENV} "
                                         f"at step {step}, re-plan level {level})")
    at = os.environ.get(OOM_AT_STEP_ENV, "").strip()
    if not at or int(at) != step or level >= int(os.environ.get(OOM_UNTIL_LEVEL_ENV, "1") or 1):
        return
    raise torch.OutOfMemoryError(
        f"CUDA out of memory. Tried to allocate 2.00 GiB. (raised by {OOM_AT_STEP_ENV}={at} at re-plan level {level})")


def said(e: BaseException, log) -> str:
    """The `out_of_memory` event for `e` (an engine.errors.OutOfMemory, or a torch.OutOfMemoryError raised outside
    the loop's phases), with the plan it ran under for the daemon's re-plan; returns its message.

    Nothing of the phase it happened in was committed: a step's half-accumulated gradients, a validation pass or a
    sample render are dropped, and the last checkpoint stands (a sample render's step was committed before it)."""
    phase, step, plan = getattr(e, "phase", ""), getattr(e, "step", 0), getattr(e, "plan", None)
    needed = getattr(e, "needed", None) if hasattr(e, "plan") else needed_bytes(e)
    where = f"{phase} at step {step}" if phase else "outside the training loop"
    more = f", needed {needed / 2**30:.2f} GiB more" if needed else ""
    message = f"out of GPU memory in {where}{more} ({first_line(e)})"
    log.error("out_of_memory", phase=phase or "other", step=step, needed_bytes=needed, plan=plan, message=message)
    return message
