"""`lorad install-service`: install systemd/lorad.service with ExecStart pointing at this lorad, create the
`lorad` group and the `lorad` user trainers run as, a first /etc/lorad/daemon.yaml, then enable and start the
unit (root; --dry-run prints the unit and the starter daemon.yaml, changing nothing).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

UNIT_SOURCE = Path(__file__).resolve().parents[2] / "systemd" / "lorad.service"
UNIT_EXE = "/usr/local/bin/lorad"  # the lorad path in the shipped unit's Exec lines
CONFIG_PATH = Path("/etc/lorad/daemon.yaml")
STARTER_CONFIG = """\
# lorad daemon config; every key and its default: configs/daemon.yaml in the source tree
socket_group: lorad          # members of the group lorad may use the socket (usermod -aG lorad USER)
trainer_user: lorad          # trainers run as this user, never as root
allowed_roots: ["{home}", /srv, /data]  # where jobs' models and data may live (readable by trainer_user)
"""
# The unprivileged user trainers run as: no login, its home the unit's ExecStartPre creates.
USERADD = ["useradd", "--system", "--gid", "lorad", "--home-dir", "/var/lib/lorad/trainer", "--no-create-home",
           "--shell", "/usr/sbin/nologin", "--comment", "lorad trainers", "lorad"]


def unit_for(exe: str) -> str:
    """The unit with its Exec lines pointing at `exe`; the comments, which explain that substitution, as shipped."""
    lines = UNIT_SOURCE.read_text().splitlines(keepends=True)
    return "".join(ln.replace(UNIT_EXE, exe) if ln.startswith("Exec") else ln for ln in lines)


def cmd_install_service(args: argparse.Namespace) -> int:
    """Install systemd/lorad.service with ExecStart pointing at this lorad, create group and user, enable it."""
    if not UNIT_SOURCE.is_file():
        print(f"lorad: {UNIT_SOURCE} not found (install-service needs the source checkout; see docs/service-and-cli.md)",
              file=sys.stderr)
        return 1
    exe = shutil.which("lorad") or str(Path(sys.executable).with_name("lorad"))
    unit = unit_for(exe)
    dest = Path(args.dest)
    if args.dry_run:
        print(f"# --- {dest}")
        print(unit, end="")
        print(f"# --- {CONFIG_PATH} (written only if it does not exist)")
        print(STARTER_CONFIG, end="")
        return 0
    if os.geteuid() != 0:
        print("lorad: install-service needs root (sudo lorad install-service)", file=sys.stderr)
        return 1
    dest.write_text(unit)
    print(f"wrote {dest}")
    if not CONFIG_PATH.exists():
        CONFIG_PATH.parent.mkdir(parents=True, exist_ok=True)
        CONFIG_PATH.write_text(STARTER_CONFIG)
        print(f"wrote {CONFIG_PATH} (socket_group and trainer_user: lorad; add your data directories to allowed_roots)")
    if subprocess.run(["getent", "group", "lorad"], capture_output=True).returncode != 0:
        subprocess.run(["groupadd", "--system", "lorad"], check=True)
        print("created group lorad (add users with: usermod -aG lorad USER)")
    if subprocess.run(["getent", "passwd", "lorad"], capture_output=True).returncode != 0:
        subprocess.run(USERADD, check=True)
        print("created user lorad (trainers run as it)")
    if not args.no_enable:
        subprocess.run(["systemctl", "daemon-reload"], check=True)
        subprocess.run(["systemctl", "enable", "--now", "lorad"], check=True)
        print("enabled and started lorad.service (journalctl -u lorad -f)")
    return 0
