"""A disk that fills during a save: the previous checkpoint stands, the job exits 74 with one clear line."""

from __future__ import annotations

import errno
import re
from pathlib import Path

import pytest

from engine.checkpoint.store import CheckpointStore
from engine.config.job import load_job
from engine.recipe import train
from engine.storage.fsio import RealFs
from tests.helpers.jobs import read_events


class FillingFs(RealFs):
    """Real file operations on a disk that has `free` bytes left once `commits` checkpoints are in place.

    Like a real full disk, the write that crosses the limit stores what fits and then fails with ENOSPC.
    """

    def __init__(self, commits: int, free: int):
        self.commits_left = commits
        self.free = free

    def rename(self, src: Path, dst: Path) -> None:
        super().rename(src, dst)
        if Path(dst).name.startswith("step-"):
            self.commits_left -= 1

    def write(self, path: Path, chunks) -> int:
        if self.commits_left > 0:
            return super().write(path, chunks)
        data = b"".join(bytes(c) for c in chunks)
        fits = data[: max(0, self.free)]
        with open(path, "wb") as f:
            f.write(fits)
        self.free -= len(fits)
        if len(fits) < len(data):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return len(data)


@pytest.mark.parametrize("commits, kept", [(1, "step-00000004"), (0, None)], ids=["after-first-save", "first-save"])
def test_disk_full_during_a_save_keeps_the_previous_checkpoint_and_exits_74(
    write_job, tmp_path, capfd, commits, kept
):
    cfg = load_job(write_job(train={"steps": 12}, checkpoint={"every_steps": 4}))
    wd = tmp_path / "work"
    fs = FillingFs(commits=commits, free=3000)

    rc = train(cfg, wd, progress="none", fs=fs)

    err = capfd.readouterr().err
    assert rc == 74
    assert "Traceback" not in err
    lines = [ln for ln in err.splitlines() if ln.startswith("lorad:")]
    assert len(lines) == 1, err
    assert "disk full" in lines[0] and "MiB free" in lines[0]
    # Which step's save hits the full disk depends on when the background writer finished the one before.
    failed = re.search(r"saving checkpoint step-(\d{8})", lines[0])
    assert failed and int(failed.group(1)) > (int(kept[5:]) if kept else 0)
    assert (f"previous checkpoint {kept} is intact" if kept else "no earlier checkpoint") in lines[0]

    events = read_events(wd)
    assert events[-1]["event"] == "disk_error" and events[-1]["message"] == lines[0].removeprefix("lorad: ")
    store = CheckpointStore(wd / "checkpoints", cfg.identity_hash(), keep=3)
    loaded, skipped = store.load_latest()
    assert skipped == []
    assert (loaded.step if loaded else None) == (int(kept[5:]) if kept else None)
    # The half-written save was cleaned up, not left to be mistaken for a checkpoint.
    assert not [p for p in (wd / "checkpoints").iterdir() if ".tmp-" in p.name]


def test_an_unusable_job_directory_is_exit_74_with_one_line(write_job, tmp_path, capfd):
    cfg = load_job(write_job())
    (tmp_path / "not-a-dir").write_text("a file where the job directory's parent should be")
    rc = train(cfg, tmp_path / "not-a-dir" / "work", progress="none")
    err = capfd.readouterr().err
    assert rc == 74
    assert "Traceback" not in err
    lines = [ln for ln in err.splitlines() if ln.startswith("lorad:")]
    assert len(lines) == 1 and "cannot create the job directory" in lines[0] and "not-a-dir" in lines[0]
