"""No code a job names runs as root, and a member of the socket group cannot widen the daemon's policy.

Tests cannot become root: the privilege drop itself is subprocess's (user=, group=, extra_groups=); what is
tested is that a root daemon asks for it, that the files which decide what a trainer does are not writable
by the group, and that the trainer refuses a job.yaml edited after intake to escape the policy.
"""

from __future__ import annotations

import os
import pwd
import re
import stat
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from daemon.config.daemon import ConfigInvalid, DaemonConfig
from daemon.intake.accept import Intake
from daemon.store.db import Store
from daemon.store.state_files import protect_state_db
from daemon.supervisor import trainer
from daemon.supervisor.loop import Supervisor
from daemon.system import trainer_user as trainer_user_mod
from engine.config.job import load_job
from engine.config.policy import JobPolicy
from engine.errors import JobInvalid
from tests.helpers.fakes import RecLog
from tests.helpers.jobs import QUICKSTART_DATA
from tests.helpers.processes import REPO, child_env


def job_text(name: str = "victim") -> str:
    return yaml.safe_dump({"name": name, "model": {"path": "builtin:tiny-llama", "dtype": "float32"},
                           "data": {"path": str(QUICKSTART_DATA), "seq_len": 32}, "train": {"steps": 2}})


@pytest.fixture
def accepted(tmp_path):
    """A job accepted by a daemon whose policy forbids remote code and allows only its home and the data."""
    home = tmp_path / "home"
    home.mkdir()
    cfg = DaemonConfig(allowed_roots=["{home}", str(QUICKSTART_DATA.parent)])
    old = os.umask(0o007)  # the unit's UMask: group-writable unless the daemon sets modes itself
    try:
        protect_state_db(home / "state.db")
        store = Store(home / "state.db")
        out = Intake(home, cfg, store, RecLog()).submit_text("victim.yaml", job_text())
    finally:
        os.umask(old)
    yield SimpleNamespace(home=home, cfg=cfg, store=store, workdir=home / "jobs" / out.job_id)
    store.close()


def the_attack(job_yaml: Path, evil: Path, trust: bool = True) -> None:
    """What a socket-group member did: their own model directory (with its remote code), trust_remote_code on."""
    evil.mkdir(exist_ok=True)
    (evil / "config.json").write_text('{"auto_map": {"AutoModelForCausalLM": "evil.Model"}}')
    (evil / "evil.py").write_text("import os; os.system('id > /tmp/owned')\n")
    job = yaml.safe_load(job_yaml.read_text())
    job["model"]["path"] = str(evil)
    job["model"]["trust_remote_code"] = trust
    job_yaml.write_text(yaml.safe_dump(job))


