"""HOME/cache's size limit: least-recently-used whole entries go after a job's cache fill, never one a running job
holds.

    cache/.leases/lease-PID-RANDOM.json   the keys one process uses, flock'ed (shared) while it lives
    cache/.leases/lock                    leases are taken and entries evicted under it, one at a time

Use: an entry's last use is its entry file's mtime, set when it is written and touched each time a job finds it
valid (`touch`). Limit: the daemon's `cache_max_bytes`, passed to each trainer on its command line
(engine/config/policy.py); none (`lorad run`, `lorad cache` without a daemon) = no eviction.

Running jobs: a job takes a lease on every key it needs before it verifies or encodes any (`Lease`), and holds
it (an open descriptor with a shared flock) while its Cache lives (the family's dataset keeps it for the whole
training; closed by Cache.close, collected, or the process's end, a SIGKILL included). Eviction skips every key of a live lease (one that cannot be locked exclusively) and removes
the lease files of dead ones. Taking a lease and evicting are serialised by .leases/lock, so an entry is either
leased before the evicter looks, or evicted before the job verifies it (and then the job encodes it again).

Crash safety: an entry goes whole, its entry file first (the commit: from then on it is absent to every reader),
the directory fsynced, then its data file. A kill in between leaves a data file no entry names, which the
cache's sweep removes like any writer's leftover; a cache cut off anywhere still verifies.

The current job never loses what it needs: its keys are leased, so if they alone are over the limit the cache
stays over it (`cache_over_limit`, said by that fill).

The compile caches count too (engine/frozen_base/compiling.py): cache/compile/KEY.bin (torch's artifacts) and
cache/compile/KEY.d (inductor's directory, committed by its MANIFEST.json) are one entry per KEY, sized on disk,
last used at the newer mtime of the file and the manifest (touched when a trainer finds them warm), leased by the
trainer that compiles with KEY, and evicted in the same least-recently-used order as the latent entries. Each goes
manifest first (the directory is then uncommitted: its next user wipes it, a cold compile), the directory synced,
then the artifacts file (a torn one fails its checksum), then the rest of the directory. A killed writer's temp
files there are swept by the next compile's start once they are an hour old (remove_stale).
"""

from __future__ import annotations

import fcntl
import json
import os
import secrets
import shutil
import stat
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ENTRY = ".entry.json"
LEASES = ".leases"  # the one name the cache's own bookkeeping adds to the cache directory
LOCK = "lock"
COMPILE = "compile"  # cache/compile: the torch.compile caches
MANIFEST = "MANIFEST.json"  # the commit of a compile key's KEY.d (engine/frozen_base/inductor_dir.py)

_limit: list[int | None] = [None]  # bytes; set once by the trainer from its command line (engine/run.py)


def set_limit(max_bytes: int | None) -> None:
    """The size limit this process's cache fills keep HOME/cache under (None or 0: none)."""
    _limit[0] = max_bytes or None


def limit() -> int | None:
    return _limit[0]


