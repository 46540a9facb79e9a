"""Who a trainer runs as: never root. A daemon running as root starts every trainer as `trainer_user`.

A job names code (a model's remote code, a data loader's files, pickles in a checkpoint): whatever it runs,
it runs as an unprivileged user. Only what needs root stays in the daemon (NVML power limits). The drop is
subprocess's own: setgid, setgroups (the user's groups, as initgroups would give) and setuid in the child
between fork and exec. The job's directory is handed to that user (it writes checkpoints, output and events
there), except job.yaml and submitted.yaml, which stay the daemon's (see daemon/intake/accept.py), and so is the
home's shared cache directory (HOME/cache; the entries in it are each their writer's).

A daemon that is not root runs trainers as its own user; trainer_user is then not used.
"""

from __future__ import annotations

import os
import pwd
import stat
from dataclasses import dataclass
from pathlib import Path

from daemon.config.daemon import ConfigInvalid
from engine.storage.home import cache_dir

DAEMON_OWNED = ("job.yaml", "submitted.yaml")  # what decides what the trainer does: not the trainer user's


@dataclass(frozen=True)
class RunAs:
    name: str
    uid: int
    gid: int
    groups: tuple[int, ...]
    home: str

    def popen_kwargs(self) -> dict:
        return {"user": self.uid, "group": self.gid, "extra_groups": list(self.groups)}

    def env(self) -> dict[str, str]:
        return {"HOME": self.home, "USER": self.name, "LOGNAME": self.name}


def resolve(trainer_user: str | None, euid: int) -> RunAs | None:
    """The user a root daemon (euid 0) starts trainers as; None: as the daemon itself. ConfigInvalid names the key."""
    if euid != 0 or not trainer_user:
        return None
    try:
        pw = pwd.getpwnam(trainer_user)
    except KeyError:
        raise ConfigInvalid(f"trainer_user: no user {trainer_user!r} on this machine (create it: useradd --system "
                            f"--gid lorad --home-dir /var/lib/lorad/trainer --shell /usr/sbin/nologin {trainer_user})") from None
    if pw.pw_uid == 0:
        raise ConfigInvalid(f"trainer_user: {trainer_user!r} is root (uid 0); trainers must run unprivileged")
    return RunAs(pw.pw_name, pw.pw_uid, pw.pw_gid, tuple(os.getgrouplist(pw.pw_name, pw.pw_gid)), pw.pw_dir)


def check_at_start(trainer_user: str | None, euid: int, allow_root: bool) -> RunAs | None:
    """`lorad serve`'s check: a root daemon has an unprivileged trainer_user, or was told so explicitly.

    allow_root (`allow_root_trainers: true`) is the explicit opt-out for machines where root is the only user
    (a container, a CI runner); it never applies when trainer_user is set.
    """
    if euid == 0 and not trainer_user and not allow_root:
        raise ConfigInvalid("trainer_user: required when the daemon runs as root, so that no job's code runs as "
                            "root (e.g. trainer_user: lorad; `lorad install-service` creates that user)")
    return resolve(trainer_user, euid)


def protect_job_files(workdir: Path, dir_mode: int, file_mode: int) -> None:
    """Before every start: the job's directory and the files that decide what its trainer does are not writable
    by the group, whatever made them (jobs accepted by an older lorad under the unit's UMask=0007 were)."""
    workdir = Path(workdir)
    os.chmod(workdir, dir_mode)
    for name in DAEMON_OWNED:
        try:
            if stat.S_ISREG(os.lstat(workdir / name).st_mode):  # a symlink in its place is never followed
                os.chmod(workdir / name, file_mode)
        except FileNotFoundError:
            pass


def hand_over(workdir: Path, who: RunAs) -> None:
    """Give the job's directory and what is in it to the trainer user, except the files the daemon decides.

    lchown: a symlink in the directory is re-owned itself, never what it points to.
    """
    workdir = Path(workdir)
    os.lchown(workdir, who.uid, who.gid)
    # The home's shared content-keyed cache (engine/storage/home.py): the trainer user writes its entries there too.
    shared = cache_dir(workdir)
    if shared.parent != workdir.resolve():
        shared.mkdir(mode=0o750, exist_ok=True)
        os.lchown(shared, who.uid, who.gid)
    for root, dirs, files in os.walk(workdir):
        for name in dirs + files:
            if Path(root) == workdir and name in DAEMON_OWNED:
                continue
            os.lchown(os.path.join(root, name), who.uid, who.gid)
