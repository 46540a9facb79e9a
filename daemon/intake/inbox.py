"""The watched inbox: tells the supervisor which files in HOME/inbox are complete.

A file is complete when its writer closed it (inotify close-after-write) or
when it was renamed in. A file that appears without being opened for writing
(a rename from another directory shows up as "created") is taken after a
short grace period; one opened and not yet closed is never taken. A periodic
rescan (also run at start-up) picks up what arrived while the daemon was down,
or what the watcher missed, once its mtime is older than `settle_s`.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from watchdog.events import (
    FileClosedEvent,
    FileClosedNoWriteEvent,
    FileCreatedEvent,
    FileMovedEvent,
    FileOpenedEvent,
    FileSystemEventHandler,
)
from watchdog.observers import Observer

from daemon.intake.accept import ignored

RENAMED_IN_GRACE_S = 0.3  # how long a created-but-never-opened file waits for an open before it counts as renamed in


class InboxWatcher(FileSystemEventHandler):
    def __init__(self, inbox: Path, settle_s: float, rescan_s: float):
        self.inbox = Path(inbox)
        self.settle_s = settle_s
        self.rescan_s = rescan_s
        self._lock = threading.Lock()
        self._ready: dict[str, None] = {}  # ordered set of complete files
        self._fresh: dict[str, float] = {}  # created, not (yet) seen opened: maybe renamed in
        self._writing: set[str] = set()
        self._next_rescan = 0.0  # rescan at once on the first poll
        self._observer = None

    def start(self) -> None:
        self._observer = Observer()
        self._observer.schedule(self, str(self.inbox), recursive=False)
        self._observer.daemon = True
        self._observer.start()

    def stop(self) -> None:
        if self._observer is not None:
            self._observer.stop()
            self._observer.join(timeout=5)
            self._observer = None

    # ------------------------------------------------------------ watchdog callbacks (observer thread)
    def _mine(self, path: str) -> bool:
        p = Path(path)
        return p.parent == self.inbox and not ignored(p.name)

    def on_created(self, event) -> None:
        if isinstance(event, FileCreatedEvent) and self._mine(event.src_path):
            with self._lock:
                if event.src_path not in self._writing:
                    self._fresh[event.src_path] = time.monotonic()

    def on_opened(self, event) -> None:
        if isinstance(event, FileOpenedEvent) and self._mine(event.src_path):
            with self._lock:
                self._fresh.pop(event.src_path, None)
                self._writing.add(event.src_path)

    def on_closed(self, event) -> None:
        if isinstance(event, FileClosedEvent) and self._mine(event.src_path):
            with self._lock:
                self._writing.discard(event.src_path)
                self._fresh.pop(event.src_path, None)
                self._ready[event.src_path] = None

    def on_closed_no_write(self, event) -> None:
        if isinstance(event, FileClosedNoWriteEvent) and self._mine(event.src_path):
            with self._lock:
                # Opened for reading only (someone looked at it): not a writer after all.
                self._writing.discard(event.src_path)

    def on_moved(self, event) -> None:
        if isinstance(event, FileMovedEvent) and self._mine(event.dest_path):
            with self._lock:
                self._ready[event.dest_path] = None

    # ------------------------------------------------------------ supervisor side
    def poll(self) -> list[Path]:
        """Complete files, oldest first; each path is returned once per completion."""
        now = time.monotonic()
        with self._lock:
            out = list(self._ready)
            self._ready.clear()
            for p, t in list(self._fresh.items()):
                if now - t >= RENAMED_IN_GRACE_S:
                    del self._fresh[p]
                    out.append(p)
            writing = set(self._writing)
        if now >= self._next_rescan:
            self._next_rescan = now + self.rescan_s
            out.extend(self._rescan(writing, set(out)))
        return [Path(p) for p in out]

    def _rescan(self, writing: set[str], already: set[str]) -> list[str]:
        found = []
        try:
            entries = sorted(os.scandir(self.inbox), key=lambda e: e.name)
        except FileNotFoundError:
            return []
        for e in entries:
            if ignored(e.name) or e.path in writing or e.path in already:
                continue
            try:
                st = e.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            if time.time() - st.st_mtime >= self.settle_s:
                found.append(e.path)
        return found
