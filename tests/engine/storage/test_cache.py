"""The content-keyed cache (engine/storage/cache.py) knows no model family: any family fills it through encoder callables."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

from engine.storage.cache import STALE_S, Cache, Group, Need, content_key, ensure, job_cache_dir
from tests.helpers.fakes import RecLog


def squares(values: list[int], calls: list[list[int]]) -> Group:
    """A made-up family's entries: one tensor per integer, "encoded" by squaring it."""

    def encode(todo, done):
        calls.append([n.payload for n in todo])
        for need in todo:
            done(need, {"sq": torch.tensor([need.payload ** 2])})

    needs = {content_key(kind="square", value=v): Need(content_key(kind="square", value=v), f"n={v}", v) for v in values}
    return Group("square", needs, encode)


def test_an_encoder_is_called_only_for_what_is_missing_and_entries_another_job_may_need_are_kept(tmp_path):
    calls: list[list[int]] = []
    log = RecLog()
    cache, report = ensure(tmp_path / "cache", [squares([2, 3], calls)], log)
    assert calls == [[2, 3]] and report.encoded == {"square": ["n=2", "n=3"]} and report.reused == 0
    assert [e["done"] for e in log.named("cache_progress")] == [1, 2]
    assert log.named("cache_start")[0]["squares"] == 2 and log.named("cache_done")[0]["squares_encoded"] == 2

    cache, report = ensure(tmp_path / "cache", [squares([3, 4], calls)], RecLog())
    assert calls[-1] == [4] and report.reused == 1
    assert cache.load(content_key(kind="square", value=4))["sq"].item() == 16
    entries = [json.loads(p.read_text()) for p in (tmp_path / "cache").glob("*.entry.json")]
    assert sorted(e["source"] for e in entries) == ["n=2", "n=3", "n=4"]  # the cache is shared: nothing pruned
    assert len(list((tmp_path / "cache").glob("square-*.safetensors"))) == 3


def test_a_corrupt_entry_is_reported_and_encoded_again(tmp_path):
    calls: list[list[int]] = []
    cache, _ = ensure(tmp_path / "cache", [squares([5], calls)], RecLog())
    entry = next(iter(cache.entries.values()))
    (tmp_path / "cache" / entry["file"]).write_bytes(b"rot")
    log = RecLog()
    _, report = ensure(tmp_path / "cache", [squares([5], calls)], log)
    assert calls == [[5], [5]] and report.corrupt == [entry["file"]]
    assert log.named("cache_corrupt")[0]["file"] == entry["file"]


def test_a_writer_killed_mid_entry_or_racing_another_leaves_every_entry_whole(tmp_path):
    root = tmp_path / "cache"
    a, b = Cache(root), Cache(root)
    a.put("k1", "latent", "x.png", {"latent": torch.ones(2)})
    # a second writer of the same key (another job) commits a different encoding after the first
    b.put("k1", "latent", "x.png", {"latent": torch.full((2,), 2.0)})
    # a writer SIGKILLed after its data file and before its entry, and one killed while writing the data file
    (root / "latent-k2-0123456789abcdef.safetensors").write_bytes(b"whole but unnamed")
    (root / ".latent-k3-feed.safetensors.tmp-4242").write_bytes(b"half")
    fresh = Cache(root)
    assert fresh.verify("k1") is None and float(fresh.load("k1")["latent"][0]) == 2.0  # the last commit wins
    assert fresh.verify("k2") == "not cached" and fresh.verify("k3") == "not cached"  # encoded again, never read
    assert fresh.sweep() == []  # young leftovers may belong to a live writer
    old = time.time() - STALE_S - 1
    for name in ("latent-k2-0123456789abcdef.safetensors", ".latent-k3-feed.safetensors.tmp-4242"):
        os.utime(root / name, (old, old))
    assert sorted(fresh.sweep()) == [".latent-k3-feed.safetensors.tmp-4242", "latent-k2-0123456789abcdef.safetensors"]
    assert fresh.verify("k1") is None


def test_an_entry_committed_by_another_writer_after_opening_is_seen(tmp_path):
    calls: list[list[int]] = []
    reader = Cache(tmp_path / "cache")
    ensure(tmp_path / "cache", [squares([7], calls)], RecLog())  # another job, after `reader` was opened
    assert reader.verify(content_key(kind="square", value=7)) is None


def test_a_home_job_shares_home_cache_and_keeps_its_own_when_it_cannot_write_there(tmp_path, monkeypatch):
    wd = tmp_path / "home" / "jobs" / "a-1"
    wd.mkdir(parents=True)
    shared = (tmp_path / "home" / "cache").resolve()
    assert job_cache_dir(wd, RecLog()) == shared
    assert job_cache_dir(tmp_path / "elsewhere", RecLog()) == (tmp_path / "elsewhere" / "cache").resolve()
    # `lorad cache` run by another user than the daemon's trainer user (root passes every access check here)
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: Path(p) != shared and real_access(p, mode))
    log = RecLog()
    assert job_cache_dir(wd, log) == wd.resolve() / "cache"
    assert log.named("cache_private")[0]["shared"] == str(shared)


def test_the_cache_library_imports_no_model_family_and_no_model_library():
    import ast
    from pathlib import Path

    import engine.storage.cache

    tree = ast.parse(Path(engine.storage.cache.__file__).read_text())
    imported = set()
    for node in tree.body:
        for sub in ast.walk(node):
            if isinstance(sub, ast.ImportFrom):
                imported.add(sub.module)
            elif isinstance(sub, ast.Import):
                imported.update(a.name for a in sub.names)
    assert imported and not [m for m in imported if m.startswith(("engine.families", "diffusers", "transformers"))]
