"""The power-cut file system (tests/helpers/faultfs.py) the soak runs lorad on: after a cut only what was fsynced
is there (file bytes by a file fsync, names by a directory fsync), a torn write leaves some of the unsynced pages,
and a full disk fails writes with ENOSPC until it is emptied."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from engine.storage.fsio import RealFs, write_file_durable
from tests.helpers.faultfs import PAGE, FaultFs, fuse_usable

pytestmark = pytest.mark.skipif(fuse_usable() is not None, reason=str(fuse_usable()))


@pytest.fixture(scope="module")
def fs(tmp_path_factory):
    f = FaultFs(tmp_path_factory.mktemp("faultfs")).start()
    yield f
    f.stop()


def write(path: Path, data: bytes, sync: bool = False) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, data)
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    RealFs().fsync_dir(path)


def test_a_cut_keeps_synced_files_under_synced_names_and_nothing_else(fs):
    d = fs.mount / "a"
    d.mkdir()
    fsync_dir(fs.mount)
    write(d / "kept", b"synced", sync=True)
    write(d / "empty", b"written, never synced")
    fsync_dir(d)
    write(d / "nameless", b"synced, its name never", sync=True)
    write(d / "kept", b"an unsynced overwrite")
    fs.cut()
    assert sorted(p.name for p in d.iterdir()) == ["empty", "kept"]
    assert (d / "kept").read_bytes() == b"synced"
    assert (d / "empty").read_bytes() == b""  # its name was durable, its bytes were not


def test_a_rename_without_the_directory_fsync_is_lost_and_with_it_kept(fs):
    d = fs.mount / "r"
    d.mkdir()
    fsync_dir(fs.mount)
    write(d / "ckpt", b"old", sync=True)
    fsync_dir(d)
    write(d / "tmp", b"new", sync=True)
    os.rename(d / "tmp", d / "ckpt")
    fs.cut()
    assert (d / "ckpt").read_bytes() == b"old"
    write_file_durable(RealFs(), d / "ckpt", b"new")  # lorad's own atomic write: temp, fsync, rename, dir fsync
    os.unlink(d / "ckpt")  # an unsynced unlink: undone by the cut
    fs.cut()
    assert [p.name for p in d.iterdir()] == ["ckpt"] and (d / "ckpt").read_bytes() == b"new"


def test_a_torn_cut_keeps_some_unsynced_pages_and_none_unwritten(fs):
    p = fs.mount / "torn"
    write(p, b"\0" * (64 * PAGE), sync=True)
    fsync_dir(fs.mount)
    with open(p, "r+b") as f:
        f.write(b"\1" * (64 * PAGE))
    fs.cut(torn=True, seed=1)
    pages = [p.read_bytes()[i * PAGE:(i + 1) * PAGE] for i in range(64)]
    assert set(pages) == {b"\0" * PAGE, b"\1" * PAGE}  # some pages landed, some did not, none half


def test_a_full_disk_fails_writes_and_creates_until_it_is_emptied(fs):
    p = fs.mount / "full"
    write(p, b"x", sync=True)
    fs.full(True)
    try:
        assert os.statvfs(fs.mount).f_bavail == 0
        for act in (lambda: write(p, b"more"), lambda: write(fs.mount / "new", b"")):
            with pytest.raises(OSError) as e:
                act()
            assert e.value.errno == errno.ENOSPC
    finally:
        fs.full(False)
    write(p, b"more", sync=True)
    assert p.read_bytes() == b"more" and os.statvfs(fs.mount).f_bavail > 0


def test_touching_a_file_sets_its_time_to_now(fs):
    """A trainer's liveness file is touched (utime, UTIME_NOW): the daemon reads its age from the mtime."""
    import time

    p = fs.mount / "alive"
    write(p, b"")
    os.utime(p, ns=(0, 0))
    os.utime(p)
    assert abs(os.stat(p).st_mtime - time.time()) < 5


def test_a_moved_clock_stamps_what_changes_from_then_on_and_nothing_before(fs):
    import time

    before, after = fs.mount / "before", fs.mount / "after"
    write(before, b"")
    fs.clock(3600)
    try:
        write(after, b"x")
        assert abs(os.stat(after).st_mtime - (time.time() + 3600)) < 5
        assert abs(os.stat(before).st_mtime - time.time()) < 5
        os.utime(before)  # touched: the moved clock's now
        assert abs(os.stat(before).st_mtime - (time.time() + 3600)) < 5
    finally:
        fs.clock(0)
