"""The compile caches under HOME/cache's size limit (engine/storage/cache_evict.py): compile/KEY.bin and compile/KEY.d
count as one entry per key, go least-recently-used together with the latent entries, never while a trainer leases
the key, and an eviction killed halfway never leaves an inductor directory that loads warm."""

from __future__ import annotations

import gc
import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from engine.frozen_base import compiling
from engine.frozen_base.compiling import MAGIC, CompileCache
from engine.frozen_base.inductor_dir import InductorDir
from engine.storage import cache_evict
from engine.storage.cache import ensure
from tests.engine.storage.test_cache import squares
from tests.engine.storage.test_cache_evict import age, key
from tests.helpers.fakes import RecLog
from tests.helpers.processes import REPO, child_env


def compile_key(root: Path, name: str, seconds_ago: float = 0.0, nbytes: int = 1000) -> int:
    """A compile key as a trainer leaves it: KEY.d committed, KEY.bin checksummed; its bytes on disk."""
    d = root / "compile" / f"{name}.d"
    for rel in ("fxgraph/ab/entry", "cpp/kernel.so", "cpp/other.so"):
        (d / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / rel).write_bytes(rel.encode() * (nbytes // len(rel)))
    InductorDir(d).commit()
    payload = b"artifacts" * (nbytes // 9)
    (root / "compile" / f"{name}.bin").write_bytes(MAGIC + hashlib.sha256(payload).hexdigest().encode() + b"\n" + payload)
    age_compile(root, name, seconds_ago)
    return next(e.size for e in cache_evict.compile_entries(root) if e.key == name)


def age_compile(root: Path, name: str, seconds_ago: float) -> None:
    t = time.time() - seconds_ago
    for p in (root / "compile" / f"{name}.bin", root / "compile" / f"{name}.d" / InductorDir.MANIFEST):
        os.utime(p, (t, t))


def compile_keys(root: Path) -> set[str]:
    return {e.key for e in cache_evict.compile_entries(root)}


@pytest.fixture
def inductor_env(monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "unset by the test")  # adopt() sets it; restored after


def test_compile_keys_are_counted_and_evicted_in_one_least_recently_used_order_with_the_latent_entries(tmp_path):
    root = tmp_path / "cache"
    ensure(root, [squares([1, 2, 3], [])], RecLog())[0].close()
    age(root, [1], 500)
    a = compile_key(root, "a", 400)
    age(root, [2], 300)
    compile_key(root, "b", 200)
    age(root, [3], 100)
    sizes = {e.key: e.size for e in cache_evict.entries(root)}
    files = {e.key: e.file for e in cache_evict.entries(root)}
    on_disk = sum(p.stat().st_size for p in (root / "compile").rglob("*") if p.is_file())
    assert cache_evict.compile_usage(root) == (2, 2 * a) == (2, on_disk)  # both files, the whole directory
    total = sum(sizes.values()) + 2 * a
    log = RecLog()
    cache_evict.evict(root, total - sizes[key(1)] - a - sizes[key(2)], log)  # room for the two newest only

    assert [e["file"] for e in log.named("cache_evicted")] == [files[key(1)], "compile/a", files[key(2)]]
    assert {e.key for e in cache_evict.entries(root)} == {key(3)} and compile_keys(root) == {"b"}
    assert sorted(os.listdir(root / "compile")) == ["b.bin", "b.d"]  # a's file and directory, whole
    assert log.named("cache_size")[0]["evicted"] == 3


def test_a_compile_key_a_live_trainer_leases_is_never_evicted(tmp_path):
    root = tmp_path / "cache"
    compile_key(root, "running", 1000)
    compile_key(root, "done", 10)
    lease = cache_evict.Lease(root, ["running"])
    log = RecLog()
    cache_evict.evict(root, 0, log)
    assert compile_keys(root) == {"running"} and log.named("cache_over_limit")
    lease.close()
    cache_evict.evict(root, 0, RecLog())
    assert compile_keys(root) == set() and os.listdir(root / "compile") == []


class Section(SimpleNamespace):
    def model_dump(self, mode: str = "json") -> dict:
        return dict(vars(self))


def test_a_trainer_leases_its_compile_key_for_its_attempt_and_evicts_older_keys_at_start(tmp_path, monkeypatch,
                                                                                        inductor_env):
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", lambda data: object())
    home = tmp_path / "home"
    cfg = SimpleNamespace(model=Section(family="tiny"), lora=Section(rank=4), data=SimpleNamespace(resolution=64),
                          train=SimpleNamespace(batch_size=1, blocks_to_swap=0, gradient_checkpointing=False))
    own = compiling.cache_key(cfg, torch.device("cpu"))
    compile_key(home / "cache", own, 1000)  # the oldest, but this job's own
    compile_key(home / "cache", "older", 10)
    # what killed writers left (write_file_durable's temp names): one two hours old, one a live writer's
    stale, live = (home / "cache" / "compile" / f".{n}.bin.tmp-999-ab" for n in ("gone", "writing"))
    for f in (stale, live):
        f.write_bytes(b"x" * 100)
    os.utime(stale, (time.time() - 7200, time.time() - 7200))
    cache_evict.set_limit(1)
    try:
        log = RecLog()
        compiler = compiling.start_compiler(cfg, home / "jobs" / "j-1", torch.device("cpu"), log)
    finally:
        cache_evict.set_limit(None)
    assert compile_keys(home / "cache") == {own}
    assert [e["file"] for e in log.named("cache_evicted")] == ["compile/older"]
    assert not stale.exists() and live.exists()
    assert [e["file"] for e in log.named("cache_swept")] == [f"compile/{stale.name}"]
    assert log.named("compile_cache")[0]["status"] == "warm"  # still committed: the eviction passed it by
    del compiler
    gc.collect()  # the attempt's model (and the hook that holds its Compiler) goes: so does the lease
    cache_evict.evict(home / "cache", 0, RecLog())
    assert compile_keys(home / "cache") == set()


@pytest.mark.parametrize("which", ["artifacts file", "inductor directory"])
def test_a_key_found_warm_is_kept_over_an_older_unused_one(which, tmp_path, monkeypatch, inductor_env):
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", lambda data: object())
    root = tmp_path / "cache"
    size = compile_key(root, "used-long-ago", 300)
    compile_key(root, "unused", 200)
    if which == "artifacts file":  # a job found it warm: the oldest is now the newest
        assert CompileCache(root / "compile" / "used-long-ago.bin").load() == "warm"
    else:
        assert InductorDir(root / "compile" / "used-long-ago.d").adopt() == "warm"
    cache_evict.evict(root, size, RecLog())
    assert compile_keys(root) == {"used-long-ago"}


EVICT_AND_DIE = """
import os, signal, sys
from pathlib import Path
from engine.storage import cache_evict

unlinks, die_after = [], int(sys.argv[2])
real = os.unlink
def unlink(path, *a, **k):
    real(path, *a, **k)
    unlinks.append(path)
    if len(unlinks) == die_after:  # the manifest is the first; then the artifacts file, then the directory's files
        os.kill(os.getpid(), signal.SIGKILL)
os.unlink = unlink
cache_evict.evict(Path(sys.argv[1]), 0, None)
"""


@pytest.mark.parametrize("die_after", [1, 2, 3], ids=["manifest", "artifacts file", "one kernel"])
def test_an_eviction_sigkilled_inside_a_compile_key_never_leaves_a_directory_that_loads_warm(die_after, tmp_path,
                                                                                           inductor_env):
    root = tmp_path / "cache"
    compile_key(root, "k")
    d = root / "compile" / "k.d"
    child = subprocess.run([sys.executable, "-c", EVICT_AND_DIE, str(root), str(die_after)], cwd=REPO,
                           env=child_env(), capture_output=True, text=True, timeout=60)
    assert child.returncode == -signal.SIGKILL, child.stderr
    left = sorted(p.relative_to(d).as_posix() for p in d.rglob("*") if p.is_file())
    assert InductorDir.MANIFEST not in left and left  # killed halfway: files left, none committed
    assert "k" in compile_keys(root)  # still counted: the next eviction takes what is left

    log = RecLog()
    assert InductorDir(d, log).adopt() == "corrupt"  # never warm: wiped, a cold compile
    assert list(d.iterdir()) == [] and log.named("compile_cache")[0]["reason"] == "no manifest"
