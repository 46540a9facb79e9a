"""Opening files in directories others can write: never through a symlink, never blocking, only a regular file of
its own; new files made with O_EXCL under unpredictable names, modes set whatever the umask (issue 23)."""

from __future__ import annotations

import os
import stat
import threading
import time
from pathlib import Path

import pytest

from daemon.store.db import Store
from daemon.supervisor.accepted_job import accepted_doc
from daemon.system import safe_files as sf
from daemon.system.file_tail import tail_lines

VICTIM = b"someone else's file\n"


@pytest.fixture
def victim(tmp_path) -> Path:
    v = tmp_path / "victim"
    v.write_bytes(VICTIM)
    v.chmod(0o600)
    return v


@pytest.fixture
def shared(tmp_path) -> Path:
    """A directory someone else can write (jobs/ID/, rejected/)."""
    d = tmp_path / "shared"
    d.mkdir()
    return d


def under_umask(mask: int, fn):
    old = os.umask(mask)
    try:
        return fn()
    finally:
        os.umask(old)


def test_a_symlink_a_fifo_a_directory_or_a_hard_link_is_refused_and_nothing_blocks(shared, victim):
    (shared / "link").symlink_to(victim)
    os.mkfifo(shared / "fifo")
    (shared / "dir").mkdir()
    os.link(victim, shared / "hardlink")
    t0 = time.monotonic()
    for name in ("link", "fifo", "dir", "hardlink"):
        for flags in (os.O_RDONLY, os.O_WRONLY | os.O_APPEND, os.O_RDWR):
            if name == "dir" and flags != os.O_RDONLY:
                continue
            with pytest.raises(sf.NotRegularFile, match=rf"^{name} "):
                sf.open_file(shared / name, flags)
        with pytest.raises(sf.NotRegularFile):
            sf.append(shared / name, b"x\n")
    assert time.monotonic() - t0 < 1.0  # the FIFO never waited for a writer or a reader
    assert victim.read_bytes() == VICTIM and stat.S_IMODE(victim.stat().st_mode) == 0o600
    (shared / "plain").write_bytes(b"mine\n")
    assert sf.read_bytes(shared / "plain", 100) == b"mine\n"
    assert sf.read_bytes(shared / "plain", 2) == b"min"  # one byte past the limit says it is over


def test_append_and_open_or_create_make_new_files_with_the_mode_asked_whatever_the_umask(shared):
    under_umask(0o000, lambda: sf.append(shared / "events.jsonl", b"a\n", 0o640))
    sf.append(shared / "events.jsonl", b"b\n", 0o600)  # an existing file keeps its mode
    assert (shared / "events.jsonl").read_bytes() == b"a\nb\n"
    assert stat.S_IMODE((shared / "events.jsonl").stat().st_mode) == 0o640
    fd = under_umask(0o077, lambda: sf.open_or_create(shared / "trainer.lock", os.O_RDWR, 0o644))
    os.close(fd)
    assert stat.S_IMODE((shared / "trainer.lock").stat().st_mode) == 0o644


def test_a_durable_write_never_follows_what_is_planted_at_its_names(shared, victim):
    # Every name an attacker could guess: the old fixed temp names, and the final name itself.
    for guess in (f".job.yaml.tmp-{os.getpid()}", ".job.yaml.tmp", "job.yaml"):
        (shared / guess).symlink_to(victim)
    under_umask(0o000, lambda: sf.write_durable(shared / "job.yaml", b"name: x\n", 0o644))
    assert victim.read_bytes() == VICTIM
    assert not (shared / "job.yaml").is_symlink() and (shared / "job.yaml").read_bytes() == b"name: x\n"
    assert stat.S_IMODE((shared / "job.yaml").stat().st_mode) == 0o644  # not 0666 under umask 0
    before = {p.name for p in shared.iterdir()}
    sf.write_durable(shared / "job.yaml", b"name: y\n", 0o644)
    assert {p.name for p in shared.iterdir()} == before  # its temp file is gone: renamed, nothing left behind


