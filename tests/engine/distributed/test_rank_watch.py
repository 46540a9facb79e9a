"""A rank's silence is measured on the daemon's monotonic clock, never as an age from the wall clock: a clock jump
neither makes a live rank look hung nor hides a stopped one (bench/soak.py's clock jumps found the first)."""

from __future__ import annotations

import os
from pathlib import Path

from engine.distributed.liveness import RankWatch


def touch(path: Path, mtime_s: float) -> None:
    path.touch()
    os.utime(path, (mtime_s, mtime_s))


def test_a_file_an_hour_old_on_first_sight_is_not_silent(tmp_path):
    # After the wall clock jumped forward an hour, the file touched a second ago reads as an hour old.
    touch(tmp_path / "rank-1.123", 1_000.0)
    w = RankWatch()
    assert w.silent(tmp_path, 60, now=50.0, alive=lambda pid: True) == []


def test_a_file_that_stops_changing_is_silent_after_the_limit_whatever_its_mtime(tmp_path):
    f = tmp_path / "rank-1.123"
    w = RankWatch()
    touch(f, 5_000_000.0)  # from the future: the wall clock jumped back
    assert w.silent(tmp_path, 60, now=0.0, alive=lambda pid: True) == []
    assert w.silent(tmp_path, 60, now=59.0, alive=lambda pid: True) == []
    assert w.silent(tmp_path, 60, now=61.0, alive=lambda pid: True) == [("1", 61.0)]


def test_a_touch_restarts_the_count_and_a_dead_process_is_never_silent(tmp_path):
    f = tmp_path / "rank-2.77"
    w = RankWatch()
    touch(f, 100.0)
    w.silent(tmp_path, 60, now=0.0, alive=lambda pid: True)
    touch(f, 101.0)
    assert w.silent(tmp_path, 60, now=59.0, alive=lambda pid: True) == []  # changed: counted from 59
    assert w.silent(tmp_path, 60, now=100.0, alive=lambda pid: True) == []
    assert w.silent(tmp_path, 60, now=120.0, alive=lambda pid: True) == [("2", 61.0)]
    assert w.silent(tmp_path, 60, now=200.0, alive=lambda pid: pid != 77) == []
