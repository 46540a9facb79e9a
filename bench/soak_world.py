"""The soak's world: `lorad serve` in a home on the power-cut file system, its trainers, their events, its clock.

bench/soak.py drives it; bench/soak_faults.py breaks it. Everything here observes from outside, as a user or an
operator would: the socket, the CLI, /proc and the files in the home.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from daemon import protocol as p  # noqa: E402
from daemon.client.connection import Client, DaemonDown  # noqa: E402
from daemon.system.proc import find_trainers  # noqa: E402
from tests.helpers.faultfs import FaultFs  # noqa: E402

# A wall-clock jump, as far as lorad sees it: time.time()/time_ns() of every lorad process (the daemon, the zygote,
# its trainers) gain the offset in the file, and the home's file system stamps what changes from then on with the
# moved clock (files changed before keep their times, as after a real jump). The kernel's clock is not ours to move
# (no CAP_SYS_TIME here, and other work shares this machine); CLOCK_MONOTONIC cannot jump by definition, and
# datetime.now() (C, not time.time) does not move: lorad's events keep true timestamps.
CLOCK_SHIM = '''\
import os, time
_f = os.environ.get("LORAD_SOAK_CLOCK_FILE")
if _f:
    _real, _real_ns, _mono = time.time, time.time_ns, time.monotonic
    _st = [0.0, 0.0]

    def _offset():
        now = _mono()
        if now >= _st[1]:
            _st[1] = now + 0.2
            try:
                with open(_f) as fh:
                    _st[0] = float(fh.read() or 0)
            except (OSError, ValueError):
                pass
        return _st[0]

    time.time = lambda: _real() + _offset()
    time.time_ns = lambda: _real_ns() + int(_offset() * 1e9)
'''


class Tail:
    """A job's events.jsonl read as it grows (from the start again when a power cut shortened it). `fresh` holds
    each event once, when this process first saw it: lines a cut took away and a trainer wrote again are new."""

    def __init__(self, path: Path):
        self.path, self.offset, self.events = path, 0, []
        self.known: set[tuple] = set()
        self.fresh: list[tuple[float, dict[str, Any]]] = []  # (monotonic when first seen, event)

    def poll(self) -> None:
        try:
            size = self.path.stat().st_size
            if size < self.offset:
                self.offset, self.events = 0, []
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return
        whole = data[: data.rfind(b"\n") + 1]
        self.offset += len(whole)
        now = time.monotonic()
        for line in whole.splitlines():
            try:
                e = json.loads(line)
            except ValueError:
                continue  # a torn line after a cut
            self.events.append(e)
            key = (e.get("event"), e.get("ts"), e.get("step"), e.get("from_step"))
            if key not in self.known:
                self.known.add(key)
                self.fresh.append((now, e))

    def last_step(self) -> int:
        """The step the trainer is at: the newest step event (a resumed job counts again from its checkpoint)."""
        return next((e["step"] for e in reversed(self.events) if e.get("event") == "step"), 0)

    def first(self, event: str, after: float) -> tuple[float, dict[str, Any]] | None:
        return next(((t, e) for t, e in self.fresh if t > after and e.get("event") == event), None)


class World:
    def __init__(self, root: Path, config: dict[str, Any], env: dict[str, str]):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.fs = FaultFs(self.root / "fs")
        self.home = self.fs.mount / "home"
        self.sock = self.root / "lorad.sock"
        self.clock_file = self.root / "clock-offset"
        self.clock_file.write_text("0")
        shim = self.root / "shim"
        shim.mkdir(exist_ok=True)
        (shim / "sitecustomize.py").write_text(CLOCK_SHIM)
        self.config_path = self.root / "daemon.yaml"
        # The simulated GPU's faults (bench/soak_faults.py: gpu_lost, xid), outside the power-cut file system.
        self.gpu_faults = self.root / "gpu-faults.json"
        self.xids: list[int] = []  # every Xid raised so far: the simulated device delivers the new ones
        self.set_gpu_faults({})
        telemetry = config.get("power", {}).get("telemetry", {})
        if telemetry.get("backend") == "simulated":
            telemetry["simulated_faults"] = str(self.gpu_faults)
        self.config_path.write_text(yaml.safe_dump({**config, "socket": str(self.sock)}))
        # bench/soak_faults.py's out_of_memory: the running trainer's next step raises a real out-of-memory
        self.oom_trigger = self.root / "oom-now"
        self.env = {**env, "LORAD_SOAK_CLOCK_FILE": str(self.clock_file), "LORAD_DEBUG_OOM_FILE": str(self.oom_trigger),
                    "PYTHONPATH": os.pathsep.join([str(shim), str(REPO), env.get("PYTHONPATH", "")])}
        self.daemon: subprocess.Popen | None = None
        self.instances: list[dict[str, Any]] = []  # each daemon: pid, its RSS and fds when ready and at its end
        self.self_exits = 0
        self.full_hold_s = (1.0, 5.0)  # how long a full disk lasts, drawn from this range
        self.cut_after_commit = 0.5  # how often a power cut waits for the running trainer's next commit
        self.tails: dict[str, Tail] = {}

    def set_gpu_faults(self, faults: dict[str, Any]) -> None:
        tmp = self.gpu_faults.with_suffix(".tmp")
        tmp.write_text(json.dumps(faults))
        os.replace(tmp, self.gpu_faults)  # the daemon never reads half a file

    # ------------------------------------------------------------------ the daemon
    def start(self) -> None:
        self.fs.start()
        (self.home / "soak-staging").mkdir(parents=True, exist_ok=True)
        for d in (self.fs.mount, self.home):  # the home is there for good, as a real one would be
            fd = os.open(d, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
        self.start_daemon()

    def start_daemon(self, timeout: float = 300) -> float:
        """`lorad serve` again; seconds until its socket answers."""
        t0 = time.monotonic()
        # The faults file stays as it was: the new daemon's simulated device, as NVML's event set, delivers no Xid
        # the file listed before it started (daemon/power/simulated.py).
        with open(self.root / "daemon.log", "ab") as log:
            self.daemon = subprocess.Popen(
                [sys.executable, "-m", "daemon.client.cli", "serve", "--home", str(self.home), "--config",
                 str(self.config_path)], stdout=log, stderr=subprocess.STDOUT, env=self.env, cwd=str(REPO),
                start_new_session=True)
        while not self.ping():
            if self.daemon.poll() is not None:
                raise SoakFailure(f"lorad serve exited {self.daemon.returncode} at start:\n{self.log_tail()}")
            if time.monotonic() - t0 > timeout:
                raise SoakFailure(f"lorad serve did not answer within {timeout} s:\n{self.log_tail()}")
            time.sleep(0.05)
        self.instances.append({"pid": self.daemon.pid, "ready": time.monotonic(), "start": self.sample()})
        return time.monotonic() - t0

    def log_tail(self, n: int = 4000) -> str:
        return (self.root / "daemon.log").read_text(errors="replace")[-n:]

    def ping(self) -> bool:
        try:
            self.call(p.Ping(), timeout=5)
            return True
        except (DaemonDown, OSError, RuntimeError):
            return False

    def call(self, req: p.BaseModel, timeout: float = 30) -> dict[str, Any]:
        """One request; `busy` (connections the daemon has not yet seen closed) is tried again, for 15 s at most:
        a daemon still busy then has leaked them."""
        deadline = time.monotonic() + 15
        while True:
            try:
                return Client(self.sock, timeout_s=timeout).call(req)
            except p.ProtocolError as e:
                if e.code != "busy":
                    raise
                if time.monotonic() > deadline:
                    raise SoakFailure(f"the daemon is still busy after 15 s (leaked connections?): {e}") from None
                time.sleep(0.1)

    def check_alive(self) -> None:
        """A daemon that exited on its own is started again, as systemd's Restart=always would, and counted."""
        if self.daemon is not None and self.daemon.poll() is not None:
            self.self_exits += 1
            print(f"  ! lorad serve exited on its own ({self.daemon.returncode}); restarted:\n"
                  f"{self.log_tail(1500)}", flush=True)
            self.start_daemon()

    def sample(self) -> dict[str, int] | None:
        pid = self.daemon.pid if self.daemon else None
        try:
            rss = next(int(ln.split()[1]) for ln in Path(f"/proc/{pid}/status").read_text().splitlines()
                       if ln.startswith("VmRSS:"))
            return {"rss_kib": rss, "fds": len(os.listdir(f"/proc/{pid}/fd"))}
        except (OSError, StopIteration, ValueError):
            return None

    def sample_round(self) -> None:
        """The running daemon's RSS and open files now (at a round's end): a leak shows as a climb."""
        if self.instances and "end" not in self.instances[-1]:
            self.instances[-1].setdefault("rounds", []).append(self.sample())

    def end_instance(self) -> None:
        if self.instances and "end" not in self.instances[-1]:
            self.instances[-1].update(end=self.sample(), ended=time.monotonic())

    # ------------------------------------------------------------------ processes
    def trainers(self):
        return find_trainers(self.home / "jobs") if (self.home / "jobs").exists() else []

    def kill_daemon(self) -> None:
        self.end_instance()
        if self.daemon is not None and self.daemon.poll() is None:
            self.daemon.send_signal(signal.SIGKILL)
            self.daemon.wait(60)

    def kill_trainer(self, sig: int = signal.SIGKILL) -> list[int]:
        pids = [t.pid for t in self.trainers()]
        for pid in pids:
            try:
                os.killpg(pid, sig) if sig == signal.SIGKILL else os.kill(pid, sig)
            except OSError:
                pass
        return pids

    def kill_everything(self) -> None:
        """A power cut's first half: the daemon, its zygote, every trainer and whatever else uses the home."""
        self.end_instance()
        for _ in range(50):
            pids = users_of(self.fs.mount) | ({self.daemon.pid} if self.daemon and self.daemon.poll() is None
                                               else set()) | set(self.kill_trainer())
            pids |= {c for pid in list(pids) for c in descendants(pid)}
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            if self.daemon is not None:
                self.daemon.poll()
            time.sleep(0.05)

    # ------------------------------------------------------------------ jobs
    def tail(self, jid: str) -> Tail:
        if jid not in self.tails:
            self.tails[jid] = Tail(self.home / "jobs" / jid / "events.jsonl")
        return self.tails[jid]

    def next_commit(self, jid: str, timeout: float) -> int | None:
        """Wait for job jid's next `checkpoint_committed` event (its step), polled every 10 ms; None at timeout."""
        t = self.tail(jid)
        t.poll()
        seen, end = len(t.fresh), time.monotonic() + timeout
        while time.monotonic() < end:
            time.sleep(0.01)
            t.poll()
            if step := next((e["step"] for _, e in t.fresh[seen:] if e.get("event") == "checkpoint_committed"), None):
                return step
            seen = len(t.fresh)
        return None

    def jobs(self) -> list[dict[str, Any]]:
        return self.call(p.Status())["jobs"]

    def clock_jump(self, by: float) -> float:
        now = float(self.clock_file.read_text() or 0) + by
        self.fs.clock(now)  # files changed from now on carry the moved time, as they would after a real jump
        self.clock_file.write_text(repr(now))
        return now

    def close(self) -> None:
        self.kill_everything()
        self.fs.stop()


class SoakFailure(Exception):
    pass


def users_of(mount: Path) -> set[int]:
    """Processes with their working directory, an open file or a mapping under mount (not this one)."""
    m, found = str(mount), set()
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == os.getpid():
            continue
        try:
            if os.readlink(f"/proc/{d}/cwd").startswith(m) or any(
                    os.readlink(f"/proc/{d}/fd/{fd}").startswith(m) for fd in os.listdir(f"/proc/{d}/fd")) or \
                    m in Path(f"/proc/{d}/maps").read_text():
                found.add(int(d))
        except OSError:
            continue
    return found


def descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                ppid = int(Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d))
    out, todo = set(), [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            if c not in out:
                out.add(c)
                todo.append(c)
    return out
