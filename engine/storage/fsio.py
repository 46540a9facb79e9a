"""The file layer every durable write goes through.

Checkpoints, cache files and outputs are committed with a handful of primitive
operations (mkdir, write, fsync, fsync_dir, rename, remove). Routing them
through one small object lets the crash-state tests record the exact sequence
and replay every state a power cut could leave behind; production uses
`RealFs`, which is a thin wrapper over `os`.

We write this ourselves because no library offers a crash-safe directory commit
with a recordable operation log.
"""

from __future__ import annotations

import errno
import os
import secrets
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Protocol


class FileLayer(Protocol):
    def mkdir(self, path: Path) -> None: ...
    def write(self, path: Path, chunks: Iterable[bytes]) -> int: ...
    def fsync(self, path: Path) -> None: ...
    def fsync_dir(self, path: Path) -> None: ...
    def rename(self, src: Path, dst: Path) -> None: ...
    def rmtree(self, path: Path) -> None: ...


class RealFs:
    """Plain POSIX operations. `write` creates or truncates the file and does not sync; it never writes through a
    symlink at the name (O_NOFOLLOW: ELOOP instead)."""

    def mkdir(self, path: Path) -> None:
        os.mkdir(path)

    def write(self, path: Path, chunks: Iterable[bytes]) -> int:
        n = 0
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
        with open(fd, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
                n += len(chunk)
        return n

    def fsync(self, path: Path) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def fsync_dir(self, path: Path) -> None:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def rename(self, src: Path, dst: Path) -> None:
        os.rename(src, dst)

    def rmtree(self, path: Path) -> None:
        shutil.rmtree(path, ignore_errors=True)


def ensure_dir_durable(fs: FileLayer, path: Path) -> None:
    """Create `path` and any missing parents, fsyncing each parent after creating a child.

    After a power cut only what was fsynced exists, so a directory that holds
    committed checkpoints must itself be durable in its parent.
    """
    path = Path(path)
    missing = []
    p = path
    while not p.exists():
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        try:
            fs.mkdir(d)
        except FileExistsError:
            continue
        fs.fsync_dir(d.parent)


def write_file_durable(fs: FileLayer, path: Path, data: bytes) -> None:
    """Write a whole file atomically: temp name, fsync, rename, fsync the directory.

    The temp name is unpredictable and made with O_EXCL before anything is written to it: a symlink planted at a
    guessable name (a daemon's pid is no secret) would otherwise be followed and its target overwritten. The same
    rules as daemon/system/safe_files.write_durable, by path here: the engine does not import the daemon, and
    the crash-state tests record the file layer's operations.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(8)}")
    os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666))
    fs.write(tmp, [data])
    fs.fsync(tmp)
    fs.rename(tmp, path)
    fs.fsync_dir(path.parent)


def process_umask() -> int:
    """This process's umask, read without changing it (os.umask would race the checkpoint writer thread)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o022


def normal_file_mode() -> int:
    """The mode open() gives a new file here: 0o666 less the umask (0o644 under the usual 022)."""
    return 0o666 & ~process_umask()


def is_disk_full(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)
