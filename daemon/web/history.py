"""A job's history from its events.jsonl, in memory that does not grow with the job.

The file is read by descriptor (`open_events`: no symlink followed, a FIFO cannot stall the reader, only a
regular file is read) in chunks of READ_CHUNK bytes from where the last read stopped, so a read never holds more
than a chunk and one line. Each step series (loss, learning rate, s/step, the step's time, validation loss) is
kept downsampled (daemon/web/downsample.py: at most CAPACITY buckets, exact while a job is short); only the
newest checkpoints and sample steps a page shows are kept. `History` is a copy for one page, taken under the
series' lock, so a page never reads a series another thread is adding to.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from daemon.system import safe_files
from daemon.web.downsample import Downsampled
from engine.report.events import decode_lines

READ_CHUNK = 1 << 18  # bytes decoded at a time: what one decode holds is ~10× this for short lines
MAX_LINE = 1 << 20  # a longer line is skipped (the engine's are a few hundred bytes)
MAX_STEP = 10**12  # beyond any real job (train.steps is capped far below): a larger step is not drawn
MAX_VALUE = 10**300  # an int value beyond a float's range is not drawn
CAPACITY = 500  # buckets per series: ≤ 1000 points, the chart's MAX_POINTS
CHECKPOINTS_KEPT = 20  # the job page lists the newest 20
SAMPLES_KEPT = 8  # the sample grid shows the newest 8 steps


def _ts(v: Any) -> float | None:
    """An event's `ts` (ISO 8601 from structlog) as epoch seconds."""
    if type(v) is str:
        try:
            return datetime.fromisoformat(v).timestamp()  # Python ≥ 3.11 reads a trailing Z itself
        except ValueError:
            return None
    return _number(v)


def _number(v: Any) -> float | None:
    """v as a finite float, or None (a string loss, a bool, NaN: nothing a chart can place). Type checks by `type`:
    this runs for every field of every step line."""
    if type(v) is float:
        return v if v - v == 0.0 else None  # inf - inf and NaN - NaN are NaN
    if type(v) is int and -MAX_VALUE <= v <= MAX_VALUE:
        return float(v)
    return None


def open_events(workdir: Path) -> int | None:
    """A read-only descriptor on workdir/events.jsonl, or None. The trainer's user owns the workdir and could plant
    a link or a FIFO there: neither the folder nor the file is followed as a symlink, the open cannot block, and
    anything but a regular file is refused (daemon/system/safe_files.py)."""
    try:
        with safe_files.opened_dir(workdir) as d:
            return safe_files.open_at(d, "events.jsonl")
    except OSError:
        return None


@dataclass(frozen=True)
class History:
    """What one page draws from a job's events.jsonl: bounded lists, copied (see the module's docstring)."""

    loss: list[tuple[int, float]]
    lr: list[tuple[int, float]]
    speed: list[tuple[int, float]]
    speed_means: list[tuple[int, float]]  # (first step, mean s/step) of each bucket, for J/step
    times: list[tuple[int, float]]  # (step, epoch seconds), for the W nearest a step
    val: list[tuple[int, float]]
    reported: int  # steps with a loss, before downsampling
    checkpoints: list[dict[str, Any]]
    samples: dict[int, dict[str, Any]]
    last_checkpoint_ts: float | None
    read: int  # bytes of events.jsonl read so far
    size: int  # its size when last looked at

    @property
    def behind(self) -> int:
        return max(0, self.size - self.read)


