"""Signals → a stop request the training loop checks after each optimizer step.

SIGTERM or SIGINT: finish the current step, commit a checkpoint, exit 75.
A second SIGINT: exit at once; the last committed checkpoint still stands.
"""

from __future__ import annotations

import os
import signal
import threading

EXIT_OK = 0
EXIT_INVALID = 65  # EX_DATAERR: the job can never run as written; not retried
EXIT_IO = 74  # EX_IOERR: disk full or unwritable; retried by the daemon after backoff
EXIT_STOPPED = 75  # EX_TEMPFAIL: stopped cleanly after a final checkpoint; resumable
EXIT_INTERRUPTED_HARD = 130


class StopFlag:
    def __init__(self) -> None:
        self._event = threading.Event()
        self.reason: str | None = None
        self._sigints = 0

    def request(self, reason: str) -> None:
        if self.reason is None:
            self.reason = reason
        self._event.set()

    @property
    def requested(self) -> bool:
        return self._event.is_set()

    def install(self) -> None:
        signal.signal(signal.SIGTERM, self._on_term)
        signal.signal(signal.SIGINT, self._on_int)

    def _on_term(self, signum, frame) -> None:
        self.request("SIGTERM")

    def _on_int(self, signum, frame) -> None:
        self._sigints += 1
        if self._sigints >= 2:
            os._exit(EXIT_INTERRUPTED_HARD)
        self.request("SIGINT")
