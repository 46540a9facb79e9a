"""A FUSE file system that keeps only what was fsynced: power cuts, a full disk and torn writes, as a test tool.

A passthrough (mfusepy over Debian's fuse3) onto BACKING/live. Beside it the file system keeps what a power cut
would leave: per file, the bytes its last fsync made durable (BACKING/durable/UID, copied lazily: a file untouched
since the mount is durable as it is), and per directory, the entries (creates, renames, unlinks) its last
directory fsync made durable. A file's own fsync never makes its name durable (POSIX; ext4 often does, lorad
must not count on it).

    fs = FaultFs(tmp / "fs").start()     # mounted at fs.mount
    fs.cut()                             # a power cut: everything unsynced is gone; unmounted and mounted again
    fs.cut(torn=True, seed=3)            # ... and of the unsynced writes, some 4 KiB pages landed (a torn write)
    fs.full(True); fs.full(False)        # writes and creates fail with ENOSPC; statfs says 0 bytes free
    fs.clock(3600)                       # what is changed or touched from now on gets mtimes an hour ahead
    fs.stop()

Whatever uses the mount must be dead (SIGKILL) before cut(): a power cut has no survivors. The server runs in its
own process (`python -m tests.helpers.faultfs BACKING MOUNT CONTROL`), single-threaded, with one control socket.
"""


from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from tests.helpers.faultfs_ops import PAGE, PowerCutOps

__all__ = ["PAGE", "FaultFs", "PowerCutOps", "fuse_usable", "serve"]

def _control(ops: PowerCutOps, path: Path) -> None:
    """One command a connection: `cut TORN SEED`, `full 0|1`; answers `ok` once done."""
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(str(path))
    srv.listen(4)
    while True:
        conn, _ = srv.accept()
        with conn:
            cmd = conn.recv(256).decode().split()
            with ops.mutex:
                if cmd[0] == "cut":
                    ops.cut(cmd[1] == "1", int(cmd[2]))
                elif cmd[0] == "full":
                    ops.full_on = cmd[1] == "1"
                elif cmd[0] == "clock":
                    ops.clock_ns = int(cmd[1])
            conn.sendall(b"ok\n")


def serve(backing: Path, mount: Path, control: Path) -> None:
    import mfusepy

    ops = PowerCutOps(backing)
    threading.Thread(target=_control, args=(ops, control), daemon=True).start()
    # Single-threaded: the model's bookkeeping stays simple. No kernel attribute or entry cache, so what a process
    # sees is what the model has (a cut swaps the tree under an unmounting server, never under a live one).
    mfusepy.FUSE(ops, str(mount), foreground=True, nothreads=True, attr_timeout=0, entry_timeout=0,
                 negative_timeout=0, fsname="faultfs")


class FaultFs:
    """The test's handle on one such file system: start, cut, full, stop."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.backing, self.mount, self.control = self.root / "backing", self.root / "mnt", self.root / "control.sock"
        self.proc: subprocess.Popen | None = None
        self.cuts = 0
        self.clock_s = 0.0

    def start(self) -> FaultFs:
        self.mount.mkdir(parents=True, exist_ok=True)
        self.control.unlink(missing_ok=True)
        repo = Path(__file__).resolve().parents[2]
        env = {**os.environ, "PYTHONPATH": str(repo)}
        log = open(self.root / "faultfs.log", "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.helpers.faultfs", str(self.backing),
                                      str(self.mount), str(self.control)], stdout=log, stderr=log, env=env,
                                     cwd=str(repo))
        log.close()
        deadline = time.monotonic() + 30
        while not (os.path.ismount(self.mount) and self.control.exists()):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"faultfs did not mount: {(self.root / 'faultfs.log').read_text()[-2000:]}")
            time.sleep(0.02)
        return self

    def _command(self, line: str) -> None:
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(600)
            s.connect(str(self.control))
            s.sendall(line.encode())
            if s.recv(16) != b"ok\n":
                raise RuntimeError(f"faultfs: {line} failed")

    def full(self, on: bool) -> None:
        self._command(f"full {int(on)}")

    def clock(self, offset_s: float) -> None:
        """The wall clock as files see it moved by offset_s from the kernel's: what is changed or touched from now
        on gets the moved time (files changed before keep theirs, as after a real clock jump)."""
        self._command(f"clock {int(offset_s * 1e9)}")
        self.clock_s = offset_s

    def cut(self, torn: bool = False, seed: int = 0) -> None:
        self._command(f"cut {int(torn)} {seed}")
        self.cuts += 1
        self.stop()
        self.start()
        if self.clock_s:
            self.clock(self.clock_s)

    def stop(self) -> None:
        if self.proc is None:
            return
        if subprocess.run(["fusermount3", "-u", str(self.mount)], capture_output=True).returncode != 0:
            subprocess.run(["fusermount3", "-uz", str(self.mount)], capture_output=True)  # still open somewhere
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None


def fuse_usable() -> str | None:
    """None when a FaultFs can mount here, else why not (the tests that need one skip with it)."""
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse"
    if shutil.which("fusermount3") is None:
        return "no fusermount3 (Debian's fuse3; `make system-deps`)"
    try:
        import mfusepy  # noqa: F401
    except (ImportError, OSError) as e:
        return f"mfusepy unusable: {e}"
    return None


if __name__ == "__main__":
    serve(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]))