@dataclass
class Series:
    """A job's history as its trainer reported it (a resumed run's report of a step replaces the earlier one, see
    downsample.py), plus its newest checkpoints and sample images, and where its events.jsonl was read up to."""

    offset: int = 0
    file: tuple[int, int] | None = None  # (st_dev, st_ino): another file means start again
    size: int = 0
    loss: Downsampled = field(default_factory=lambda: Downsampled(CAPACITY))
    lr: Downsampled = field(default_factory=lambda: Downsampled(CAPACITY))
    speed: Downsampled = field(default_factory=lambda: Downsampled(CAPACITY))
    times: Downsampled = field(default_factory=lambda: Downsampled(CAPACITY))
    val_loss: Downsampled = field(default_factory=lambda: Downsampled(CAPACITY))
    checkpoints: dict[int, dict[str, Any]] = field(default_factory=dict)
    samples: dict[int, dict[str, Any]] = field(default_factory=dict)
    last_checkpoint_ts: float | None = None
    used: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _partial: bytes = b""  # the start of a line not yet ended
    _skipping: bool = False  # inside a line longer than MAX_LINE: dropped up to its newline

    @property
    def val(self) -> dict[int, float]:
        """The validation losses a chart draws (every one while they are few)."""
        return dict(self.val_loss.points())

    def add(self, ev: dict[str, Any]) -> None:
        step = ev.get("step")
        if type(step) is not int or not 0 <= step <= MAX_STEP:
            return
        kind = ev.get("event")
        if kind == "step":
            for series, v in ((self.loss, _number(ev.get("loss"))), (self.lr, _number(ev.get("lr"))),
                              (self.speed, _number(ev.get("s_per_step"))), (self.times, _ts(ev.get("ts"))),
                              (self.val_loss, _number(ev.get("val_loss")))):  # val_loss: carried on a step line
                if v is not None:
                    series.add(step, v)
        elif kind in ("eval", "validation"):
            if (x := _number(ev.get("val_loss", ev.get("loss")))) is not None:
                self.val_loss.add(step, x)
        elif kind == "checkpoint_committed":
            ts = _ts(ev.get("ts"))
            path = ev.get("path")
            self.checkpoints[step] = {"step": step, "ts": ts, "path": path if isinstance(path, str) else None,
                                      "seconds": _number(ev.get("seconds"))}
            _keep_newest(self.checkpoints, CHECKPOINTS_KEPT)
            if ts is not None:
                self.last_checkpoint_ts = max(self.last_checkpoint_ts or 0.0, ts)
        elif kind == "samples":
            paths, prompts = ev.get("paths"), ev.get("prompts")
            controls = ev.get("control_images")  # an edit job's: per prompt, the control images rendered from
            self.samples[step] = {"paths": [str(p) for p in paths] if isinstance(paths, list) else [],
                                  "prompts": [str(p) for p in prompts] if isinstance(prompts, list) else [],
                                  "controls": [[str(x) for x in c] if isinstance(c, list) else [] for c in controls]
                                  if isinstance(controls, list) else []}
            _keep_newest(self.samples, SAMPLES_KEPT)

    def catch_up(self, workdir: Path, most_bytes: int) -> None:
        """Read up to `most_bytes` more of workdir/events.jsonl (the caller holds `lock`)."""
        fd = open_events(workdir)
        if fd is None:
            return
        try:
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) != self.file or st.st_size < self.offset:  # a new or truncated file
                self.reset((st.st_dev, st.st_ino))
            self.size = st.st_size
            end = min(st.st_size, self.offset + most_bytes)
            while self.offset < end:
                chunk = os.pread(fd, min(READ_CHUNK, end - self.offset), self.offset)
                if not chunk:
                    break
                self.offset += len(chunk)
                self._feed(chunk)
        except OSError:
            pass  # read again on the next call; the caller sees no progress
        finally:
            os.close(fd)

    def reset(self, file: tuple[int, int]) -> None:
        """Start again on another file: every field back to its default but the lock (held by the caller)."""
        self.__init__(file=file, used=self.used, lock=self.lock)  # type: ignore[misc]

    def _feed(self, chunk: bytes) -> None:
        """Parse the whole lines in what was read; a line's unfinished end waits for the next read."""
        cut = chunk.rfind(b"\n") + 1
        if cut == 0:
            self._hold(chunk)
            return
        head, tail = chunk[:cut], chunk[cut:]
        if self._skipping:
            head = head[head.find(b"\n") + 1:]
            self._skipping = False
        else:
            head = self._partial + head
        self._partial = b""
        for ev in decode_lines(head):
            if isinstance(ev, dict):
                self.add(ev)
        self._hold(tail)

    def _hold(self, part: bytes) -> None:
        if self._skipping:
            return
        self._partial += part
        if len(self._partial) > MAX_LINE:
            self._partial, self._skipping = b"", True

    def snapshot(self) -> History:
        return History(loss=self.loss.points(), lr=self.lr.points(), speed=self.speed.points(),
                       speed_means=self.speed.means(), times=self.times.points(), val=self.val_loss.points(),
                       reported=self.loss.count, checkpoints=list(self.checkpoints.values()),
                       samples=dict(self.samples), last_checkpoint_ts=self.last_checkpoint_ts, read=self.offset,
                       size=self.size)


def _keep_newest(by_step: dict[int, Any], most: int) -> None:
    if len(by_step) > most:
        del by_step[min(by_step)]
