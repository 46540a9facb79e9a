"""The background writer: a snapshot is committed on a thread of its own while training goes on; one at a time.

Periodic saves run that thread at a low CPU priority, so that on a machine whose cores all train it takes
its slices from no training thread; a save the loop waits on (a stop, the final one) does not.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from engine.checkpoint.store import CheckpointStore, Snapshot


@dataclass
class SaveResult:
    step: int
    path: Path | None
    seconds: float
    error: BaseException | None = None


def writer_nice() -> int:
    """Niceness of the periodic-save writer thread ($LORAD_CKPT_WRITER_NICE, default 19; 0 = same as training)."""
    try:
        return max(0, min(19, int(os.environ.get("LORAD_CKPT_WRITER_NICE", "19"))))
    except ValueError:
        return 19


def _lower_thread_priority() -> None:
    # When training keeps every core busy (CPU training: torch's intra-op threads), a writer at the
    # same priority takes its slices from them and a delayed intra-op thread stalls the whole step
    # (measured on 2 cores with a save every step: +14% step time at nice 0 or 10, +5% at nice 19;
    # with one torch thread, leaving a core free, +2%). At nice 19 the writer still gets a small
    # share (CFS weight 15 vs 1024), so saves keep landing, just less often when CPU is scarce;
    # SCHED_IDLE starved it completely. Only periodic saves: a stop or final save is waited on, and
    # an unprivileged thread cannot raise its priority back. Linux applies setpriority to one thread
    # given its TID.
    nice = writer_nice()
    if nice and hasattr(os, "setpriority") and hasattr(threading, "get_native_id"):
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
        except OSError:
            pass


@dataclass
class AsyncCheckpointer:
    """Writes snapshots on a background thread so training does not wait for the disk; one save at a time."""

    store: CheckpointStore
    _thread: threading.Thread | None = None
    _done: list[SaveResult] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    in_flight_step: int | None = None
    started: float = 0.0  # time.monotonic() when the save in flight was submitted
    collective: ClassVar[bool] = False  # rank 0 alone saves (engine/distributed/fsdp.py's saver: every rank)

    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def submit(self, snap: Snapshot, background: bool = False) -> None:
        """Start writing `snap`. background=True (periodic saves) runs the writer at a lower CPU priority."""
        if self.busy():
            raise RuntimeError("a checkpoint save is already in flight")
        self.in_flight_step = snap.step
        self.started = time.monotonic()
        self._thread = threading.Thread(target=self._write, args=(snap, background), name=f"ckpt-{snap.step}", daemon=True)
        self._thread.start()

    def _write(self, snap: Snapshot, background: bool = False) -> None:
        if background:
            _lower_thread_priority()
        t0 = time.monotonic()
        try:
            path = self.store.commit(snap)
            res = SaveResult(snap.step, path, time.monotonic() - t0)
        except BaseException as e:  # reported to the training loop through poll()
            res = SaveResult(snap.step, None, time.monotonic() - t0, e)
        with self._lock:
            self._done.append(res)

    def poll(self) -> list[SaveResult]:
        with self._lock:
            out, self._done = self._done, []
        return out

    def wait(self) -> list[SaveResult]:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.in_flight_step = None
        return self.poll()
