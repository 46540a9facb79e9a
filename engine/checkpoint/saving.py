"""The loop's one way to commit checkpoints: after each step, a save when the cadence asks; and a commit now.

A save is taken at a step boundary and written in the background (at most one in flight); `commit_now` waits
for the one in flight and commits the current step synchronously, before samples render (a render that is
killed never costs the step) and at the end or at a stop. Both go through the same cadence, so it always knows
when the last save started and which step is committed.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Protocol

from engine.checkpoint.cadence import SLOW_SAVE, Save, SaveCadence
from engine.checkpoint.store import CheckpointStore, Snapshot
from engine.checkpoint.writer import SaveResult
from engine.errors import DiskError
from engine.report.tensorboard import TrainingBoard
from engine.storage.fsio import is_disk_full


class Saver(Protocol):
    """What the loop needs of a checkpoint writer: AsyncCheckpointer, or fsdp's ShardedCheckpointer."""

    store: CheckpointStore
    collective: bool  # every rank writes its part of each save
    in_flight_step: int | None
    started: float

    def submit(self, snap: Snapshot, background: bool = False) -> None: ...
    def poll(self) -> list[SaveResult]: ...
    def wait(self) -> list[SaveResult]: ...
    def busy(self) -> bool: ...
    def agreed(self, due: Save | None) -> Save | None: ...  # collective savers only: rank 0's decision, on every rank


def save_if_due(step: int, urgent: bool, saver: Saver, cadence: SaveCadence, checkpoint: Callable[[], Snapshot],
                log, board: TrainingBoard | None = None) -> None:
    """After each step: note the saves that landed, start the one the cadence asks for, report a slow one.

    urgent: a "checkpoint now" arrived (SIGUSR1, the UPS is on battery).
    """
    record_saves(saver.poll(), cadence, saver.store, log, board)
    if urgent and step > cadence.saved_step:  # a step committed for its samples needs no second save
        cadence.urgent()
    now = time.monotonic()
    due = cadence.due(step, now, writing=saver.busy())
    if saver.collective:  # a sharded save: every rank writes, at the step rank 0's cadence picks
        due = saver.agreed(due)
    if due is Save.URGENT:  # the save in flight lands first: one save at a time
        record_saves(saver.wait(), cadence, saver.store, log, board)
        log.info("phase", phase="urgent_checkpoint", step=step)
    if due is not None:
        saver.submit(checkpoint(), background=due is Save.PERIODIC)
        cadence.started(time.monotonic())
    elif (late := cadence.slow(saver.in_flight_step if saver.busy() else None, saver.started, now)) is not None:
        log.warning("checkpoint_slow", step=saver.in_flight_step, seconds=round(late, 1), message=SLOW_SAVE)


def commit_now(step: int, saver: Saver, cadence: SaveCadence, checkpoint: Callable[[], Snapshot], log,
               board: TrainingBoard | None = None, phase: str | None = None) -> None:
    """Let the save in flight land, then commit `step` synchronously unless it is committed already.

    phase: said in the event log before the save starts (the final checkpoint is a phase of its own).
    """
    record_saves(saver.wait(), cadence, saver.store, log, board)
    if step <= cadence.saved_step:
        return
    if phase is not None:
        log.info("phase", phase=phase, step=step)
    saver.submit(checkpoint())
    cadence.started(time.monotonic())
    record_saves(saver.wait(), cadence, saver.store, log, board)


def record_saves(results: list[SaveResult], cadence: SaveCadence, store: CheckpointStore, log,
                 board: TrainingBoard | None = None) -> None:
    """Tell the cadence, the log and TensorBoard about saves that landed; a failed save ends the run (DiskError).

    TensorBoard is flushed at each commit, so what a kill can lose of it is past the checkpoint anyway."""
    for r in results:
        if r.error is not None:
            _raise_save_error(r, store)
        cadence.saved(r.step, r.seconds)
        log.info("checkpoint_committed", step=r.step, path=str(r.path), seconds=round(r.seconds, 4))
        if board is not None:
            board.flush()


def _raise_save_error(r: SaveResult, store: CheckpointStore) -> None:
    e = r.error
    if isinstance(e, OSError):
        prev = [p.name for _, p in store.steps()]
        kept = f"the previous checkpoint {prev[0]} is intact" if prev else "no earlier checkpoint exists"
        free = ""
        try:
            st = os.statvfs(store.root)
            free = f" ({st.f_bavail * st.f_frsize // (1 << 20)} MiB free)"
        except OSError:
            pass
        what = "disk full" if is_disk_full(e) else f"cannot write ({e.strerror or e})"
        raise DiskError(f"{what} while saving checkpoint step-{r.step:08d} in {store.root}{free}; {kept}") from None
    raise e
