"""An error inside lorad or a library, said in one line: `lorad: internal error at step N (Type: message); the
traceback is in WORKDIR/trainer.log`, exit 70.

The person at a terminal (`lorad run`) gets that line, not 20 lines of Python; the traceback goes to the job's
trainer.log, where a daemon child's stderr goes anyway. The same line is the `internal_error` event, so the
daemon can tell an error that comes back at the same step with the same message (a bug, or a job that can
never pass that step) from a crash worth retrying (exit_policy.py).
"""

from __future__ import annotations

import sys
import traceback
from pathlib import Path

from engine.report.events import EventLog

MESSAGE_CHARS = 200  # an exception's message can be a whole tensor's repr


def summary(e: BaseException) -> str:
    """`Type: first line of the message`, cut to MESSAGE_CHARS."""
    text = (str(e).strip().splitlines() or [""])[0]
    if len(text) > MESSAGE_CHARS:
        text = text[:MESSAGE_CHARS] + "…"
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def report(e: BaseException, log: EventLog, workdir: Path, stderr_is_log: bool) -> str:
    """Write the traceback where it belongs, log the event and return the one line for the terminal.

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
    return line