def test_the_temp_name_is_unpredictable_and_a_failed_write_leaves_no_temp_file(shared, monkeypatch):
    names = []
    real_open = os.open

    def spy(path, flags, mode=0o777, *, dir_fd=None):
        if flags & os.O_EXCL:
            names.append(path)
        return real_open(path, flags, mode, dir_fd=dir_fd)

    monkeypatch.setattr(os, "open", spy)
    sf.write_durable(shared / "a.txt", b"1", 0o640)
    sf.write_durable(shared / "a.txt", b"2", 0o640)
    assert len(names) == 2 and names[0] != names[1] and str(os.getpid()) not in names[0]

    def full(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError, match="No space"):
        sf.write_durable(shared / "b.txt", b"3", 0o640)
    monkeypatch.undo()
    assert sorted(p.name for p in shared.iterdir()) == ["a.txt"] and (shared / "a.txt").read_bytes() == b"2"


def test_a_mode_is_set_on_the_file_opened_never_on_a_symlinks_target(shared, victim):
    (shared / "job.yaml").symlink_to(victim)
    (shared / "submitted.yaml").write_text("x")
    with sf.opened_dir(shared) as d:
        assert sf.fchmod_at(d, "job.yaml", 0o644) is False
        assert sf.fchmod_at(d, "submitted.yaml", 0o644) is True
        assert sf.fchmod_at(d, "missing.yaml", 0o644) is False
    assert stat.S_IMODE(victim.stat().st_mode) == 0o600
    assert stat.S_IMODE((shared / "submitted.yaml").stat().st_mode) == 0o644


def test_the_tail_of_a_planted_link_is_never_read(shared, victim):
    (shared / "events.jsonl").symlink_to(victim)
    assert tail_lines(shared / "events.jsonl", 1 << 20) is None
    os.mkfifo(shared / "trainer.log")
    assert tail_lines(shared / "trainer.log", 1 << 20) is None  # no writer: never waited for


def test_the_daemon_acts_on_the_job_it_accepted_not_on_what_is_at_job_yaml_now(tmp_path):
    store = Store(tmp_path / "state.db")
    wd = tmp_path / "jobs" / "j-1"
    wd.mkdir(parents=True)
    store.add_job("j-1", "j", wd, 0, 10, "test", text="name: j\nresources: {gpus: 2}\n")
    store.add_job("old-1", "old", wd, 0, 10, "test")  # accepted by a lorad that did not keep the job
    (wd / "job.yaml").write_text("name: j\nresources: {gpus: 8}\n")  # rewritten by the trainer user
    assert accepted_doc(store, store.get("j-1"))["resources"] == {"gpus": 2}
    assert accepted_doc(store, store.get("old-1"))["resources"] == {"gpus": 8}  # only then its job.yaml
    (wd / "job.yaml").unlink()
    os.mkfifo(wd / "job.yaml")
    out: list = []
    t = threading.Thread(target=lambda: out.append(accepted_doc(store, store.get("old-1"))), daemon=True)
    t.start()
    t.join(1.0)
    if t.is_alive():  # free it before failing
        os.close(os.open(wd / "job.yaml", os.O_WRONLY | os.O_NONBLOCK))
    assert out == [{}]  # a FIFO reads as no job (defaults), at once
    store.close()


def test_the_home_and_a_lorad_run_workdir_may_be_reached_through_a_symlink(tmp_path):
    from daemon.system.lock import HomeLock, TrainerLock

    real = tmp_path / "real-home"
    real.mkdir()
    (tmp_path / "home").symlink_to(real)
    for lock in (HomeLock(tmp_path / "home"), TrainerLock(tmp_path / "home", "job")):
        lock.acquire()
        lock.release()
    assert (real / "lorad.lock").is_file() and (real / "trainer.lock").is_file()
    with pytest.raises(OSError):  # jobs/ID/ as a symlink: the daemon's own opens refuse it
        sf.open_or_create(tmp_path / "home" / "trainer.lock", os.O_RDWR, 0o644)
