"""What a job's directory says about its progress, read without the engine (no torch in the daemon):
its committed checkpoints (`checkpoints/step-N/` with a manifest whose files are all there, at their size)
and the last step its events file reached. Start-up recovery trusts these over state.db, which a SIGKILLed
daemon may have left behind; a full disk's wait is sized by the newest checkpoint. Each checkpoint's export
files (its manifest's `export/...` entries) are what `lorad export` and the dashboard offer.

The sha256 of each file is not checked here (that is a full read of every checkpoint at every start); the
trainer verifies what it resumes from, and walks back past a checkpoint that does not verify.

The trainer user writes this directory: a manifest is read by descriptor (no symlink, no FIFO, size-capped;
daemon/system/safe_files.py), and the files it names are looked at with lstat, inside the checkpoint only.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from daemon.supervisor.trainer_output import Refused, parse
from daemon.system.file_tail import tail_lines
from daemon.system.safe_files import open_at, opened_dir, read_bytes

STEP_DIR = re.compile(r"^step-(\d{8})$")  # engine/checkpoint/store.py's layout (the daemon must not import torch)
EVENTS_TAIL_BYTES = 1 << 20  # the last step is near the end of events.jsonl
MANIFEST_MAX_BYTES = 16 << 20  # a manifest lists a checkpoint's files: far below this


EXPORT_DIR = "export"  # a checkpoint's user-format files (engine/checkpoint/exports.py)


@dataclass(frozen=True)
class ExportFile:
    name: str  # relative to the checkpoint's export/ (raw/... with train.ema.export_raw)
    size: int
    sha256: str


@dataclass(frozen=True)
class Committed:
    step: int
    path: Path
    bytes: int
    exports: tuple[ExportFile, ...] = ()  # the step's user-format files, as its manifest lists them


def committed_checkpoints(workdir: Path) -> list[Committed]:
    """Checkpoints whose manifest lists files that are all present at their recorded size, newest first."""
    out = []
    try:
        entries = list(os.scandir(Path(workdir) / "checkpoints"))
    except OSError:
        return []
    for e in entries:
        m = STEP_DIR.match(e.name)
        if not m or not e.is_dir(follow_symlinks=False):
            continue
        try:
            raw = read_bytes(Path(e.path) / "manifest.json", MANIFEST_MAX_BYTES)
            if len(raw) > MANIFEST_MAX_BYTES:
                continue
            manifest = json.loads(raw)
            files = manifest["files"]
            if int(manifest["step"]) != int(m.group(1)):
                continue
            if any(not _inside(name) or os.lstat(Path(e.path) / name).st_size != meta["size"]
                   for name, meta in files.items()):
                continue
            size = sum(int(meta["size"]) for meta in files.values())
            exports = tuple(ExportFile(name.removeprefix(f"{EXPORT_DIR}/"), int(meta["size"]), str(meta["sha256"]))
                            for name, meta in sorted(files.items()) if name.startswith(f"{EXPORT_DIR}/"))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue  # not committed (a save cut short), or unreadable: not a checkpoint
        out.append(Committed(int(m.group(1)), Path(e.path), size, exports))
    return sorted(out, key=lambda c: c.step, reverse=True)


def saved_exports(workdir: Path, step: int | None = None) -> list[Committed]:
    """The committed checkpoints that hold export files, newest first; with `step`, that one alone (LookupError,
    naming the saved steps, when it is not there). `lorad export` reads them through the daemon or, with none
    serving the home, straight from the job directory."""
    saved = [c for c in committed_checkpoints(workdir) if c.exports]
    if step is None:
        return saved
    if not (one := [c for c in saved if c.step == step]):
        raise LookupError(f"has no saved step {step} (saved steps: {', '.join(str(c.step) for c in saved) or 'none yet'})")
    return one


def open_export(workdir: Path, step: int, name: str) -> int:
    """A read descriptor of checkpoints/step-N/export/NAME, reached from the job directory through directory
    descriptors that never follow a symlink (the trainer user writes below it); the caller checks `name` against
    the manifest."""
    parts = name.split("/")
    if not _inside(name) or "" in parts:
        raise FileNotFoundError(name)
    dirs = ["checkpoints", f"step-{step:08d}", EXPORT_DIR, *parts[:-1]]
    with opened_dir(Path(workdir)) as top:
        fds = [top]
        try:
            for d in dirs:
                fds.append(os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fds[-1]))
            return open_at(fds[-1], parts[-1])
        finally:
            for fd in fds[1:]:
                os.close(fd)


def _inside(name: str) -> bool:
    """A manifest's file name that stays inside its checkpoint (no absolute path, no '..')."""
    p = Path(name)
    return not p.is_absolute() and ".." not in p.parts


def last_event_step(workdir: Path) -> int | None:
    """The highest `step` of the step events at the end of events.jsonl (None: no step event there)."""
    for raw in reversed(tail_lines(Path(workdir) / "events.jsonl", EVENTS_TAIL_BYTES) or []):
        if b'"step"' not in raw:
            continue
        try:
            ev = parse(raw)  # the trainer writes this file: its step is checked as on stdout
        except Refused:
            continue  # a line torn by a kill, or one the daemon would not have believed on stdout either
        if ev is not None and ev.get("event") in ("step", "done") and "step" in ev:
            return ev["step"]
    return None
