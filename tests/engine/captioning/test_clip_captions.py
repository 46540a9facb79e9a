"""Video clips are captioned from frames sampled evenly over each clip (engine/captioning/frames.py), given to the
vision-language model as several images in one prompt, with the image stage's commit and resume rules.

The base is the tiny Wan 2.2 TI2V-5B, the captioner builtin:tiny-captioner; the clips are tests/helpers/videos.py's
(an MP4, an animated GIF and a still)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from engine.captioning.frames import frame_indices
from tests.helpers.forked import ForkedTrainer, run_to_end
from tests.helpers.images import tensor_bytes
from tests.helpers.videos import make_clips

CAPTIONER = {"model": "builtin:tiny-captioner", "batch_size": 1, "max_tokens": 6, "frames": 3}
FILES = ("blue.gif", "red.mp4", "still.png")


def _job(path: Path, model: Path, data: Path, captioner: dict = CAPTIONER) -> Path:
    path.write_text(yaml.safe_dump({
        "name": "clip-captions", "model": {"family": "wan", "path": str(model), "dtype": "float32"},
        "lora": {"rank": 4, "alpha": 8},
        "data": {"path": str(data), "resolution": [32], "frames": [5], "fps": 16, "trigger": "sks",
                 "captions": "auto", "captioner": captioner},
        "train": {"steps": 2, "batch_size": 1, "lr": 0.002, "schedule": "constant", "optimizer": "adamw", "seed": 3},
        "checkpoint": {"every_steps": 1, "every_seconds": None, "keep": 2},
        "output": {"formats": ["diffusers"]}}))
    return path


def _events(wd: Path, name: str) -> list[dict]:
    events = [json.loads(ln) for ln in (wd / "events.jsonl").read_text().splitlines() if ln.strip()]
    return [e for e in events if e.get("event") == name]


def _generated(wd: Path) -> list[str]:
    return [name for e in _events(wd, "captions_committed") for name in e["images"]]


def _in_home(home: Path, job_id: str) -> Path:
    (home / "jobs").mkdir(parents=True, exist_ok=True)
    return home / "jobs" / job_id


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The tiny TI2V-5B, the clips, and an uninterrupted run on them with auto captions."""
    from engine.builtin.models import materialise

    root = tmp_path_factory.mktemp("clip-captions")
    model = materialise("tiny-wan22-5b", root / "models")
    data = make_clips(root / "data")
    job = _job(root / "job.yaml", model, data)
    ref = _in_home(root / "home", "ref")
    assert run_to_end(job, ref).named("done")
    return job, ref, data


def test_frames_are_sampled_evenly_first_to_last_and_never_twice():
    assert frame_indices(10, 3) == [0, 4, 9] and frame_indices(10, 4) == [0, 3, 6, 9]
    assert frame_indices(3, 4) == [0, 1, 2]  # a clip shorter than the count: each frame once
    assert frame_indices(9, 1) == [4] and frame_indices(1, 4) == [0]


def test_a_clip_job_captions_from_sampled_frames_trains_and_resumes_generating_each_caption_once(
        reference, tmp_path):
    from engine.captioning.captioner import Captioner
    from engine.captioning.frames import images_of
    from engine.config.job import load_job
    from engine.data.images import make_caption
    from engine.data.videos import scan_videos

    job, ref, data = reference
    before = sorted(p.name for p in data.iterdir())
    wd = tmp_path / "killed"  # a home of its own: nothing cached
    t = ForkedTrainer(job, wd, LORAD_DEBUG_STEP_DELAY_S="0.4")
    t.wait_for(lambda: bool(t.named("captions_committed")))  # the first clip's caption is committed
    t.kill()
    assert len(_generated(wd)) < len(FILES), "the kill came after the whole stage"
    assert run_to_end(job, wd).named("done")

    assert sorted(_generated(wd)) == sorted(_generated(ref)) == sorted(FILES)  # each generated exactly once
    ours, theirs = (json.loads((d / "captions.json").read_text()) for d in (wd, ref))
    assert ours == theirs and set(ours) == set(FILES)
    name = "pytorch_lora_weights.safetensors"
    assert tensor_bytes(wd / "output" / name) == tensor_bytes(ref / "output" / name)
    assert sorted(p.name for p in data.iterdir()) == before  # no caption file written beside the clips

    # The caption is the model's reading of the sampled frames, several images in one prompt.
    cfg = load_job(job)
    c = cfg.data.captioner
    red = next(r for r in scan_videos(data, 16, "txt", "sks") if r.rel == "red.mp4")
    frames = images_of(red, 16, c.frames)
    assert len(frames) == 3 and frames[0].tobytes() != frames[-1].tobytes()  # the square moved
    import torch

    model = Captioner(ref / "builtin-models" / "tiny-captioner", c.model, torch.device("cpu"))
    (text,) = model.caption([frames], c.full_prompt("sks", clips=True), c.max_tokens)
    (first_only,) = model.caption([frames[:1]], c.full_prompt("sks", clips=True), c.max_tokens)
    assert ours["red.mp4"] == make_caption(text, "sks") and text != first_only


