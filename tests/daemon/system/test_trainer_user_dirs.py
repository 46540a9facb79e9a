"""A root daemon (in a container, `run_as_root`) with `trainer_user`, under the unit's umask 0007: its trainer user
can enter the job directory it is handed, and one that cannot is a configuration error, not a crash to retry
(issue 38, H). Real processes as a second user (`lorad-test`, created once; the test skips without root).

Before, the home came out 0770 and jobs/ 0750, both root's: every start died entering the job directory
(PermissionError in the fork server's os.chdir) and was retried as a crash until the job failed.
"""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

import pytest
import yaml

from daemon.config.daemon import DaemonConfig
from daemon.intake.accept import Intake
from daemon.store.db import Store
from daemon.supervisor import trainer
from daemon.supervisor.loop import Supervisor
from tests.e2e.test_unprivileged import open_dir, python_reachable, unprivileged_user  # noqa: F401 - fixtures
from tests.helpers.fakes import RecLog
from tests.helpers.jobs import QUICKSTART_DATA

# What the fork server's child and the engine do first, as the trainer user: enter the job directory by its path.
ENTER = "import os, sys; os.chdir(sys.argv[1]); open('entered', 'w').write(str(os.getuid()))"


def accept(home: Path, cfg: DaemonConfig) -> tuple[Store, Intake, str]:
    """A job accepted by a root daemon whose home and directories were made under the unit's umask."""
    old = os.umask(0o007)
    try:
        home.mkdir()
        store = Store(home / "state.db")
        intake = Intake(home, cfg, store, RecLog())
        job = {"name": "victim", "model": {"path": "builtin:tiny-llama", "dtype": "float32"},
               "data": {"path": str(QUICKSTART_DATA), "seq_len": 32}, "train": {"steps": 2}}
        return store, intake, intake.submit_text("job.yaml", yaml.safe_dump(job)).job_id
    finally:
        os.umask(old)


def test_the_trainer_user_of_a_root_daemon_enters_its_job_directory_under_the_units_umask(
        unprivileged_user, python_reachable, open_dir):  # noqa: F811
    who = unprivileged_user
    cfg = DaemonConfig(allowed_roots=["{home}", str(QUICKSTART_DATA.parent)], trainer_user=who.pw_name,
                       warm_trainer=False)
    store, _intake, jid = accept(open_dir / "home", cfg)
    workdir = open_dir / "home" / "jobs" / jid
    try:
        popen = trainer.spawn([sys.executable, "-c", ENTER, str(workdir)], workdir, dict(os.environ),
                              lock_fd=os.open(os.devnull, os.O_RDONLY), cfg=cfg)
        popen.communicate(timeout=60)
        err = (workdir / "trainer.log").read_text()
        assert popen.returncode == 0, err
        assert (workdir / "entered").read_text() == str(who.pw_uid)
        assert (workdir / "entered").stat().st_uid == who.pw_uid
        jobs, home = (open_dir / "home" / "jobs").stat(), (open_dir / "home").stat()
        assert jobs.st_gid == who.pw_gid and not stat.S_IMODE(jobs.st_mode) & 0o027  # enter, list; never write
        assert stat.S_IMODE(home.st_mode) & 0o007 == stat.S_IXOTH  # search only: the home is never listed
    finally:
        store.close()


def test_a_trainer_user_that_cannot_reach_its_job_directory_fails_the_job_as_a_configuration_error(
        unprivileged_user, python_reachable, open_dir):  # noqa: F811
    who = unprivileged_user
    above = open_dir / "private"  # a directory above the home, not the daemon's to open: root's alone
    above.mkdir(mode=0o700)
    cfg = DaemonConfig(allowed_roots=["{home}", str(QUICKSTART_DATA.parent)], trainer_user=who.pw_name,
                       warm_trainer=False, backoff_base_s=0.1)
    store, intake, jid = accept(above / "home", cfg)
    sup = Supervisor(above / "home", cfg, store, [None], RecLog(), intake=intake)
    sup.trainer_command = lambda workdir: [sys.executable, "-c", ENTER, str(workdir)]
    try:
        sup.tick()
        job = store.get(jid)
        assert not sup.children
        assert job["state"] == "failed", job  # not queued again: every retry would fail the same way
        assert job["last_error"].startswith("could not start the trainer: configuration error: trainer_user "
                                             f"{who.pw_name} cannot enter {above} ")
        assert "chmod o+x" in job["last_error"] and "\n" not in job["last_error"]
        assert stat.S_IMODE(above.stat().st_mode) == 0o700  # above the home: said, never changed
    finally:
        store.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="becoming another user needs root")
def test_a_forked_trainer_that_cannot_enter_its_job_directory_exits_as_an_invalid_job_saying_why(tmp_path):
    # The fork server's child enters the job directory as the trainer user; should that still fail (a home
    # changed after the check), it is said in one line and exits 65: failed, never retried as a crash.
    from daemon.supervisor import zygote
    from daemon.supervisor.exit_policy import decide_exit

    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: as `nobody`, then what the zygote does for a request
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            req = {"umask": 0o027, "lock_fd": 9, "cwd": str(private), "env": {}, "argv": ["python", "-m", "x"]}
            zygote._child(req, [os.open(os.devnull, os.O_WRONLY), w, os.open(os.devnull, os.O_RDONLY)])
        finally:
            os._exit(99)
    os.close(w)
    with os.fdopen(r) as f:
        said = f.read()
    code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    assert code == 65, said
    (line,) = said.splitlines()
    assert line == f"configuration error: the trainer (uid 65534) cannot enter its job directory {private}: " \
                   "Permission denied"
    decided = decide_exit(code, None, 0, DaemonConfig(), line)
    assert decided.state == "failed" and "configuration error" in decided.reason
