"""`lorad serve` as an unprivileged system user, as the unit runs it (User=lorad): a job dropped into its inbox
trains to success, its trainer runs as that user, and what root owns beside the daemon's home stays as it was.

The user is created here (`useradd --system lorad-test`, once, when root and absent); without root there is no
second user to become, and the test skips.
"""

from __future__ import annotations

import os
import pwd
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

import pytest

from tests.helpers.daemon import Daemon, daemon_job, fast_config, wait_until, write_yaml
from tests.helpers.processes import REPO

USER = "lorad-test"


@pytest.fixture(scope="session")
def unprivileged_user() -> pwd.struct_passwd:
    if os.geteuid() != 0:
        pytest.skip("creating and becoming a second user needs root")
    try:
        return pwd.getpwnam(USER)
    except KeyError:
        pass
    r = subprocess.run(["useradd", "--system", "--no-create-home", "--home-dir", "/nonexistent",
                        "--shell", "/usr/sbin/nologin", USER], capture_output=True, text=True)
    if r.returncode not in (0, 9):  # 9: created meanwhile by another run
        pytest.skip(f"useradd {USER} failed: {r.stderr.strip()}")
    return pwd.getpwnam(USER)


@pytest.fixture
def python_reachable():
    """The user must be able to run this Python: a directory on its way that others cannot enter (pyenv under a
    0700 /root, as on the test containers) is opened for traversal only (o+x, no listing) for this test."""
    import sys

    opened = []
    for exe in {Path(sys.executable).resolve(), Path(sys.prefix).resolve(), REPO.resolve()}:
        for d in reversed(exe.parents):
            mode = d.stat().st_mode
            if d.is_dir() and not mode & stat.S_IXOTH:
                opened.append((d, stat.S_IMODE(mode)))
                d.chmod(stat.S_IMODE(mode) | stat.S_IXOTH)
    try:
        yield
    finally:
        for d, mode in opened:
            d.chmod(mode)


@pytest.fixture
def open_dir():
    """Root's directory the user can enter and read (pytest's own temp dir is root's alone)."""
    d = Path(tempfile.mkdtemp(prefix="lorad-unpriv-"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_lorad_serve_as_an_unprivileged_user_trains_a_job_as_that_user_and_leaves_roots_files_alone(
        unprivileged_user, python_reachable, open_dir, micro_model):
    who = unprivileged_user
    model = Path(shutil.copytree(micro_model, open_dir / "model"))  # readable by the user, owned by root
    for p in [model, *model.iterdir()]:
        p.chmod(0o755 if p.is_dir() else 0o644)
    secret = open_dir / "root-secret"
    secret.write_text("root's alone\n")
    secret.chmod(0o600)
    before = secret.stat()
    home = open_dir / "home"
    home.mkdir(mode=0o750)
    os.chown(home, who.pw_uid, who.pw_gid)
    # run_as_root false, as shipped: the refusal never applies to a daemon that is not root
    d = Daemon(home, fast_config(open_dir, run_as_root=False,
                                 allowed_roots=["{home}", str(open_dir), str(REPO)]), HOME=str(home))
    d.run_as = {"user": who.pw_uid, "group": who.pw_gid, "extra_groups": []}
    try:
        d.start()
        job = write_yaml(open_dir / "job.yaml", daemon_job(model, steps=4, every=4, name="unpriv"))
        shutil.copy(job, home / "inbox" / "unpriv.yaml")
        (jid,) = wait_until(lambda: [j["id"] for j in d.jobs()], 30, "the job to be accepted")
        j = d.wait_state(jid, {"succeeded", "failed"}, 120)
        assert j["state"] == "succeeded", d.log()[-3000:]
        workdir = home / "jobs" / jid
        made_by_trainer = [workdir / "events.jsonl", *(workdir / "output").iterdir()]
        assert made_by_trainer and {p.stat().st_uid for p in made_by_trainer} == {who.pw_uid}
        assert (home / "state.db").stat().st_uid == who.pw_uid
        assert d.terminate(60) == 0
    finally:
        d.cleanup()
    after = secret.stat()
    assert secret.read_text() == "root's alone\n"
    assert (after.st_uid, stat.S_IMODE(after.st_mode), after.st_mtime_ns) == (0, 0o600, before.st_mtime_ns)
    assert (model / "config.json").stat().st_uid == 0