def test_the_frame_count_is_a_video_key_and_part_of_the_identity(tmp_path):
    from engine.config.job import load_job
    from engine.errors import JobInvalid
    from tests.helpers.images import flux_job_dict, make_images

    data = make_clips(tmp_path / "clips")
    job = _job(tmp_path / "a.yaml", "builtin:tiny-wan22-5b", data)
    base = load_job(job)
    doc = yaml.safe_load(job.read_text())
    doc["data"]["captioner"]["frames"] = 5
    (tmp_path / "b.yaml").write_text(yaml.safe_dump(doc))
    assert load_job(tmp_path / "b.yaml").identity_hash() != base.identity_hash()  # other frames, other captions
    doc["data"]["captioner"] = {**CAPTIONER, "hold_for_review": True}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(doc))
    assert load_job(tmp_path / "c.yaml").identity_hash() == base.identity_hash()  # the hold changes no weight
    doc["data"]["dedupe"] = "skip"  # read on clips (test_clip_dedupe.py): it decides what is trained on
    (tmp_path / "d.yaml").write_text(yaml.safe_dump(doc))
    assert load_job(tmp_path / "d.yaml").identity_hash() != base.identity_hash()

    flux = flux_job_dict("builtin:tiny-flux", make_images(tmp_path / "images"),
                         data={"captions": "auto", "captioner": {"frames": 4}})
    (tmp_path / "e.yaml").write_text(yaml.safe_dump(flux))
    with pytest.raises(JobInvalid, match="data.captioner.frames"):
        load_job(tmp_path / "e.yaml")


def test_a_clip_that_breaks_before_a_sampled_frame_is_skipped_by_name_and_the_others_are_captioned(tmp_path):
    from engine.captioning.stage import caption_records
    from engine.config.job import load_job
    from engine.data.videos import scan_videos
    from tests.helpers.videos import truncated_mid_stream

    data = make_clips(tmp_path / "clips", clips=[])  # the still alone
    truncated_mid_stream(data / "broken.mp4")  # probes whole, breaks before its last frames
    (data / "broken.txt").write_text("its own words\n")
    cfg = load_job(_job(tmp_path / "job.yaml", "builtin:tiny-wan22-5b", data))

    class Log:
        said: list = []

        def info(self, event, **kw):
            self.said.append((event, kw))

        warning = info

    log = Log()
    records = caption_records(cfg, scan_videos(data, 16, "txt", "sks"), tmp_path / "work", log)
    captions = {r.rel: r.caption for r in records}
    assert captions["broken.mp4"] == "sks, its own words" and captions["still.png"] != "sks, a yellow square"
    (skip,) = [kw for ev, kw in log.said if ev == "caption_skipped"]
    assert skip["file"] == "broken.mp4" and "broke while decoding" in skip["reason"]
    assert [n for ev, kw in log.said if ev == "captions_committed" for n in kw["images"]] == ["still.png"]


