"""Processes by pid: identity (pid + start time), discovery of trainers, and stopping a process group.

A pid alone is not an identity (pids are reused after a reboot or a busy
day); the pair (pid, start time in clock ticks since boot, /proc/PID/stat
field 22) is.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path


def _stat_fields(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # The command name (field 2) may contain spaces and parentheses; everything after the last ')' is fixed.
    return raw[raw.rfind(")") + 2:].split()


def start_time(pid: int) -> int | None:
    f = _stat_fields(pid)
    return int(f[19]) if f else None  # field 22 overall; fields[0] here is field 3 (state)


def alive(pid: int | None, started: int | None = None) -> bool:
    """True if `pid` runs (not a zombie) and, when given, started at `started`."""
    if not pid:
        return False
    f = _stat_fields(pid)
    if f is None or f[0] in ("Z", "X"):
        return False
    return started is None or int(f[19]) == started


@dataclass
class Trainer:
    pid: int
    start: int
    workdir: Path


def parent_pid(pid: int) -> int | None:
    f = _stat_fields(pid)
    return int(f[1]) if f else None  # field 4 overall


WARM_TRAINER_MODULE = "daemon.supervisor.zygote"


def _trainer_workdir(pid: int, args: list[str]) -> Path | None:
    """The job directory of a trainer, from its command line: `engine.run ... --workdir DIR`; or, for a trainer
    forked by the warm trainer (whose command line stays the zygote's), its working directory, which the fork set
    to the job's. None if the process is neither (a zygote itself works in the repository, not under jobs/)."""
    if "engine.run" in args and "--workdir" in args:
        i = args.index("--workdir")
        return Path(args[i + 1]) if i + 1 < len(args) else None
    if WARM_TRAINER_MODULE in args:
        try:
            return Path(os.readlink(f"/proc/{pid}/cwd"))
        except OSError:
            return None
    return None


def find_trainers(jobs_root: Path) -> list[Trainer]:
    """Live trainers whose job directory lies under jobs_root (a previous daemon's orphans): `engine.run`
    processes by their --workdir, warm ones (daemon/supervisor/zygote.py) by their working directory.

    A trainer's child between its fork and its exec (subprocess running `ldconfig -p` for a library lookup,
    say) still shows the trainer's command line: it is part of that trainer, not a second one.
    """
    found: dict[int, Trainer] = {}
    jobs_root = Path(jobs_root).resolve()
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == os.getpid():
            continue
        try:
            argv = Path(f"/proc/{d}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        args = [a.decode(errors="replace") for a in argv if a]
        wd = _trainer_workdir(int(d), args)
        if wd is None or jobs_root not in wd.resolve().parents:
            continue
        st = start_time(int(d))
        if st is not None and alive(int(d)):
            found[int(d)] = Trainer(int(d), st, wd.resolve())
    return [t for t in found.values() if parent_pid(t.pid) not in found]


def signal_group(pid: int, sig: int) -> None:
    """Signal the process group the trainer leads (it was started in a session of its own)."""
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass
    except PermissionError:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def visible_devices_of(pid: int) -> list[int] | None:
    """The GPUs a process was given (CUDA_VISIBLE_DEVICES in /proc/PID/environ); None if unknown or not set."""
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for kv in env:
        if kv.startswith(b"CUDA_VISIBLE_DEVICES="):
            try:
                return [int(x) for x in kv.split(b"=", 1)[1].split(b",") if x.strip()]
            except ValueError:
                return None
    return None


def stop_all_and_wait(targets: dict[int, int | None], grace_s: float, kill_wait_s: float,
                      poll_s: float = 0.1) -> tuple[set[int], set[int]]:
    """SIGTERM every group first, then wait for all of them together: one grace_s in all, not one each.

    targets: pid → start time (None: any). What still runs at the deadline is SIGKILLed, and waited for at most
    kill_wait_s more: a process in an uninterruptible call (a hung driver) never dies, and the daemon must still
    start. Returns (the pids that were SIGKILLed, those of them still alive at the end: stuck).
    """
    live = {pid: st for pid, st in targets.items() if alive(pid, st)}
    for pid in live:
        signal_group(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while live and time.monotonic() < deadline:
        live = {pid: st for pid, st in live.items() if alive(pid, st)}
        if live:
            time.sleep(poll_s)
    live = {pid: st for pid, st in live.items() if alive(pid, st)}
    for pid in live:
        signal_group(pid, signal.SIGKILL)
    killed = set(live)
    deadline = time.monotonic() + kill_wait_s
    while live and time.monotonic() < deadline:
        live = {pid: st for pid, st in live.items() if alive(pid, st)}
        if live:
            time.sleep(poll_s)
    return killed, {pid for pid, st in live.items() if alive(pid, st)}
