"""Who a trainer runs as: the daemon's own user (`lorad`, daemon/system/privilege.py), or, for a root daemon in a
container (`run_as_root: true`), `trainer_user` when it names one.

A job names code (a model's remote code, a data loader's files, pickles in a checkpoint): whatever it runs,
it runs as the daemon's user, or the trainer user a root daemon drops to. The drop is
subprocess's own: setgid, setgroups (the user's groups, as initgroups would give) and setuid in the child
between fork and exec. The job's directory is handed to that user (it writes checkpoints, output and events
there), except job.yaml and submitted.yaml, which stay the daemon's (see daemon/intake/accept.py), and so is the
home's shared cache directory (HOME/cache; the entries in it are each their writer's).

A daemon that is not root runs trainers as its own user; trainer_user is then not used. Without trainer_user
a root daemon (only ever in a container, said in its log at start) runs job code as root.
"""

from __future__ import annotations

import os
import pwd
import stat
from dataclasses import dataclass
from pathlib import Path

from daemon.config.daemon import ConfigInvalid
from daemon.system.safe_files import fchmod_at, opened_dir
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
    """The user a root daemon (euid 0) starts trainers as; None: as the daemon itself. ConfigInvalid names the key.

    `lorad serve` calls it once at start, so that a wrong name stops it with exit 78 rather than every start."""
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


def protect_job_files(workdir: Path, dir_mode: int, file_mode: int) -> None:
    """Before every start: the job's directory and the files that decide what its trainer does are not writable
    by the group, whatever made them (jobs accepted by an older lorad under the unit's UMask=0007 were).

    Through descriptors: the trainer user may swap a file for a symlink at any moment, and a mode is only ever
    set on the file that was opened (never through a symlink; safe_files.fchmod_at).
    """
    with opened_dir(Path(workdir)) as d:
        os.fchmod(d, dir_mode)
        for name in DAEMON_OWNED:
            fchmod_at(d, name, file_mode)


def hand_over(workdir: Path, who: RunAs) -> None:
    """Give the job's directory and what is in it to the trainer user, except the files the daemon decides.

    The trainer user owns the tree from its first start and may swap a directory for a symlink while it is
    walked: os.fwalk holds each directory by a descriptor (and skips one that is not what was listed), and every
    entry is re-owned relative to its directory's descriptor without following a symlink (fchownat with
    AT_SYMLINK_NOFOLLOW), so the walk never leaves the tree. A hard link to someone else's file cannot be made
    there where fs.protected_hardlinks is on (every current distribution's default).
    """
    workdir = Path(workdir)
    with opened_dir(workdir) as d:
        os.fchown(d, who.uid, who.gid)
    # The home's shared content-keyed cache (engine/storage/home.py): the trainer user writes its entries there too.
    shared = cache_dir(workdir)
    if shared.parent != workdir.resolve():
        shared.mkdir(mode=0o750, exist_ok=True)
        os.chown(shared, who.uid, who.gid, follow_symlinks=False)  # HOME/cache: in the daemon's home
    for root, dirs, files, root_fd in os.fwalk(workdir, follow_symlinks=False):
        top = Path(root) == workdir
        for name in dirs + files:
            if top and name in DAEMON_OWNED:
                continue
            try:
                os.chown(name, who.uid, who.gid, dir_fd=root_fd, follow_symlinks=False)
            except FileNotFoundError:
                pass  # removed by the trainer user meanwhile


def may_search(st: os.stat_result, who: RunAs) -> bool:
    """Whether WHO may enter a directory of this stat (the permission bits that apply to it, as the kernel picks)."""
    if st.st_uid == who.uid:
        return bool(st.st_mode & stat.S_IXUSR)
    if st.st_gid == who.gid or st.st_gid in who.groups:
        return bool(st.st_mode & stat.S_IXGRP)
    return bool(st.st_mode & stat.S_IXOTH)


def way_in(workdir: Path, who: RunAs) -> str | None:
    """Before every start: the trainer user gets a way into its job directory, whatever umask made the daemon's
    directories (a root daemon under the unit's UMask=0007 makes its home 0770 and jobs/ 0750, root's): the home
    gets search permission only (o+x: enter, never list), jobs/ the user's group (enter and list, never write).
    Nothing is taken from anyone. None when the user can now reach its job directory; else why not, in one line:
    a configuration error (a directory above the home it cannot enter), not a crash to retry."""
    workdir = Path(workdir)
    with opened_dir(workdir.parent.parent, follow=True) as d:  # the home: the daemon's own (maybe through a link)
        st = os.fstat(d)
        if not may_search(st, who):
            os.fchmod(d, stat.S_IMODE(st.st_mode) | stat.S_IXOTH)
    with opened_dir(workdir.parent) as d:  # HOME/jobs: the daemon's, never a symlink
        st = os.fstat(d)
        if not may_search(st, who):
            os.fchown(d, -1, who.gid)
            os.fchmod(d, (stat.S_IMODE(st.st_mode) | stat.S_IRGRP | stat.S_IXGRP) & ~stat.S_IWGRP)
    for p in [*reversed(workdir.parents), workdir]:
        try:
            st = os.stat(p)
        except OSError as e:
            return f"configuration error: trainer_user {who.name} cannot reach {p} ({e.strerror})"
        if p != workdir and not may_search(st, who):
            return (f"configuration error: trainer_user {who.name} cannot enter {p} (owner {st.st_uid}:{st.st_gid}, "
                    f"mode {stat.S_IMODE(st.st_mode):04o}), on the way to its job directory: give it search "
                    f"permission (chmod o+x {p}) or put the home where it can")
    return None