@contextmanager
def _locked(root: Path, how: int):
    os.makedirs(root / LEASES, exist_ok=True)
    fd = os.open(root / LEASES / LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    try:
        fcntl.flock(fd, how)
        yield
    finally:
        os.close(fd)  # releases the flock


class Lease:
    """The keys a process uses, visible to every evicter while this object (or the process) lives."""

    def __init__(self, root: Path, keys: Iterable[str]):
        self.path: Path | None = None
        self._file = None
        d = root / LEASES
        with _locked(root, fcntl.LOCK_SH):
            path = d / f"lease-{os.getpid()}-{secrets.token_hex(6)}.json"
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
            self._file = os.fdopen(fd, "w")  # closed (the flock released) when this object goes
            fcntl.flock(fd, fcntl.LOCK_SH)
            self._file.write(json.dumps(sorted(set(keys))))
            self._file.flush()
            self.path = path

    def close(self) -> None:
        if self._file is not None:
            try:
                if self.path is not None:
                    self.path.unlink(missing_ok=True)
            finally:
                self._file.close()
                self._file = None


def _live_keys(root: Path) -> set[str]:
    """The keys of every live lease; dead leases' files are removed (called under the exclusive lock)."""
    live: set[str] = set()
    d = root / LEASES
    try:
        names = os.listdir(d)
    except FileNotFoundError:
        return live
    for name in names:
        if not name.startswith("lease-"):
            continue
        try:
            fd = os.open(d / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # someone holds it: a running job's keys
                live.update(json.loads(os.pread(fd, os.fstat(fd).st_size, 0) or b"[]"))
                continue
            os.unlink(d / name)  # its process is gone
        except (OSError, ValueError):
            continue
        finally:
            os.close(fd)
    return live


def touch(path: Path) -> None:
    """Mark an entry used now (its entry file's mtime); an entry file this process may not touch stays as it is."""
    try:
        os.utime(path)
    except OSError:
        pass


@dataclass
class Entry:
    key: str
    size: int  # its data file's bytes (from the entry)
    used: float  # its entry file's mtime
    file: str
    kind: str = "latent"  # or "compile": file is then compile/KEY (KEY.bin and KEY.d)


def entries(root: Path) -> list[Entry]:
    """Every committed entry in `root` (unreadable ones skipped: they count as absent)."""
    out = []
    for name in os.listdir(root):
        if not name.endswith(ENTRY) or name.startswith("."):
            continue
        try:
            with open(root / name, "rb") as f:
                doc: dict[str, Any] = json.loads(f.read())
                used = os.fstat(f.fileno()).st_mtime
            out.append(Entry(doc["key"], int(doc["size"]), used, doc["file"]))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return out


def compile_entries(root: Path) -> list[Entry]:
    """One entry per compile key in `root`/compile: its KEY.bin and KEY.d together (either may be absent)."""
    d = Path(root) / COMPILE
    try:
        names = os.listdir(d)
    except (FileNotFoundError, NotADirectoryError):
        return []
    keys: dict[str, tuple[int, float]] = {}
    for name in names:
        key, _, ext = name.rpartition(".")
        if name.startswith(".") or ext not in ("bin", "d") or (part := _compile_part(d / name)) is None:
            continue  # a writer's temp file (.KEY.bin.tmp-...) or something not ours
        size, used = keys.get(key, (0, 0.0))
        keys[key] = size + part[0], max(used, part[1])
    return [Entry(k, size, used, f"{COMPILE}/{k}", "compile") for k, (size, used) in keys.items()]


def _compile_part(p: Path) -> tuple[int, float] | None:
    """(bytes on disk, last use) of a KEY.bin or a KEY.d; None when it is neither a file nor a directory."""
    try:
        st = os.lstat(p)
        if stat.S_ISREG(st.st_mode):
            return st.st_size, st.st_mtime
        if not stat.S_ISDIR(st.st_mode):
            return None
        try:
            used = os.stat(p / MANIFEST).st_mtime
        except FileNotFoundError:
            used = st.st_mtime  # uncommitted: a running compile's (leased), or a killed one's leftover
        size = 0
        for top, _, files in os.walk(p):
            for f in files:
                try:
                    size += os.lstat(os.path.join(top, f)).st_size
                except OSError:
                    continue
        return size, used
    except OSError:
        return None


def usage(root: Path) -> tuple[int, int]:
    """(entries, bytes of their data files) in the cache `root`; (0, 0) when there is none."""
    if not Path(root).is_dir():
        return 0, 0
    es = entries(Path(root))
    return len(es), sum(e.size for e in es)


def compile_usage(root: Path) -> tuple[int, int]:
    """(compile keys, their bytes on disk) in the cache `root`."""
    es = compile_entries(Path(root))
    return len(es), sum(e.size for e in es)


def _fsync_dir(d: Path) -> None:
    dfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def _remove(root: Path, e: Entry) -> None:
    """One entry, whole: the entry file (the commit), the directory synced, then the data file."""
    if e.kind == "compile":
        return _remove_compile(root / COMPILE, e.key)
    os.unlink(root / (e.key + ENTRY))
    _fsync_dir(root)
    try:
        os.unlink(root / e.file)
    except FileNotFoundError:
        pass  # another evicter, or a sweep, was first


def _remove_compile(d: Path, key: str) -> None:
    """A compile key: KEY.d's manifest first (from then on the directory loads as uncommitted, never warm), then
    KEY.bin, then what is left of KEY.d."""
    inductor = d / (key + ".d")
    try:
        os.unlink(inductor / MANIFEST)
        _fsync_dir(inductor)
    except (FileNotFoundError, NotADirectoryError):
        pass  # never committed, or gone already
    try:
        os.unlink(d / (key + ".bin"))
    except FileNotFoundError:
        pass
    _fsync_dir(d)
    shutil.rmtree(inductor, ignore_errors=True)


def remove_stale(d: Path, leftover: Callable[[str], bool], stale_s: float, now: float) -> list[str]:
    """Remove the regular files of `d` that `leftover` names and that are older than `stale_s` (a killed writer's:
    a live writer's are younger); their names. The latent cache's sweep and the compile cache's share it."""
    try:
        names = os.listdir(d)
    except (FileNotFoundError, NotADirectoryError):
        return []
    removed = []
    for name in names:
        if not leftover(name):
            continue
        try:
            st = os.lstat(Path(d) / name)
            if stat.S_ISREG(st.st_mode) and now - st.st_mtime > stale_s:
                os.unlink(Path(d) / name)
                removed.append(name)
        except FileNotFoundError:
            continue  # another sweeper was first
    return removed


def evict(root: Path, max_bytes: int, log) -> list[Entry]:
    """Remove least-recently-used entries (latent and compile) no live lease holds until they fit `max_bytes`."""
    root = Path(root)
    with _locked(root, fcntl.LOCK_EX):
        live = _live_keys(root)
        es = entries(root) + compile_entries(root)
        total = sum(e.size for e in es)
        removed: list[Entry] = []
        for e in sorted(es, key=lambda e: e.used):
            if total <= max_bytes:
                break
            if e.key in live:
                continue
            try:
                _remove(root, e)
            except FileNotFoundError:
                continue
            total -= e.size
            removed.append(e)
    for e in removed:
        log.info("cache_evicted", file=e.file, bytes=e.size)
    if removed or total > max_bytes:
        log.info("cache_size", entries=len(es) - len(removed), bytes=total, limit=max_bytes, evicted=len(removed))
    if total > max_bytes:
        log.warning("cache_over_limit", bytes=total, limit=max_bytes,
                    message="what running jobs use is over the cache limit; nothing they use is evicted")
    return removed
