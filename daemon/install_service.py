"""`lorad install-service`: install systemd/lorad.service with ExecStart pointing at this lorad, create the
`lorad` group and a first /etc/lorad/daemon.yaml, then enable and start the unit (root; --dry-run prints it).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

UNIT_SOURCE = Path(__file__).resolve().parents[1] / "systemd" / "lorad.service"


def cmd_install_service(args: argparse.Namespace) -> int:
    """Install systemd/lorad.service with ExecStart pointing at this lorad, create the group, enable it."""
    src = UNIT_SOURCE
    if not src.is_file():
        print(f"lorad: {src} not found (install-service needs the source checkout; see README 'The service')",
              file=sys.stderr)
        return 1
    exe = shutil.which("lorad") or str(Path(sys.executable).with_name("lorad"))
    unit = src.read_text().replace("/usr/local/bin/lorad", exe)
    dest = Path(args.dest)
    if args.dry_run:
        print(unit, end="")
        return 0
    if os.geteuid() != 0:
        print("lorad: install-service needs root (sudo lorad install-service)", file=sys.stderr)
        return 1
    dest.write_text(unit)
    print(f"wrote {dest}")
    conf = Path("/etc/lorad/daemon.yaml")
    if not conf.exists():
        conf.parent.mkdir(parents=True, exist_ok=True)
        conf.write_text("# lorad daemon config; every key and its default: configs/daemon.yaml in the source tree\n"
                        "socket_group: lorad\nallowed_roots: [\"{home}\", /srv, /data]\n")
        print(f"wrote {conf} (socket_group: lorad; add your data directories to allowed_roots)")
    steps = [["getent", "group", "lorad"]]
    if subprocess.run(steps[0], capture_output=True).returncode != 0:
        subprocess.run(["groupadd", "--system", "lorad"], check=True)
        print("created group lorad (add users with: usermod -aG lorad USER)")
    if not args.no_enable:
        subprocess.run(["systemctl", "daemon-reload"], check=True)
        subprocess.run(["systemctl", "enable", "--now", "lorad"], check=True)
        print("enabled and started lorad.service (journalctl -u lorad -f)")
    return 0
