"""Who `lorad serve` runs as: its own system user (the unit's `User=lorad`), never root outside a container.

Root is needed for one thing only, NVML power limits, and that lives in the power helper
(daemon/power/helper.py, systemd/lorad-power.service). A root daemon would act on paths that less-trusted users
can write (issue 23), so outside a container it refuses with one line. In a container root is often the only
user: there it starts only when the daemon config says `run_as_root: true`, and says so in its log.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

from daemon.config.daemon import ConfigInvalid

REFUSAL = ("lorad serve runs as the lorad user, not root: sudo lorad install-service, then systemctl start lorad "
           "(in a container, set run_as_root: true in the daemon config)")
IN_CONTAINER_NEEDS_KEY = ("running as root in a container: set run_as_root: true in the daemon config to allow it "
                          "(job code then runs as root unless trainer_user names another user)")


DETECT_VIRT = ("systemd-detect-virt", "--container", "--quiet")


def in_container(root: Path = Path("/"), detect_virt: tuple[str, ...] = DETECT_VIRT) -> bool:
    """Docker (/.dockerenv), podman (/run/.containerenv), `container=` in PID 1's environment (systemd-nspawn,
    LXC), or systemd-detect-virt's verdict."""
    if (root / ".dockerenv").exists() or (root / "run/.containerenv").exists():
        return True
    try:
        if any(v.startswith(b"container=") for v in (root / "proc/1/environ").read_bytes().split(b"\0")):
            return True
    except OSError:
        pass  # another user's PID 1: not readable, not an answer
    try:
        return subprocess.run(detect_virt, timeout=5).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def check_daemon_user(euid: int, run_as_root: bool, container: Callable[[], bool] | None = None) -> bool:
    """Raises ConfigInvalid (one line) when this daemon may not run as it is; True: root, allowed explicitly.
    `container` stands in for in_container (tests)."""
    if euid != 0:
        return False
    if not (container or in_container)():
        raise ConfigInvalid(REFUSAL)
    if not run_as_root:
        raise ConfigInvalid(IN_CONTAINER_NEEDS_KEY)
    return True
