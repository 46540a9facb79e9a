"""data.dedupe finds the same picture resized, re-encoded or slightly cropped, and groups nothing else."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

from engine.captioning.dedupe import dedupe_records, near_duplicate_groups
from engine.data.images import scan


def _scene(seed: int, w: int = 160, h: int = 120) -> Image.Image:
    """A distinct picture per seed: a gradient in a random direction with shapes of random colour and place."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    angle = rng.uniform(0, 2 * np.pi)
    base = (np.cos(angle) * xx / w + np.sin(angle) * yy / h) * 160 + 40
    arr = np.stack([base * rng.uniform(0.4, 1.2) for _ in range(3)], -1)
    for _ in range(4):
        x0, y0 = rng.integers(0, w - 30), rng.integers(0, h - 30)
        arr[y0:y0 + rng.integers(15, 50), x0:x0 + rng.integers(15, 60)] = rng.integers(0, 255, 3)
    return Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8))


def _folder(tmp_path: Path) -> Path:
    d = tmp_path / "data"
    d.mkdir()
    for i in range(8):
        _scene(i).save(d / f"distinct-{i}.png")
    original = _scene(100)
    original.save(d / "a-original.png")
    original.resize((96, 72), Image.Resampling.BICUBIC).save(d / "a-resized.png")
    original.save(d / "a-reencoded.jpg", quality=60)
    w, h = original.size
    original.crop((4, 3, w - 4, h - 3)).save(d / "a-cropped.png")  # 5 % off each side
    return d


def test_planted_near_duplicates_are_one_group_and_distinct_images_none(tmp_path):
    d = _folder(tmp_path)
    records = scan(d, "txt", None)
    groups = near_duplicate_groups([(r.rel, r.path) for r in records])
    assert groups == [["a-cropped.png", "a-original.png", "a-reencoded.jpg", "a-resized.png"]]


class _Log:
    def __init__(self):
        self.seen = []

    def warning(self, event, **kw):
        self.seen.append((event, kw))


def test_warn_lists_the_group_and_skip_keeps_one_of_each(tmp_path):
    records = scan(_folder(tmp_path), "txt", None)
    log = _Log()
    assert dedupe_records("warn", records, log) == records
    (event, kw), = log.seen
    assert event == "duplicates" and kw["skipped"] == [] and "a-original.png" in kw["message"]
    kept = dedupe_records("skip", records, _Log())
    assert sorted(r.rel for r in kept) == ["a-cropped.png"] + [f"distinct-{i}.png" for i in range(8)]
    assert dedupe_records("off", records, log) == records
