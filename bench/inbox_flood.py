"""An inbox flood against a real `lorad serve`: the gaps between its systemd watchdog pings, and every file taken once.

    .venv/bin/python bench/inbox_flood.py --files 10000

Starts `lorad serve` in a temp home with NOTIFY_SOCKET pointed at a datagram socket of its own (as systemd would,
WATCHDOG_USEC 2 s), lets it settle, then drops N invalid job files into inbox/ at once (the kind that costs the
most: each is claimed, parsed, and rejected with an fsynced error file). It records every WATCHDOG=1 the daemon
sends until all N are in rejected/, and prints the largest gap between pings before, during and after the flood,
and the count of files rejected (each must be rejected exactly once). Issue 23's finding: 10,000 files gave a
22.6 s gap, when the whole loop took them in one tick.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--files", type=int, default=10_000)
    ap.add_argument("--timeout", type=float, default=600.0)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="lorad-flood-"))
    home = root / "home"
    home.mkdir()
    sock_path = str(root / "notify.sock")
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(sock_path)
    notify.settimeout(0.2)
    cfg = {"allowed_roots": ["{home}", str(root)], "tick_s": 0.5, "inbox_settle_s": 0.2, "inbox_rescan_s": 1.0,
           "power": {"telemetry": {"backend": "off"}}, "web": {"listen": "127.0.0.1:0"}, "run_as_root": True,
           "rejected_keep": max(1000, args.files)}  # pruning would otherwise hide rejections from the count
    (root / "daemon.yaml").write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "NOTIFY_SOCKET": sock_path, "WATCHDOG_USEC": "2000000",
           "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    log = open(root / "daemon.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "daemon.client.cli", "serve", "--home", str(home),
                             "--config", str(root / "daemon.yaml")], stdout=log, stderr=subprocess.STDOUT, env=env)
    pings: list[float] = []
    try:
        def listen(until: float) -> None:
            while time.monotonic() < until:
                try:
                    msg = notify.recv(4096).decode()
                except TimeoutError:
                    continue
                if "WATCHDOG=1" in msg.split("\n"):
                    pings.append(time.monotonic())

        listen(time.monotonic() + 8)  # ready, and a few quiet pings
        inbox = home / "inbox"
        t_drop = time.monotonic()
        staging = root / "staging"
        staging.mkdir()
        for i in range(args.files):  # written aside, renamed in: complete files, as a client drops them
            f = staging / f"bad-{i:05d}.yaml"
            f.write_text("name: [unclosed\n")
            os.rename(f, inbox / f.name)
        t_dropped = time.monotonic()
        deadline = t_dropped + args.timeout
        rejected = home / "rejected"
        while time.monotonic() < deadline:
            listen(time.monotonic() + 1)
            if len(list(rejected.glob("*.error.txt"))) >= args.files and not any(inbox.iterdir()):
                break
        t_done = time.monotonic()
        listen(time.monotonic() + 4)
        errors = sorted(p.name for p in rejected.glob("*.error.txt"))
        files = sorted(p.name for p in rejected.iterdir() if not p.name.endswith(".error.txt"))
    finally:
        proc.terminate()
        proc.wait(60)
        log.close()
        notify.close()

    def max_gap(lo: float, hi: float) -> float:
        ts = [t for t in pings if lo <= t <= hi]
        return max((b - a for a, b in zip(ts, ts[1:], strict=False)), default=float("nan"))

    print(f"files dropped: {args.files} in {t_dropped - t_drop:.1f} s; all taken {t_done - t_dropped:.1f} s after")
    print(f"rejected: {len(files)} files, {len(errors)} error files, "
          f"{len(set(files))} distinct (each exactly once: {len(files) == len(set(files)) == args.files})")
    print(f"largest gap between watchdog pings: before {max_gap(0, t_drop):.2f} s, during "
          f"{max_gap(t_drop, t_done):.2f} s, after {max_gap(t_done, float('inf')):.2f} s ({len(pings)} pings)")
    shutil.rmtree(root, ignore_errors=True)
    return 0 if len(files) == args.files else 1


if __name__ == "__main__":
    sys.exit(main())
