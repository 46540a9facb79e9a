"""HOME/cache's size limit (engine/storage/cache_evict.py): after a fill, least-recently-used whole entries go,
never one a running job holds; a kill halfway leaves a cache that verifies; a lease dies with its process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch

from engine.storage import cache_evict
from engine.storage.cache import ENTRY, STALE_S, Cache, content_key, ensure
from tests.engine.storage.test_cache import squares
from tests.helpers.fakes import RecLog
from tests.helpers.processes import REPO, child_env


def key(v: int) -> str:
    return content_key(kind="square", value=v)


def age(root, values, seconds_ago: float) -> None:
    t = time.time() - seconds_ago
    for v in values:
        os.utime(root / (key(v) + ENTRY), (t, t))


@pytest.fixture
def limit():
    yield cache_evict.set_limit
    cache_evict.set_limit(None)


def test_a_fill_over_the_limit_evicts_the_oldest_unused_entries_and_keeps_running_jobs_and_its_own(tmp_path, limit):
    root, calls = tmp_path / "cache", []
    ensure(root, [squares([1, 2], calls)], RecLog())[0].close()  # job a, finished
    ensure(root, [squares([3, 4], calls)], RecLog())[0].close()  # job b, finished
    running, _ = ensure(root, [squares([3], calls)], RecLog())  # job d, still training on entry 3
    age(root, [1, 2], 300)
    age(root, [3], 250)  # the oldest but one: only its lease keeps it
    age(root, [4], 200)
    size = cache_evict.entries(root)[0].size  # every entry here is the same size
    limit(int(3.5 * size))
    log = RecLog()
    current, _ = ensure(root, [squares([5, 6], calls)], log)  # job c

    left = {e.key for e in cache_evict.entries(root)}
    assert left == {key(3), key(5), key(6)}
    evicted = [e["file"] for e in log.named("cache_evicted")]
    assert len(evicted) == 3 and not any((root / f).exists() for f in evicted)  # whole entries: data files too
    assert log.named("cache_size")[0] == {"entries": 3, "bytes": 3 * size, "limit": int(3.5 * size), "evicted": 3}
    assert all(Cache(root).verify(k) is None for k in left)

    # A job after the eviction encodes exactly what was evicted of what it needs.
    running.close()
    current.close()
    limit(None)
    _, report = ensure(root, [squares([1, 3, 4, 5], calls)], RecLog())
    assert calls[-1] == [1, 4] and report.reused == 2 and report.corrupt == []


def test_the_current_jobs_own_entries_stay_even_over_the_limit(tmp_path, limit):
    limit(1)
    log = RecLog()
    cache, _ = ensure(tmp_path / "cache", [squares([1, 2], [])], log)
    assert {e.key for e in cache_evict.entries(cache.root)} == {key(1), key(2)}
    assert log.named("cache_over_limit") and not log.named("cache_evicted")
    cache.close()
    ensure(tmp_path / "cache", [squares([3], [])], RecLog())  # the next fill: 1 and 2 are nobody's now
    assert {e.key for e in cache_evict.entries(cache.root)} == {key(3)}


def test_an_eviction_killed_between_an_entry_and_its_data_file_leaves_a_cache_that_verifies(tmp_path, limit,
                                                                                         monkeypatch):
    root, calls = tmp_path / "cache", []
    ensure(root, [squares([1, 2], calls)], RecLog())[0].close()
    age(root, [1], 100)
    data_file = json.loads((root / (key(1) + ENTRY)).read_text())["file"]
    real_unlink = os.unlink

    def killed_after_the_commit(path, *a, **k):
        if str(path).endswith(".safetensors"):
            raise SystemExit("killed")  # the process dies here: the entry is gone, its data file not yet
        return real_unlink(path, *a, **k)

    monkeypatch.setattr(os, "unlink", killed_after_the_commit)
    with pytest.raises(SystemExit):
        cache_evict.evict(root, cache_evict.entries(root)[0].size, RecLog())
    monkeypatch.setattr(os, "unlink", real_unlink)

    assert (root / data_file).exists() and not (root / (key(1) + ENTRY)).exists()
    fresh = Cache(root)
    assert fresh.verify(key(1)) == "not cached" and fresh.verify(key(2)) is None  # absent, not corrupt
    old = time.time() - STALE_S - 1
    os.utime(root / data_file, (old, old))
    assert fresh.sweep() == [data_file]  # the orphan goes like any killed writer's leftover
    _, report = ensure(root, [squares([1, 2], calls)], RecLog())
    assert calls[-1] == [1] and report.corrupt == []


def test_a_lease_dies_with_its_process_even_by_sigkill(tmp_path, limit):
    root = tmp_path / "cache"
    ensure(root, [squares([1, 2], [])], RecLog())[0].close()
    holder = subprocess.Popen(
        [sys.executable, "-c", "import time; from pathlib import Path; from engine.storage.cache_evict import Lease;"
         f"lease = Lease(Path({str(root)!r}), [{key(1)!r}]); print('held', flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True, cwd=REPO, env=child_env())
    try:
        assert holder.stdout.readline().strip() == "held"
        cache_evict.evict(root, 0, RecLog())
        assert {e.key for e in cache_evict.entries(root)} == {key(1)}  # held by a live job
    finally:
        holder.kill()
        holder.wait()
    cache_evict.evict(root, 0, RecLog())
    assert cache_evict.entries(root) == [] and os.listdir(root / cache_evict.LEASES) == [cache_evict.LOCK]


def test_the_daemons_limit_reaches_the_trainer_on_its_command_line(tmp_path):
    from daemon.config.daemon import DaemonConfig
    from engine.config import policy as job_policy

    argv = DaemonConfig(cache_max_bytes=5 << 20).job_policy(tmp_path).argv()
    import argparse

    ap = argparse.ArgumentParser()
    job_policy.add_arguments(ap)
    assert job_policy.from_args(ap.parse_args(argv)).cache_max_bytes == 5 << 20
    assert "--cache-max-bytes" not in DaemonConfig(cache_max_bytes=0).job_policy(tmp_path).argv()
    assert DaemonConfig().cache_max_bytes == 100 << 30


def test_put_and_use_mark_an_entry_recently_used(tmp_path):
    root = tmp_path / "cache"
    ensure(root, [squares([1], [])], RecLog())[0].close()
    age(root, [1], 1000)
    ensure(root, [squares([1], [])], RecLog())[0].close()
    assert time.time() - cache_evict.entries(root)[0].used < 60
    assert torch.equal(Cache(root).load(key(1))["sq"], torch.tensor([1]))
