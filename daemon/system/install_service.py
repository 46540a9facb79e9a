"""`lorad install-service`: install systemd/lorad.service (the daemon, as the unprivileged user `lorad`) and
systemd/lorad-power.service (the root power helper) with their Exec lines pointing at this lorad, create the
`lorad` group and system user, a first /etc/lorad/daemon.yaml, then enable and start both units (root;
--dry-run prints both units and the starter daemon.yaml, changing nothing). It refuses, before writing anything,
a lorad that root would run from a path someone other than root may change (the script, its interpreter, lorad's
packages, the import path): the helper unit runs it as root.
"""

from __future__ import annotations

import argparse
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

UNITS = Path(__file__).resolve().parents[2] / "systemd"
UNIT_SOURCE = UNITS / "lorad.service"
HELPER_SOURCE = UNITS / "lorad-power.service"
UNIT_EXE = "/usr/local/bin/lorad"  # the lorad path in the shipped units' Exec lines
CONFIG_PATH = Path("/etc/lorad/daemon.yaml")
STARTER_CONFIG = """\
# lorad daemon config; every key and its default: configs/daemon.yaml in the source tree
socket_group: lorad          # members of the group lorad may use the socket (usermod -aG lorad USER)
allowed_roots: ["{home}", /srv, /data]  # where jobs' models and data may live (readable by the user lorad)
"""
# The daemon's own user: a system user, no login, its home the unit's StateDirectory (systemd creates it).
USERADD = ["useradd", "--system", "--gid", "lorad", "--home-dir", "/var/lib/lorad", "--no-create-home",
           "--shell", "/usr/sbin/nologin", "--comment", "lorad training service", "lorad"]


def unit_for(source: Path, exe: str) -> str:
    """The unit with its Exec lines pointing at `exe`; the comments, which explain that substitution, as shipped."""
    lines = source.read_text().splitlines(keepends=True)
    return "".join(ln.replace(UNIT_EXE, exe) if ln.startswith("Exec") else ln for ln in lines)


def changeable_by_others(path: Path) -> str | None:
    """Why root should not run what lies at PATH: the first of it and its parent directories (and, through a
    symlink, of its target's) that someone other than root owns or may write; None when only root can change it."""
    seen: set[Path] = set()
    todo = [Path(os.path.abspath(path))]
    while todo:
        p = todo.pop()
        for q in [*reversed(p.parents), p]:
            if q in seen:
                continue
            seen.add(q)
            st = os.lstat(q)
            mode = stat.S_IMODE(st.st_mode)
            if st.st_uid != 0:
                return f"{q} is owned by uid {st.st_uid}"
            if stat.S_ISLNK(st.st_mode):
                todo.append(Path(os.path.realpath(q)))  # a link's own mode means nothing; where it leads does
            elif mode & 0o002 or (mode & 0o020 and st.st_gid != 0):
                return f"{q} is writable by {'everyone' if mode & 0o002 else f'group {st.st_gid}'} (mode {mode:04o})"
    return None


def what_root_runs(exe: str) -> list[Path]:
    """What the root power unit would execute or import: lorad's script, the interpreter its #! names, lorad's
    own packages (every file), and the directories on Python's import path."""
    out = [Path(exe)]
    try:
        with open(exe, "rb") as f:
            first = f.readline(4096)
        if first.startswith(b"#!"):
            out.append(Path(first[2:].split()[0].decode(errors="replace")))
    except OSError:
        pass
    top = Path(__file__).resolve().parents[2]
    for package in ("daemon", "engine"):
        for root, dirs, files in os.walk(top / package):
            out += [Path(root, n) for n in dirs + files]
    out += [Path(d) for d in sys.path if d and os.path.isdir(d)]
    return out


def refusal(exe: str) -> str | None:
    """One line saying why install-service will not point a root unit at EXE, or None."""
    for p in what_root_runs(exe):
        if (why := changeable_by_others(p)) is not None:
            return (f"lorad: install-service refused: the root power helper would run {exe}, and {why}: someone other "
                    f"than root could change what root runs; install lorad where only root can write (a root-owned "
                    f"venv, /usr/local) and run install-service from there")
    return None


def cmd_install_service(args: argparse.Namespace) -> int:
    """Install both units with their Exec lines pointing at this lorad, create group and user, enable them."""
    if not (UNIT_SOURCE.is_file() and HELPER_SOURCE.is_file()):
        print(f"lorad: {UNITS}/lorad.service and lorad-power.service not found (install-service needs the source "
              "checkout; see docs/service-and-cli.md)", file=sys.stderr)
        return 1
    exe = shutil.which("lorad") or str(Path(sys.executable).with_name("lorad"))
    dest = Path(args.dest)
    units = {dest: unit_for(UNIT_SOURCE, exe), dest.with_name(HELPER_SOURCE.name): unit_for(HELPER_SOURCE, exe)}
    if args.dry_run:
        for path, text in units.items():
            print(f"# --- {path}")
            print(text, end="")
        print(f"# --- {CONFIG_PATH} (written only if it does not exist)")
        print(STARTER_CONFIG, end="")
        return 0
    if os.geteuid() != 0:
        print("lorad: install-service needs root (sudo lorad install-service)", file=sys.stderr)
        return 1
    if (why := refusal(exe)) is not None:
        print(why, file=sys.stderr)
        return 1
    for path, text in units.items():
        path.write_text(text)
        print(f"wrote {path}")
    if not CONFIG_PATH.exists():
        CONFIG_PATH.parent.mkdir(parents=True, exist_ok=True)
        CONFIG_PATH.write_text(STARTER_CONFIG)
        print(f"wrote {CONFIG_PATH} (socket_group: lorad; add your data directories to allowed_roots)")
    if subprocess.run(["getent", "group", "lorad"], capture_output=True).returncode != 0:
        subprocess.run(["groupadd", "--system", "lorad"], check=True)
        print("created group lorad (add users with: usermod -aG lorad USER)")
    if subprocess.run(["getent", "passwd", "lorad"], capture_output=True).returncode != 0:
        subprocess.run(USERADD, check=True)
        print("created user lorad (the daemon and its trainers run as it)")
    if not args.no_enable:
        subprocess.run(["systemctl", "daemon-reload"], check=True)
        subprocess.run(["systemctl", "enable", "--now", "lorad-power", "lorad"], check=True)
        print("enabled and started lorad-power.service and lorad.service (journalctl -u lorad -f)")
    return 0
