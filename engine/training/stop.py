"""Signals → a stop request the training loop checks after each optimizer step.

SIGTERM or SIGINT: finish the current step, commit a checkpoint, exit 75.
A second SIGINT: exit at once; the last committed checkpoint still stands.
SIGUSR1: commit a checkpoint after the current step and keep training
(the daemon sends it when the UPS goes on battery).
"""

from __future__ import annotations

import os
import signal
import threading
import time

EXIT_OK = 0
EXIT_OUT_OF_MEMORY = 69  # EX_UNAVAILABLE: the GPU ran out of memory; the daemon re-plans memory and resumes
EXIT_INVALID = 65  # EX_DATAERR: the job can never run as written; not retried
EXIT_INTERNAL = 70  # EX_SOFTWARE: an error inside lorad or a library; one line on stderr, the traceback in trainer.log
EXIT_IO = 74  # EX_IOERR: disk full or unwritable; retried by the daemon after backoff
EXIT_STOPPED = 75  # EX_TEMPFAIL: stopped cleanly after a final checkpoint; resumable
EXIT_INTERRUPTED_HARD = 130
SOFT_STOP_MESSAGE = "\nlorad: stopping after this step with a checkpoint (Ctrl-C again to stop at once)\n"
HARD_STOP_MESSAGE = ("\nlorad: interrupted twice: stopped at once, without a final checkpoint; the last committed "
                     "one is kept, and running again resumes from it\n")


class StopFlag:
    def __init__(self) -> None:
        self._event = threading.Event()
        self.reason: str | None = None
        self._sigints = 0
        self._save_now = threading.Event()

    def request(self, reason: str) -> None:
        if self.reason is None:
            self.reason = reason
        self._event.set()

    @property
    def requested(self) -> bool:
        return self._event.is_set()

    def request_save(self) -> None:
        self._save_now.set()

    def take_save_request(self) -> bool:
        """True once per SIGUSR1 (or request_save call)."""
        if self._save_now.is_set():
            self._save_now.clear()
            return True
        return False

    def install(self) -> None:
        signal.signal(signal.SIGTERM, self._on_term)
        signal.signal(signal.SIGINT, self._on_int)
        signal.signal(signal.SIGUSR1, lambda signum, frame: self.request_save())
        # The daemon starts trainers with SIGUSR1 blocked: a "checkpoint now" sent while this process was still
        # importing torch waits, pending, instead of killing it (the default action). It is delivered here.
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGUSR1})

    def _on_term(self, signum, frame) -> None:
        self.request("SIGTERM")

    def _on_int(self, signum, frame) -> None:
        self._sigints += 1
        if self._sigints >= 2:
            # os.write, not print: a signal handler may run while sys.stderr is mid-write.
            os.write(2, HARD_STOP_MESSAGE.encode())
            os._exit(EXIT_INTERRUPTED_HARD)
        os.write(2, SOFT_STOP_MESSAGE.encode())
        self.request("SIGINT")


def debug_pause() -> None:
    """Sleep $LORAD_DEBUG_STEP_DELAY_S after each optimizer step (tests only; unset in real runs): a tiny job
    trains a step in milliseconds, and a test that kills it a few steps after an event must get there first."""
    delay = float(os.environ.get("LORAD_DEBUG_STEP_DELAY_S", "0") or 0)
    if delay > 0:
        time.sleep(delay)
