"""The downsampled series behind the job page's charts: bounded however many steps, exact while few, every
bucket's minimum and maximum kept at its own step; and the history reader's bounds on what a trainer writes."""

from __future__ import annotations

import json
import os
import random

from daemon.web.downsample import Downsampled, mean_near
from daemon.web.history import MAX_LINE, Series
from tests.helpers.web import step_line


def test_a_short_series_is_kept_exactly():
    d = Downsampled(capacity=50)
    pairs = [(s, 1.0 / s) for s in range(1, 51)]
    for s, v in pairs:
        d.add(s, v)
    assert d.points() == pairs and d.width == 1
    for s in range(51, 100):  # up to twice the capacity: buckets of two steps, each drawn as its min and max
        d.add(s, 1.0 / s)
    assert d.points() == [(s, 1.0 / s) for s in range(1, 100)] and d.width == 2


def test_a_long_series_stays_bounded_with_every_bucket_s_exact_min_and_max_at_its_step():
    rnd = random.Random(3)
    d = Downsampled(capacity=100)
    values = {s: rnd.gauss(0.0, 1.0) for s in range(200_000)}
    values[123_457] = 50.0  # one spike in the middle of a bucket
    for s, v in values.items():
        d.add(s, v)
    assert len(d.buckets) <= 100 and d.count == len(values)
    pts = d.points()
    assert len(pts) <= 200
    steps = [s for s, _ in pts]
    assert steps == sorted(steps) and len(set(steps)) == len(steps)  # monotone: a polyline from left to right
    assert (123_457, 50.0) in pts and (min(values, key=values.get), min(values.values())) in pts
    for bk in d.buckets:  # each bucket against a brute-force pass over its steps
        mine = {s: values[s] for s in range(bk.start, bk.start + d.width) if s in values}
        assert (bk.lo_step, bk.lo) == min(mine.items(), key=lambda kv: kv[1])
        assert (bk.hi_step, bk.hi) == max(mine.items(), key=lambda kv: kv[1])
        assert abs(bk.mean - sum(mine.values()) / len(mine)) < 1e-9
    first = 123_457 - 123_457 % d.width
    assert mean_near(d.means(), 123_457) == next(bk.mean for bk in d.buckets if bk.start == first)
    assert mean_near(d.means(), -1) is None


def test_a_resumed_run_s_reports_replace_the_earlier_ones_from_its_resume_point():
    d = Downsampled(capacity=10)
    for s in range(1, 9):
        d.add(s, 1.0)
    for s in range(5, 7):  # resumed from the checkpoint at step 4
        d.add(s, 2.0)
    assert d.points() == [(1, 1.0), (2, 1.0), (3, 1.0), (4, 1.0), (5, 2.0), (6, 2.0)]
    long = Downsampled(capacity=10)
    for s in range(1000):
        long.add(s, 1.0)
    long.add(500, 9.0)
    assert max(s for s, _ in long.points()) == 500 and long.count <= 501


def test_sparse_and_far_apart_steps_still_fit():
    d = Downsampled(capacity=8)
    for k in range(40):
        d.add(2**k, float(k))
    assert len(d.buckets) <= 8 and d.count == 40 and (2**39, 39.0) in d.points()


def test_what_a_trainer_writes_is_checked_before_it_is_drawn(tmp_path):
    lines = [step_line(1, 1.0, 1.0), '{"event": "step", "step": 2, "loss": "nan please", "lr": true}\n',
             '{"event": "step", "step": 10000000000000000000000, "loss": 1.0}\n',
             '{"event": "step", "step": true, "loss": 1.0}\n', '{"event": "step", "step": 3, "loss": NaN}\n',
             '{"event": "step", "step": 4, "lo' + "o" * (MAX_LINE + 10) + '\n', step_line(5, 0.5, 5.0), "[1, 2]\n",
             '{"event": "checkpoint_committed", "step": 5, "path": ["x"], "seconds": "slow"}\n']
    (tmp_path / "events.jsonl").write_text("".join(lines))
    s = Series()
    s.catch_up(tmp_path, 1 << 30)
    assert s.loss.points() == [(1, 1.0), (5, 0.5)] and s.lr.points() == [(1, 0.001), (5, 0.005)]
    assert s.offset == (tmp_path / "events.jsonl").stat().st_size and not s._partial  # the long line was dropped
    assert s.checkpoints == {5: {"step": 5, "ts": None, "path": None, "seconds": None}}


def test_the_history_reader_follows_no_link_and_waits_on_no_fifo(tmp_path):
    secret = tmp_path / "root-only.jsonl"
    secret.write_text(step_line(1, 1.0, 1.0))
    (tmp_path / "job").mkdir()
    (tmp_path / "job" / "events.jsonl").symlink_to(secret)
    (tmp_path / "fifo-job").mkdir()
    os.mkfifo(tmp_path / "fifo-job" / "events.jsonl")  # an open without O_NONBLOCK would hang here
    (tmp_path / "linked-job").symlink_to(tmp_path / "job")
    for wd in ("job", "fifo-job", "linked-job"):
        s = Series()
        s.catch_up(tmp_path / wd, 1 << 20)
        assert s.loss.count == 0 and s.offset == 0, wd


def test_a_replaced_or_truncated_file_is_read_again_from_its_start(tmp_path):
    ev = tmp_path / "events.jsonl"
    ev.write_text("".join(step_line(i, 1.0, float(i)) for i in range(1, 6)))
    s = Series()
    s.catch_up(tmp_path, 1 << 20)
    ev.write_text(json.dumps({"event": "step", "step": 1, "loss": 0.25}) + "\n")
    s.catch_up(tmp_path, 1 << 20)
    assert s.loss.points() == [(1, 0.25)]


def test_the_memory_a_history_holds_does_not_grow_with_its_length(tmp_path):
    """tracemalloc over the read of 20,000 step lines (past the 1000 steps drawn exactly, so every curve is
    downsampled): what the Series keeps and the most the read held at once. One dict entry per step (the reader
    before issue 23) kept 5.8 MB of these lines, with a peak of 11.8 MB."""
    import tracemalloc

    from tests.daemon.web.test_long_history import _write_steps

    _write_steps(tmp_path / "events.jsonl", 20_000)
    tracemalloc.start()
    try:
        s = Series()
        s.catch_up(tmp_path, 1 << 30)
        kept, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert s.loss.count == 20_000 and len(s.loss.buckets) <= 500
    assert kept < 500_000 and peak < 6_000_000, (kept, peak)
