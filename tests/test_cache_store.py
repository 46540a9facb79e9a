"""The content-keyed cache (engine/cache.py) knows no model family: any family fills it through encoder callables."""

from __future__ import annotations

import json

import torch

from engine.cache import Group, Need, content_key, ensure
from tests.fakes import RecLog


def squares(values: list[int], calls: list[list[int]]) -> Group:
    """A made-up family's entries: one tensor per integer, "encoded" by squaring it."""

    def encode(todo, done):
        calls.append([n.payload for n in todo])
        for need in todo:
            done(need, {"sq": torch.tensor([need.payload ** 2])})

    needs = {content_key(kind="square", value=v): Need(content_key(kind="square", value=v), f"n={v}", v) for v in values}
    return Group("square", needs, encode)


def test_an_encoder_is_called_only_for_what_is_missing_and_entries_no_longer_needed_are_pruned(tmp_path):
    calls: list[list[int]] = []
    log = RecLog()
    cache, report = ensure(tmp_path / "cache", [squares([2, 3], calls)], log)
    assert calls == [[2, 3]] and report.encoded == {"square": ["n=2", "n=3"]} and report.reused == 0
    assert [e["done"] for e in log.named("cache_progress")] == [1, 2]
    assert log.named("cache_start")[0]["squares"] == 2 and log.named("cache_done")[0]["squares_encoded"] == 2

    cache, report = ensure(tmp_path / "cache", [squares([3, 4], calls)], RecLog())
    assert calls[-1] == [4] and report.reused == 1
    assert cache.load(content_key(kind="square", value=4))["sq"].item() == 16
    manifest = json.loads((tmp_path / "cache" / "manifest.json").read_text())
    assert sorted(e["source"] for e in manifest["entries"].values()) == ["n=3", "n=4"]
    assert len(list((tmp_path / "cache").glob("square-*.safetensors"))) == 2  # n=2's file is gone


def test_a_corrupt_entry_is_reported_and_encoded_again(tmp_path):
    calls: list[list[int]] = []
    cache, _ = ensure(tmp_path / "cache", [squares([5], calls)], RecLog())
    entry = next(iter(cache.entries.values()))
    (tmp_path / "cache" / entry["file"]).write_bytes(b"rot")
    log = RecLog()
    _, report = ensure(tmp_path / "cache", [squares([5], calls)], log)
    assert calls == [[5], [5]] and report.corrupt == [entry["file"]]
    assert log.named("cache_corrupt")[0]["file"] == entry["file"]


def test_the_cache_library_imports_no_model_family_and_no_model_library():
    import ast
    from pathlib import Path

    import engine.cache

    tree = ast.parse(Path(engine.cache.__file__).read_text())
    imported = set()
    for node in tree.body:
        for sub in ast.walk(node):
            if isinstance(sub, ast.ImportFrom):
                imported.add(sub.module)
            elif isinstance(sub, ast.Import):
                imported.update(a.name for a in sub.names)
    assert imported and not [m for m in imported if m.startswith(("engine.families", "diffusers", "transformers"))]
