"""A liveness signal from every rank, so that one stopped rank is a hung job even while rank 0 works on alone.

Rank 0's heartbeats (stdout) say that training moves. They cannot say that the other ranks are alive while
rank 0 does something on its own — rendering samples, writing a checkpoint, exporting: the others wait for it
in a collective, legitimately silent, and one of them SIGSTOPped, frozen or stuck holding the GIL looks the
same until rank 0 next needs it. So each rank keeps a file fresh from a thread of its own:

    $LORAD_LIVENESS_DIR/rank-R.PID     touched every LIVENESS_INTERVAL_S while the process runs

The daemon sets LORAD_LIVENESS_DIR (jobs/ID/ranks/ on its own machine) and treats a file that has gone stale
while its process still exists as a hung job (daemon/supervisor/trainer.py). A thread, not the training loop, touches it,
because a rank waiting in a collective is alive; what stops the thread is what stops the process (SIGSTOP, a
frozen cgroup, a native call that never releases the GIL). A rank whose main thread is stuck while its process
runs is caught by the lock-step instead: rank 0 blocks in the next collective and its heartbeats stop.

A rank that exits cleanly removes its file (another rank may go on exporting for a while); the file of a rank
that died names a pid that no longer exists, which the daemon ignores.

And the other way round: `die_with_parent` has the kernel kill a rank whose launcher died (no torch here, so that
engine.run can call it before it imports the training stack).
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

LIVENESS_DIR = "LORAD_LIVENESS_DIR"
LIVENESS_INTERVAL_S = 1.0
# Set by engine.launch; the ranks it starts die with it (die_with_parent).
LAUNCHER_PID = "LORAD_LAUNCHER_PID"  # inherited by the ranks through torchrun


def die_with_parent() -> None:
    """Ask the kernel to SIGKILL this rank when the launcher that started it dies (prctl PR_SET_PDEATHSIG).

    torchrun starts each rank in a session of its own, so a SIGKILL of the launcher's process group (the daemon
    killing a hung job, an OOM kill) would leave the ranks running, holding GPUs, without this.
    """
    import ctypes
    import signal

    expected = os.environ.get(LAUNCHER_PID)
    if expected is None:
        return
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    if os.getppid() != int(expected):  # the launcher died before the request was in place
        os._exit(1)


class Liveness:
    def __init__(self, directory: Path, rank: int, interval_s: float = LIVENESS_INTERVAL_S):
        self.path = Path(directory) / f"rank-{rank}.{os.getpid()}"
        self.interval_s = interval_s
        self._done = threading.Event()

    @classmethod
    def from_env(cls) -> Liveness | None:
        where = os.environ.get(LIVENESS_DIR)
        return cls(Path(where), int(os.environ.get("RANK", 0))) if where else None

    def start(self) -> Liveness:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.touch()
        threading.Thread(target=self._beat, name="liveness", daemon=True).start()
        return self

    def _beat(self) -> None:
        while not self._done.wait(self.interval_s):
            try:
                os.utime(self.path)
            except FileNotFoundError:  # removed under us (a daemon cleaning up): make it again
                self.path.touch()
            except OSError:
                pass  # a full or read-only disk: the daemon will see silence, which is what it is

    def stop(self) -> None:
        self._done.set()
        self.path.unlink(missing_ok=True)


def silent_ranks(directory: Path, now: float, limit_s: float, alive=None) -> list[tuple[str, float]]:
    """(rank, seconds silent) for every file in `directory` older than `limit_s` whose process still exists."""
    alive = alive or _alive
    out = []
    try:
        entries = list(Path(directory).iterdir())
    except OSError:
        return []
    for f in entries:
        rank, _, pid = f.name.partition(".")
        if not rank.startswith("rank-") or not pid.isdigit():
            continue
        try:
            quiet = now - f.stat().st_mtime
        except OSError:
            continue
        if quiet > limit_s and alive(int(pid)):
            out.append((rank.removeprefix("rank-"), quiet))
    return sorted(out)


class RankWatch:
    """Silence on the watcher's monotonic clock: a rank's file is silent for as long as its mtime has not changed
    since this watch first saw that mtime. An mtime read as an age (time.time() - mtime) is wrong by the size of
    any wall-clock jump: NTP stepping a clock by a minute made every running rank look 60 s silent (a healthy job
    killed as hung; bench/soak.py found it), and a jump back hid a stopped rank for as long as the jump.
    A watch that starts (a daemon restart) counts from its first look."""

    def __init__(self) -> None:
        self.seen: dict[str, tuple[int, float]] = {}  # file name -> (mtime_ns, monotonic when first seen)

    def silent(self, directory: Path, limit_s: float, now: float, alive=None) -> list[tuple[str, float]]:
        """(rank, seconds unchanged) for every file unchanged for more than limit_s whose process still exists."""
        alive = alive or _alive
        out, seen = [], {}
        try:
            entries = list(Path(directory).iterdir())
        except OSError:
            entries = []
        for f in entries:
            rank, _, pid = f.name.partition(".")
            if not rank.startswith("rank-") or not pid.isdigit():
                continue
            try:
                mtime = f.stat().st_mtime_ns
            except OSError:
                continue
            prev = self.seen.get(f.name)
            since = prev[1] if prev is not None and prev[0] == mtime else now
            seen[f.name] = (mtime, since)
            if now - since > limit_s and alive(int(pid)):
                out.append((rank.removeprefix("rank-"), now - since))
        self.seen = seen
        return sorted(out)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