def test_the_trainer_refuses_a_job_yaml_edited_to_trust_remote_code_in_the_attackers_model(accepted, tmp_path):
    the_attack(accepted.workdir / "job.yaml", tmp_path / "evil")
    # Exactly the argv the daemon gives its trainer (the group cannot change it).
    cmd = Supervisor.trainer_command(SimpleNamespace(cfg=accepted.cfg, home=accepted.home), accepted.workdir)
    assert "--enforce-policy" in cmd
    r = subprocess.run(cmd, cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 65, r.stderr
    assert "model.trust_remote_code" in r.stderr
    assert not (accepted.workdir / "checkpoints").exists()


def test_the_trainer_refuses_a_model_dir_moved_outside_the_allowed_roots(accepted, tmp_path):
    the_attack(accepted.workdir / "job.yaml", tmp_path / "evil", trust=False)
    policy = accepted.cfg.job_policy(accepted.home)
    with pytest.raises(JobInvalid, match=r"^model\.path: .* outside the allowed roots"):
        load_job(accepted.workdir / "job.yaml", policy=policy)
    load_job(accepted.workdir / "job.yaml")  # `lorad run` of one's own file: no daemon policy to enforce


def test_job_files_and_state_db_are_not_writable_by_the_group_whatever_the_umask(accepted):
    def mode(p: Path) -> int:
        return stat.S_IMODE(os.stat(p).st_mode)

    assert mode(accepted.home / "jobs") == 0o750
    assert mode(accepted.workdir) == 0o750
    assert mode(accepted.workdir / "job.yaml") == 0o644
    assert mode(accepted.workdir / "submitted.yaml") == 0o644
    for p in (accepted.home / "state.db", accepted.home / "state.db-wal"):
        assert mode(p) == 0o640, p


class FakePopen:
    calls: list[dict] = []

    def __init__(self, cmd, **kw):
        FakePopen.calls.append(kw)
        self.pid = 1


@pytest.fixture
def fake_popen(monkeypatch):
    FakePopen.calls = []
    monkeypatch.setattr(trainer.subprocess, "Popen", FakePopen)
    return FakePopen.calls


def test_a_root_daemon_starts_trainers_as_trainer_user_and_hands_it_the_job_dir_but_not_job_yaml(
        accepted, fake_popen, monkeypatch):
    try:
        me = pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("no user `nobody` here")
    monkeypatch.setattr(os, "geteuid", lambda: 0)  # the drop itself is subprocess's; here we see it asked for
    # The way in (home, jobs/) with a real second user: tests/daemon/system/test_trainer_user_dirs.py. Here the home
    # is under pytest's root-only temp dir, which `nobody` could never enter.
    monkeypatch.setattr(trainer_user_mod, "way_in", lambda workdir, who: None)
    chowned = []

    def record(p, uid, gid, *, dir_fd=None, follow_symlinks=True):
        assert isinstance(p, int) or not follow_symlinks, "a path re-owned through a symlink"
        name = os.readlink(f"/proc/self/fd/{p}") if isinstance(p, int) else p  # fchown: the directory itself
        chowned.append((Path(name).name, uid, gid))

    monkeypatch.setattr(os, "chown", record)
    monkeypatch.setattr(os, "fchown", lambda fd, uid, gid: record(fd, uid, gid))
    (accepted.workdir / "events.jsonl").write_text("{}\n")  # written by the daemon (root) before the start
    trainer.spawn(["true"], accepted.workdir, {}, lock_fd=os.open(os.devnull, os.O_RDONLY),
                  cfg=DaemonConfig(trainer_user=me.pw_name))
    kw = fake_popen[0]
    assert (kw["user"], kw["group"]) == (me.pw_uid, me.pw_gid)
    assert kw["extra_groups"] == os.getgrouplist(me.pw_name, me.pw_gid)  # its own groups, not root's
    assert kw["umask"] == 0o027
    names = {n for n, _, _ in chowned}
    assert {accepted.workdir.name, "events.jsonl"} <= names
    assert not names & {"job.yaml", "submitted.yaml"}
    # the home's shared latent/text cache (engine/storage/home.py) is the trainer user's to write too
    assert (accepted.home / "cache").is_dir() and ("cache", me.pw_uid, me.pw_gid) in chowned


def test_a_daemon_that_is_not_root_starts_trainers_as_itself_with_their_own_umask(accepted, fake_popen, monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    trainer.spawn(["true"], accepted.workdir, {}, lock_fd=os.open(os.devnull, os.O_RDONLY),
                  cfg=DaemonConfig(trainer_user="lorad"))
    assert "user" not in fake_popen[0] and fake_popen[0]["umask"] == 0o027


def test_a_trainer_user_for_a_root_daemon_exists_and_is_not_root():
    for user, why in (("root", "is root"), ("no-such-user-here", "no user")):
        with pytest.raises(ConfigInvalid, match=rf"^trainer_user: .*{why}"):
            trainer_user_mod.resolve(user, 0)
    assert trainer_user_mod.resolve("root", 1000) is None  # not root: trainers run as the daemon, the key unused
    assert trainer_user_mod.resolve(None, 0) is None  # root in a container without it: as root (logged at start)


def test_before_each_start_job_files_left_group_writable_by_an_older_lorad_are_protected(accepted, fake_popen):
    os.chmod(accepted.workdir, 0o770)  # what the unit's UMask=0007 gave jobs accepted before this check
    for name in ("job.yaml", "submitted.yaml"):
        os.chmod(accepted.workdir / name, 0o660)
    trainer.spawn(["true"], accepted.workdir, {}, lock_fd=os.open(os.devnull, os.O_RDONLY), cfg=DaemonConfig())
    assert stat.S_IMODE(os.stat(accepted.workdir).st_mode) == 0o750
    for name in ("job.yaml", "submitted.yaml"):
        assert stat.S_IMODE(os.stat(accepted.workdir / name).st_mode) == 0o644


TRAINER_READS = [("model", "path"), ("data", "path"), ("data", "validation", "path"), ("data", "masks", "path"),
                 ("data", "regularisation", "path")]


@pytest.mark.parametrize("keys", TRAINER_READS, ids=lambda k: ".".join(k))
def test_every_path_the_trainer_reads_must_lie_under_an_allowed_root(keys, tmp_path):
    inside, outside = tmp_path / "root" / "x", tmp_path / "elsewhere" / "x"
    for d in (inside, outside):
        d.mkdir(parents=True)

    def job(path: Path) -> dict:
        raw: dict = {}
        node = raw
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        node[keys[-1]] = str(path)
        return raw

    policy = JobPolicy(False, (inside.parent,))
    policy.check(job(inside), tmp_path)
    with pytest.raises(JobInvalid, match=rf"^{re.escape('.'.join(keys))}: .*outside the allowed roots"):
        policy.check(job(outside), tmp_path)


# ---------------------------------------------------------------- a tree the trainer user can change (issue 23, finding 3)
def other_group() -> int:
    """A group this process may chown its files to that is not their group now (root: any)."""
    if os.geteuid() == 0:
        return 65534
    others = [g for g in os.getgroups() if g != os.getegid()]
    if not others:
        pytest.skip("needs root or a second group to see a chown happen")
    return others[0]


def test_a_directory_swapped_for_a_symlink_during_hand_over_never_takes_the_walk_outside(accepted, tmp_path,
                                                                                        monkeypatch):
    victims = tmp_path / "root-files"
    victims.mkdir()
    for i in range(5):
        (victims / f"secret{i}").write_text("root's")
    before = {p.name: (p.stat().st_uid, p.stat().st_gid) for p in victims.iterdir()}
    sub = accepted.workdir / "checkpoints"
    (sub / "step-1").mkdir(parents=True)
    (sub / "step-1" / "adapter.safetensors").write_bytes(b"x")
    real_scandir = os.scandir

    def swap_when_listed(arg=None):
        # The trainer user's move, timed to land between the walk seeing `checkpoints` and reading it.
        listed = os.readlink(f"/proc/self/fd/{arg}") if isinstance(arg, int) else os.fspath(arg)
        if Path(listed) == sub and not sub.is_symlink():
            os.rename(sub, accepted.workdir / "moved")
            sub.symlink_to(victims)
        return real_scandir(arg)

    monkeypatch.setattr(os, "scandir", swap_when_listed)
    gid = other_group()
    who = trainer_user_mod.RunAs("trainer", os.geteuid(), gid, (gid,), str(tmp_path))
    trainer_user_mod.hand_over(accepted.workdir, who)
    monkeypatch.undo()
    assert sub.is_symlink()  # the swap happened during the walk
    assert {p.name: (p.stat().st_uid, p.stat().st_gid) for p in victims.iterdir()} == before
    assert os.stat(accepted.workdir / "moved" / "step-1" / "adapter.safetensors").st_gid == gid  # the tree: handed over
    assert os.stat(accepted.workdir / "job.yaml").st_gid != gid  # the daemon's files: not


def test_a_file_swapped_for_a_symlink_while_job_files_are_protected_keeps_the_victims_mode(accepted, tmp_path,
                                                                                          monkeypatch):
    victim = tmp_path / "root-only"
    victim.write_text("root's")
    victim.chmod(0o600)
    job_yaml = accepted.workdir / "job.yaml"
    real_lstat = os.lstat

    def swap_after_check(path, *a, **kw):
        st = real_lstat(path, *a, **kw)
        if Path(path) == job_yaml and not job_yaml.is_symlink():  # checked: a file; then swapped
            job_yaml.unlink()
            job_yaml.symlink_to(victim)
        return st

    monkeypatch.setattr(os, "lstat", swap_after_check)
    trainer_user_mod.protect_job_files(accepted.workdir, 0o750, 0o644)
    monkeypatch.undo()
    assert stat.S_IMODE(victim.stat().st_mode) == 0o600
