"""When the training loop starts a checkpoint save: the policy alone, driven by the step and a clock.

Periodic saves fire on `checkpoint.every_steps` (steps since the last
committed save) or `checkpoint.every_seconds`, whichever comes first. A crash
loses the work since the last *snapshot that committed*, so with saves that
take W seconds to write, a save started every E seconds would put E + W
seconds at risk: each timed save therefore starts as much earlier as the last
one took to write. A save still writing after every_seconds is reported once
(`checkpoint_slow`): more than that is at risk until it lands.

An urgent save (SIGUSR1: the UPS went on battery) is taken at the next step
boundary, after waiting for a save in flight. None is started at the last
step: the final save covers it.

No I/O and no clock of its own: the loop passes `now` (time.monotonic()), the
tests a fake one.
"""

from __future__ import annotations

import enum

from engine.report.once import Once

SLOW_SAVE = ("a checkpoint save is taking longer than checkpoint.every_seconds, so more work than that is at risk "
             "until it lands (a slow disk, or every core busy training: see LORAD_CKPT_WRITER_NICE)")


class Save(enum.Enum):
    PERIODIC = "periodic"  # start it in the background, if no save is in flight
    URGENT = "urgent"  # wait for the save in flight, then save this step


class SaveCadence:
    def __init__(self, every_steps: int | None, every_seconds: float | None, last_step: int, saved_step: int,
                 now: float):
        """last_step: the run's final step (train.steps); saved_step: the step training starts from."""
        self.every_steps = every_steps
        self.every_seconds = every_seconds
        self.last_step = last_step
        self.saved_step = saved_step  # newest committed checkpoint (or the start)
        self._started = now  # when the last save was started (or training began)
        self._write_seconds = 0.0  # how long the last save took to commit
        self._urgent = False
        self._slow = Once()

    def urgent(self) -> None:
        """A "checkpoint now" request (SIGUSR1); taken by the next due()."""
        self._urgent = True

    def due(self, step: int, now: float, writing: bool) -> Save | None:
        """The save to start after `step` completed, if any; `writing`: a save is still in flight."""
        urgent, self._urgent = self._urgent, False
        if step >= self.last_step:
            return None
        if urgent:
            return Save.URGENT
        if writing:
            return None
        by_steps = self.every_steps is not None and step - self.saved_step >= self.every_steps
        by_time = self.every_seconds is not None and now - self._started + self._write_seconds >= self.every_seconds
        return Save.PERIODIC if by_steps or by_time else None

    def started(self, now: float) -> None:
        """A save was submitted at `now`."""
        self._started = now

    def saved(self, step: int, seconds: float) -> None:
        """The save of `step` committed after `seconds` of writing."""
        self.saved_step = max(self.saved_step, step)
        self._write_seconds = seconds

    def slow(self, writing_step: int | None, started: float, now: float) -> float | None:
        """Seconds the save of `writing_step` (None: none in flight) has run, once it passes every_seconds; once per save."""
        if writing_step is None or self.every_seconds is None or now - started <= self.every_seconds:
            return None
        return now - started if self._slow.first(writing_step) else None