def test_a_broken_clip_is_skipped_once_recorded_with_its_batch_and_captioned_once_fixed(reference, tmp_path):
    """A clip that always breaks is recorded as skipped with its batch: a job killed after that batch and resumed,
    and a second job, neither decode it again nor regenerate its batch-mates; fixed, it is captioned."""
    from engine.data.clip_files import moving_square, write_mp4
    from tests.helpers.videos import truncated_mid_stream

    job_ref, _ref, _data = reference
    model = Path(yaml.safe_load(job_ref.read_text())["model"]["path"])  # the tiny TI2V-5B, built once
    data = make_clips(tmp_path / "clips")
    truncated_mid_stream(data / "broken.mp4")  # probes whole; in the first batch: blue.gif, broken.mp4
    # Held for review: the trainer stops after its captions (exit 75), nothing trained.
    job = _job(tmp_path / "job.yaml", model, data, {**CAPTIONER, "batch_size": 2, "hold_for_review": True})
    whole = _in_home(tmp_path / "home-a", "whole")
    assert ForkedTrainer(job, whole).finish(300) == 75

    wd = _in_home(tmp_path / "home-b", "killed")
    # A long pause after each batch (the kill ends it): on a loaded machine the kill still lands before the next.
    t = ForkedTrainer(job, wd, LORAD_DEBUG_STEP_DELAY_S="3")
    t.wait_for(lambda: bool(t.named("captions_committed")))  # the batch holding the broken clip
    t.kill()
    assert _generated(wd) == ["blue.gif"], "the kill came after the whole stage"
    assert ForkedTrainer(job, wd).finish(300) == 75
    (resumed,) = _events(wd, "captioning")[1:]
    assert (resumed["cached"], resumed["skipped"], resumed["to_caption"]) == (1, 1, 2)  # the skip read back
    good = ["blue.gif", "red.mp4", "still.png"]
    assert sorted(_generated(wd)) == sorted(_generated(whole)) == good  # each generated exactly once
    for d in (wd, whole):  # said once per job, naming the file and why
        (skip,) = _events(d, "caption_skipped")
        assert skip["file"] == "broken.mp4" and "broke while decoding" in skip["reason"]
    ours, theirs = (json.loads((d / "captions.json").read_text()) for d in (wd, whole))
    assert ours == theirs and ours["broken.mp4"] == "sks"  # no caption file: the trigger alone

    again = _in_home(tmp_path / "home-b", "again")  # a second job: nothing decoded, nothing generated
    assert ForkedTrainer(job, again).finish(300) == 75
    (ev,) = _events(again, "captioning")
    assert (ev["cached"], ev["skipped"], ev["to_caption"]) == (3, 1, 0) and not _generated(again)
    (skip,) = _events(again, "caption_skipped")
    assert skip["file"] == "broken.mp4" and "skipped before" in skip["message"]

    write_mp4(moving_square(8, 32, 32, (20, 90, 220), seed=5), data / "broken.mp4", 16)  # fixed: other bytes
    fixed = _in_home(tmp_path / "home-b", "fixed")
    assert ForkedTrainer(job, fixed).finish(300) == 75
    assert _generated(fixed) == ["blue.gif", "broken.mp4"]  # its batch, once more; blue.gif's caption kept
    assert not _events(fixed, "caption_skipped")
    caps = json.loads((fixed / "captions.json").read_text())
    assert caps["broken.mp4"].startswith("sks, ") and caps == {**ours, "broken.mp4": caps["broken.mp4"]}


def test_a_video_job_leaves_out_a_near_duplicate_clip_before_captioning_it(reference, tmp_path):
    import shutil

    job_ref, _ref, _data = reference
    model = Path(yaml.safe_load(job_ref.read_text())["model"]["path"])
    from tests.helpers.videos import CLIPS

    # red.mp4 alone: blue.gif is the same synthetic square in another colour, near it by grey perceptual hashes
    data = make_clips(tmp_path / "clips", clips=CLIPS[:1])
    shutil.copy(data / "red.mp4", data / "red-copy.mp4")
    job = _job(tmp_path / "job.yaml", model, data, {**CAPTIONER, "hold_for_review": True})
    doc = yaml.safe_load(job.read_text())
    doc["data"]["dedupe"] = "skip"
    job.write_text(yaml.safe_dump(doc))
    wd = _in_home(tmp_path / "home", "dups")
    assert ForkedTrainer(job, wd).finish(300) == 75
    (dups,) = _events(wd, "duplicates")
    assert dups["groups"] == [["red-copy.mp4", "red.mp4"]] and dups["skipped"] == ["red.mp4"]
    assert sorted(_generated(wd)) == ["red-copy.mp4", "still.png"]  # red.mp4 left out first
    assert sorted(json.loads((wd / "captions.json").read_text())) == ["red-copy.mp4", "still.png"]


def test_lorad_check_counts_a_video_jobs_captions(tmp_path, capsys):
    from daemon.client import cli

    data = make_clips(tmp_path / "clips")
    (data / "red.txt").unlink()  # files-else-auto: red.mp4 alone is captioned
    job = _job(tmp_path / "job.yaml", "builtin:tiny-wan22-5b", data)
    doc = yaml.safe_load(job.read_text())
    doc["data"]["captions"] = "files-else-auto"
    job.write_text(yaml.safe_dump(doc))
    assert cli.main(["check", str(job), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)["dataset"]
    assert (d["images"], d["captioned"], d["to_caption"]) == (3, 2, 1)
    assert cli.main(["check", str(job)]) == 0
    assert "captions: 3 clips and stills: 2 captioned (files), 1 to caption (data.captions: files-else-auto)" \
        in capsys.readouterr().out
