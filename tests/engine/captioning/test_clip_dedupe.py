"""data.dedupe on clips: a clip's fingerprint is the perceptual hashes of its sampled frames; a re-encoded, resized or
slightly cropped copy is found, and no group is made among distinct clips, even two that open on the same frame.

The clips are pans over test_dedupe.py's distinct pictures, written with PyAV in the test (as tests/helpers/videos.py
writes its clips), 12 frames at 16 fps."""

from __future__ import annotations

import json
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import yaml
from PIL import Image

from engine.captioning.dedupe import dedupe_records, near_duplicate_groups
from engine.data.videos import scan_videos
from tests.engine.captioning.test_dedupe import _Log, _scene

FPS = 16
PLANTED = ["a-cropped.mp4", "a-original.mp4", "a-reencoded.mp4", "a-resized.mp4"]


def _pan(seed: int, down: bool = False) -> np.ndarray:
    """12 frames of 96×72 panning over a 160×120 picture: right along its top, or down its left side."""
    scene = np.asarray(_scene(seed))
    at = [(0, round(48 * k / 11)) if down else (round(64 * k / 11), 0) for k in range(12)]
    return np.stack([scene[y:y + 72, x:x + 96] for x, y in at])


def _mp4(frames: np.ndarray, path: Path, crf: int = 18) -> None:
    import av

    with av.open(str(path), "w", format="mp4") as box:
        s = box.add_stream("libx264", rate=Fraction(FPS))
        s.width, s.height, s.pix_fmt = frames.shape[2], frames.shape[1], "yuv420p"
        s.options = {"crf": str(crf), "preset": "veryfast"}
        for f in frames:
            box.mux(s.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(f), format="rgb24")))
        box.mux(s.encode())


@pytest.fixture(scope="module")
def clips(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("clip-dedupe") / "data"
    d.mkdir()
    for i in range(5):
        _mp4(_pan(i), d / f"distinct-{i}.mp4")
    a = _pan(100)
    _mp4(a, d / "a-original.mp4")
    _mp4(a, d / "a-reencoded.mp4", crf=40)  # blocky
    _mp4(np.stack([np.asarray(Image.fromarray(f).resize((48, 36), Image.Resampling.BICUBIC)) for f in a]),
         d / "a-resized.mp4")
    _mp4(a[:, 2:70, 2:94], d / "a-cropped.mp4")  # 2 pixels off each side: about 5 % of each dimension
    _mp4(_pan(100, down=True), d / "b-same-start.mp4")  # a's first frame, then elsewhere in the picture
    Image.fromarray(_pan(7)[0]).save(d / "still.png")
    return d


def test_planted_near_duplicate_clips_are_one_group_and_distinct_clips_none(clips):
    records = scan_videos(clips, FPS, "txt", None)
    groups = near_duplicate_groups([(r.rel, r.path) for r in records], fps=FPS)
    assert groups == [PLANTED]  # b-same-start.mp4 opens on a's frame, and is not a copy
    for copy in ("a-cropped.mp4", "a-reencoded.mp4", "a-resized.mp4"):  # each near the original itself
        assert near_duplicate_groups([(n, clips / n) for n in ("a-original.mp4", copy)], fps=FPS) == [
            sorted(["a-original.mp4", copy])]


def test_warn_lists_the_group_and_skip_keeps_one_clip_of_it(clips):
    records = scan_videos(clips, FPS, "txt", None)
    log = _Log()
    assert dedupe_records("warn", records, log, FPS) == records
    ((event, kw),) = log.seen
    assert event == "duplicates" and kw["groups"] == [PLANTED] and "a-resized.mp4" in kw["message"]
    kept = dedupe_records("skip", records, _Log(), FPS)
    assert sorted(r.rel for r in records if r not in kept) == PLANTED[1:]  # a-cropped.mp4 kept, first by name


def test_lorad_check_lists_a_video_jobs_duplicate_clips(clips, tmp_path, capsys):
    from daemon.client import cli

    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({
        "name": "dups", "model": {"family": "wan", "path": "builtin:tiny-wan22-5b", "dtype": "float32"},
        "data": {"path": str(clips), "resolution": [32], "frames": [5], "fps": FPS, "dedupe": "skip"},
        "train": {"steps": 1}}))
    assert cli.main(["check", str(job), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)["dataset"]
    assert d["duplicate_groups"] == [PLANTED] and d["skipped"] == PLANTED[1:]
    assert cli.main(["check", str(job)]) == 0
    assert "duplicates: 4 clips and stills in 1 group(s): " + ", ".join(PLANTED) in capsys.readouterr().out
