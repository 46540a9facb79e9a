"""The operations of the power-cut file system (tests/helpers/faultfs.py) and the durable model beside them."""

from __future__ import annotations

import errno
import os
import random
import shutil
import stat
import threading
import time
from pathlib import Path

PAGE = 4096
UTIME_NOW, UTIME_OMIT = (1 << 30) - 1, (1 << 30) - 2  # <sys/stat.h>


class PowerCutOps:
    """The FUSE operations and the durable model beside them. Files are known by a uid of our own (a backing inode
    number is reused after an unlink; a uid never is)."""

    use_ns = True

    def __init__(self, backing: Path):
        self.live, self.store = backing / "live", backing / "durable"
        self.live.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(self.store, ignore_errors=True)
        self.store.mkdir()
        self.mutex = threading.RLock()  # not `lock`: that name is the FUSE lock operation
        self.next_uid = 0
        self.uid_of: dict[int, int] = {}  # backing inode -> uid
        self.durable: dict[int, str | None] = {}  # uid -> "live" (untouched), "copy" (BACKING/durable/UID), None
        self.dirty: dict[int, list[tuple[int, int]]] = {}  # uid -> unsynced writes (offset, length)
        self.entries: dict[int, dict[str, tuple[str, int | str]]] = {}  # dir uid -> name -> (kind, uid | target)
        self.fh_uid: dict[int, int] = {}
        self.full_on = False
        self.clock_ns = 0  # the simulated wall clock's offset: files changed now get its time as their mtime
        self.dead = False
        self.root_uid = self._scan()

    # ------------------------------------------------------------------ the durable model
    def _new_uid(self, ino: int, durable: str | None) -> int:
        self.next_uid += 1
        self.uid_of[ino] = self.next_uid
        self.durable[self.next_uid] = durable
        return self.next_uid

    def _uid(self, path: Path) -> int:
        ino = os.lstat(path).st_ino
        return self.uid_of[ino] if ino in self.uid_of else self._new_uid(ino, None)

    def _scan(self) -> int:
        """At mount, everything in the backing tree is durable (as after a reboot)."""
        root = self._new_uid(os.lstat(self.live).st_ino, "live")
        for d, dirs, files in os.walk(self.live):
            for name in dirs + files:
                p = Path(d) / name
                ino = os.lstat(p).st_ino
                if ino not in self.uid_of:
                    self._new_uid(ino, "live")
            self._snapshot_dir(Path(d))
        return root

    def _entry(self, p: Path) -> tuple[str, int | str] | None:
        st = os.lstat(p)
        if stat.S_ISDIR(st.st_mode):
            return "dir", self._uid(p)
        if stat.S_ISREG(st.st_mode):
            return "file", self._uid(p)
        if stat.S_ISLNK(st.st_mode):
            return "link", os.readlink(p)
        return None  # sockets and FIFOs do not outlive a reboot as anything useful

    def _snapshot_dir(self, d: Path) -> None:
        with os.scandir(d) as it:
            self.entries[self._uid(d)] = {e.name: en for e in it if (en := self._entry(Path(e.path))) is not None}

    def _preserve(self, uid: int, live: Path | int) -> None:
        """Before a file's live bytes change or go: its durable bytes, if they are still the live ones, copied
        (from its path or an open descriptor)."""
        if self.durable.get(uid) != "live":
            return
        if isinstance(live, int):
            with open(self.store / str(uid), "wb") as out:
                while chunk := os.pread(live, 1 << 20, out.tell()):
                    out.write(chunk)
        else:
            shutil.copyfile(live, self.store / str(uid))
        self.durable[uid] = "copy"

    def _sync_file(self, uid: int, fd: int) -> None:
        dst = self.store / str(uid)
        if self.durable.get(uid) != "copy":
            dst.write_bytes(b"")
            self.durable[uid] = "copy"
        with open(dst, "r+b") as out:
            for off, n in self.dirty.pop(uid, []):
                out.seek(off)
                out.write(os.pread(fd, n, off))
            out.truncate(os.fstat(fd).st_size)

    def cut(self, torn: bool, seed: int) -> None:
        """Rebuild BACKING/live as a power cut leaves it; this server then serves nothing but EIO."""
        self.dead = True
        rng = random.Random(seed)
        live_path = {uid: Path(d) / n for d, dirs, files in os.walk(self.live) for n in dirs + files
                     if (uid := self.uid_of.get(os.lstat(Path(d) / n).st_ino))}
        nxt = self.live.with_name("next")
        shutil.rmtree(nxt, ignore_errors=True)
        nxt.mkdir()
        built: dict[int, Path] = {}
        todo = [(self.root_uid, nxt)]
        while todo:
            duid, dpath = todo.pop()
            for name, (kind, ref) in self.entries.get(duid, {}).items():
                p = dpath / name
                if kind == "dir":
                    p.mkdir()
                    todo.append((ref, p))
                elif kind == "link":
                    os.symlink(ref, p)
                elif ref in built:
                    os.link(built[ref], p)
                else:
                    built[ref] = p
                    self._rebuild_file(ref, p, live_path.get(ref), torn, rng)
        old = self.live.with_name("old")
        os.rename(self.live, old)
        os.rename(nxt, self.live)
        shutil.rmtree(old, ignore_errors=True)

    def _rebuild_file(self, uid: int, p: Path, live: Path | None, torn: bool, rng: random.Random) -> None:
        state = self.durable.get(uid)
        if state == "live" and live is not None:
            shutil.copyfile(live, p)
        elif state == "copy":
            shutil.copyfile(self.store / str(uid), p)
        else:
            p.write_bytes(b"")
        if torn and live is not None and self.dirty.get(uid):
            with open(live, "rb") as src, open(p, "r+b") as out:
                for off, n in self.dirty[uid]:
                    for page in range(off - off % PAGE, off + n, PAGE):
                        if rng.random() < 0.5:
                            src.seek(page)
                            out.seek(page)
                            out.write(src.read(PAGE))

    # ------------------------------------------------------------------ FUSE operations
    def _p(self, path: str) -> Path:
        if self.dead:
            raise _err(errno.EIO)
        return self.live / path.lstrip("/")

    def _stamp(self, target: Path | int) -> None:
        """With the wall clock moved, a change stamps the file with the moved clock's now, as a kernel would."""
        if self.clock_ns:
            now = time.time_ns() + self.clock_ns
            os.utime(target, ns=(now, now), **({} if isinstance(target, int) else {"follow_symlinks": False}))

    def _no_space(self) -> None:
        if self.full_on:
            raise _err(errno.ENOSPC)

    def getattr(self, path, fh=None):
        st = os.fstat(fh) if fh is not None and not self.dead else os.lstat(self._p(path))
        return {k: getattr(st, k) for k in ("st_mode", "st_ino", "st_nlink", "st_uid", "st_gid", "st_size",
                                             "st_blocks")} | {
            "st_atime": st.st_atime_ns, "st_mtime": st.st_mtime_ns, "st_ctime": st.st_ctime_ns}

    def access(self, path, amode):
        if not os.access(self._p(path), amode):
            raise _err(errno.EACCES)
        return 0

    def readdir(self, path, fh):
        return [".", "..", *os.listdir(self._p(path))]

    def readlink(self, path):
        return os.readlink(self._p(path))

    def statfs(self, path):
        s = os.statvfs(self._p(path))
        out = {k: getattr(s, k) for k in ("f_bsize", "f_frsize", "f_blocks", "f_bfree", "f_bavail", "f_files",
                                          "f_ffree", "f_favail", "f_flag", "f_namemax")}
        return out | ({"f_bfree": 0, "f_bavail": 0} if self.full_on else {})

    def open(self, path, flags):
        with self.mutex:
            p = self._p(path)
            uid = self._uid(p)
            if flags & os.O_TRUNC:
                self._preserve(uid, p)
                self._truncated(uid, 0)
            fd = os.open(p, _backing_flags(flags))
            self.fh_uid[fd] = uid
            return fd

    def create(self, path, mode, flags):
        with self.mutex:
            self._no_space()
            p = self._p(path)
            if p.is_file():  # O_CREAT of an existing file (without O_EXCL): that file, maybe truncated
                return self.open(path, flags & ~os.O_CREAT & ~os.O_EXCL)
            fd = os.open(p, _backing_flags(flags) | os.O_CREAT, mode)
            self._stamp(fd)
            self.fh_uid[fd] = self._new_uid(os.fstat(fd).st_ino, None)
            return fd

    def read(self, path, size, offset, fh):
        return os.pread(fh, size, offset)

    def write(self, path, data, offset, fh):
        with self.mutex:
            self._no_space()
            uid = self.fh_uid[fh]
            self._preserve(uid, fh)
            n = os.pwrite(fh, data, offset)
            self._stamp(fh)
            self.dirty.setdefault(uid, []).append((offset, n))
            return n

    def _truncated(self, uid: int, length: int) -> None:
        self.dirty.setdefault(uid, []).append((length, 0))  # the sync truncates the durable copy to the live size

    def truncate(self, path, length, fh=None):
        with self.mutex:
            if self.dead:
                raise _err(errno.EIO)
            target = fh if fh is not None else self._p(path)
            if length > os.stat(target).st_size:
                self._no_space()
            uid = self.fh_uid[fh] if fh is not None else self._uid(target)
            self._preserve(uid, target)
            os.truncate(target, length)
            self._stamp(target)
            self._truncated(uid, length)
            return 0

    def fsync(self, path, datasync, fh):
        with self.mutex:
            self._p(path)
            self._sync_file(self.fh_uid[fh], fh)
            return 0

    def fsyncdir(self, path, datasync, fh):
        with self.mutex:
            self._snapshot_dir(self._p(path))
            return 0

    def flush(self, path, fh):
        return 0

    def release(self, path, fh):
        with self.mutex:
            self.fh_uid.pop(fh, None)
            os.close(fh)
            return 0

    def mkdir(self, path, mode):
        with self.mutex:
            self._no_space()
            os.mkdir(self._p(path), mode)
            self._stamp(self._p(path))
            self._new_uid(os.lstat(self._p(path)).st_ino, None)
            return 0

    def mknod(self, path, mode, dev):
        self._no_space()
        os.mknod(self._p(path), mode, dev)
        return 0

    def symlink(self, target, source):
        self._no_space()
        os.symlink(source, self._p(target))
        return 0

    def link(self, target, source):
        self._no_space()
        os.link(self._p(source), self._p(target))
        return 0

    def unlink(self, path):
        with self.mutex:
            p = self._p(path)
            if p.is_file() and not p.is_symlink():
                self._preserve(self._uid(p), p)
            os.unlink(p)
            return 0

    def rmdir(self, path):
        os.rmdir(self._p(path))
        return 0

    def rename(self, old, new):
        with self.mutex:
            dst = self._p(new)
            if dst.is_file() and not dst.is_symlink():
                self._preserve(self._uid(dst), dst)
            os.rename(self._p(old), dst)
            return 0

    def chmod(self, path, mode):
        os.chmod(self._p(path), mode)
        return 0

    def chown(self, path, uid, gid):
        os.chown(self._p(path), uid, gid, follow_symlinks=False)
        return 0

    def utimens(self, path, times=None):
        p = self._p(path)
        if times is not None:  # libfuse passes UTIME_NOW / UTIME_OMIT as they are, with a zero tv_sec
            st = os.lstat(p)
            now = time.time_ns() + self.clock_ns
            times = tuple(now if t == UTIME_NOW else old if t == UTIME_OMIT else t
                          for t, old in zip(times, (st.st_atime_ns, st.st_mtime_ns), strict=True))
        if times is None and self.clock_ns:
            times = (time.time_ns() + self.clock_ns,) * 2
        os.utime(p, ns=times, follow_symlinks=False)
        return 0


def _backing_flags(flags: int) -> int:
    """The kernel passes each write's offset (appends included), and a sync reads back what was written."""
    if flags & os.O_ACCMODE == os.O_WRONLY:
        flags = flags & ~os.O_ACCMODE | os.O_RDWR
    return flags & ~os.O_APPEND


def _err(code: int) -> OSError:
    import mfusepy

    return mfusepy.FuseOSError(code)
