"""What an exception that ends a trainer ends it with: one line for the person at the terminal (under the daemon it
lands in trainer.log), an event, and the exit code (engine/training/stop.py; the daemon's exit_policy.py reads them).

    JobInvalid, ConfigMismatch, a hub refusal   65: the job can never run as written, never retried
    DiskError, any disk-full OSError            74: the daemon waits for free space
    OutOfMemory, torch.OutOfMemoryError         69: the daemon re-plans memory (engine/memory_plan/oom.py says it)
    HeldForReview                               75: held after the caption stage (`captions_ready` said it)
    an OSError of the network                   raised: a crash, retried with backoff within the budget
    any other Exception                         70: an internal error, below (an unreadable model file too)

An internal error is ours or a library's, said in one line: `lorad: internal error at step N (Type: message); the
traceback is in WORKDIR/trainer.log`.

The person at a terminal (`lorad run`) gets that line, not 20 lines of Python; the traceback goes to the job's
trainer.log, where a daemon child's stderr goes anyway. The same line is the `internal_error` event, so the
daemon can tell an error that comes back at the same step with the same message (a bug, or a job that can
never pass that step) from a crash worth retrying (exit_policy.py).
"""

from __future__ import annotations

import errno
import socket
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

from engine.errors import ConfigMismatch, DiskError, HeldForReview, JobInvalid, OutOfMemory
from engine.report.events import EventLog
from engine.storage.fsio import is_disk_full
from engine.training.stop import EXIT_INTERNAL, EXIT_INVALID, EXIT_IO, EXIT_OUT_OF_MEMORY, EXIT_STOPPED

MESSAGE_CHARS = 200  # an exception's message can be a whole tensor's repr


def summary(e: BaseException) -> str:
    """`Type: first line of the message`, cut to MESSAGE_CHARS."""
    text = (str(e).strip().splitlines() or [""])[0]
    if len(text) > MESSAGE_CHARS:
        text = text[:MESSAGE_CHARS] + "…"
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def exit_code(e: Exception, log: EventLog, workdir: Path, stderr_is_log: bool,
              hub_refusal: Callable[[OSError], str | None]) -> int:
    """The trainer's exit code for `e`, said and logged; re-raises what is a crash (the table above).
    hub_refusal: why a hub error is one no retry changes (the family's model loading knows), else None."""
    if isinstance(e, (JobInvalid, ConfigMismatch)):
        return _said(log, "invalid_job", str(e), f"invalid job: {e}" if isinstance(e, JobInvalid) else str(e),
                     EXIT_INVALID)
    if isinstance(e, DiskError):
        return _said(log, "disk_error", str(e), str(e), EXIT_IO)
    if isinstance(e, HeldForReview):
        print(f"lorad: {e}: edit them, then resume the job (lorad resume ID; in the foreground, run it again "
              f"with data.captioner.hold_for_review: false)", file=sys.stderr, flush=True)
        return EXIT_STOPPED
    if isinstance(e, OutOfMemory) or _torch_out_of_memory(e):
        from engine.memory_plan.oom import said  # torch is there: it raised

        print(f"lorad: {said(e, log)}", file=sys.stderr, flush=True)
        return EXIT_OUT_OF_MEMORY
    if isinstance(e, OSError):
        if is_disk_full(e):  # outside the checkpoint writer: the latent cache, sample images, the export
            msg = f"disk full ({e.filename or workdir}); committed checkpoints are intact — free space and run again"
            return _said(log, "disk_error", msg, msg, EXIT_IO)
        if (why := hub_refusal(e)) is not None:
            return _said(log, "invalid_job", why, f"invalid job: {why}", EXIT_INVALID)
        if of_the_network(e):
            # A crash the daemon retries within its budget, never the repeat rule of an internal error: an outage
            # repeats its message for as long as it lasts.
            raise e
    return internal_error(e, log, workdir, stderr_is_log)


def _torch_out_of_memory(e: BaseException) -> bool:
    torch = sys.modules.get("torch")  # not imported here: a client without the training stack reads this table
    return torch is not None and isinstance(e, torch.OutOfMemoryError)


NETWORK_ERRNOS = {errno.ECONNREFUSED, errno.ECONNRESET, errno.ECONNABORTED, errno.ETIMEDOUT, errno.ENETUNREACH,
                  errno.ENETDOWN, errno.EHOSTUNREACH, errno.EHOSTDOWN}


def of_the_network(e: BaseException) -> bool:
    """An error caused, anywhere down its chain, by the network: a refused or reset connection, a timeout, a name
    that does not resolve, or a hub client's connection error (requests', httpx's, urllib3's)."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, (ConnectionError, TimeoutError, socket.gaierror)) or \
                (isinstance(e, OSError) and e.errno in NETWORK_ERRNOS):
            return True
        if any(word in type(e).__name__ for word in ("Connect", "Timeout", "NameResolution")):
            return True
        e = e.__cause__ or e.__context__
    return False


def _said(log: EventLog, event: str, message: str, line: str, code: int) -> int:
    log.error(event, message=message)
    print(f"lorad: {line}", file=sys.stderr, flush=True)
    return code


def internal_error(e: BaseException, log: EventLog, workdir: Path, stderr_is_log: bool) -> int:
    """Write the traceback where it belongs, log the event, say the one line on stderr; the exit code (70).

    stderr_is_log: a daemon child, whose stderr the daemon appends to trainer.log already."""
    trace = "".join(traceback.format_exception(e))
    where, step = Path(workdir) / "trainer.log", log.step + 1
    told = f"the traceback is in {where}"
    if stderr_is_log:
        print(trace, end="", file=sys.stderr, flush=True)
    else:
        try:
            with open(where, "a", encoding="utf-8") as f:
                f.write(trace)
        except OSError as err:  # the line still says what happened; the traceback is lost, and says so
            told = f"the traceback could not be written to {where} ({err.strerror or err})"
    line = f"lorad: internal error at step {step} ({summary(e)}); {told}"
    log.error("internal_error", step=step, message=line)
    print(line, file=sys.stderr, flush=True)
    return EXIT_INTERNAL
