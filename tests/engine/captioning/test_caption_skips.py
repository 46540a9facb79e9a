"""A file the captioner cannot be shown is recorded as skipped only when the bytes its record was scanned from are at
fault (they would break the same way every time: a clip cut mid-stream, test_clip_captions.py, with a real kill).
A file the machine failed to read (gone) or one changed since the scan (cut short now) is skipped for this job
and tried again by the next. The caption stage runs in this process on an image job (a tiny FLUX config,
builtin:tiny-captioner): an image job refuses an undecodable image at its scan, so only these reach its stage."""

from __future__ import annotations

import yaml

from engine.captioning.stage import caption_records
from engine.config.job import load_job
from engine.data.images import scan
from tests.helpers.images import flux_job_dict, make_images


class _Log:
    def __init__(self):
        self.said: list[tuple[str, dict]] = []

    def info(self, event, **kw):
        self.said.append((event, kw))

    warning = info

    def named(self, event: str) -> list[dict]:
        return [kw for ev, kw in self.said if ev == event]

    def generated(self) -> list[str]:
        return [n for kw in self.named("captions_committed") for n in kw["images"]]


def test_a_file_gone_or_changed_since_the_scan_is_skipped_but_not_recorded_and_the_next_job_captions_it(tmp_path):
    from engine.builtin.models import materialise
    from engine.builtin.tiny_captioner import BUILTIN_CAPTIONERS

    data = make_images(tmp_path / "data")
    captioner = materialise("tiny-captioner", tmp_path / "models", BUILTIN_CAPTIONERS)  # built once for both jobs
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(flux_job_dict("builtin:tiny-flux", data, data={
        "captions": "auto", "captioner": {"model": str(captioner), "batch_size": 2, "max_tokens": 4}})))
    cfg = load_job(job)
    records = scan(data, "txt", "sks")
    assert [r.rel for r in records][:2] == ["square-0.png", "tall-0.png"]  # the first batch
    home = tmp_path / "home"
    for job_id in ("a", "b"):
        (home / "jobs" / job_id).mkdir(parents=True)
    square, tall = ((data / n).read_bytes() for n in ("square-0.png", "tall-0.png"))
    (data / "square-0.png").write_bytes(square[: len(square) // 2])  # cut short since the scan: its pixels break
    (data / "tall-0.png").unlink()  # gone when the captioner reads it

    log = _Log()
    first = {r.rel: r.caption for r in caption_records(cfg, records, home / "jobs" / "a", log)}
    said = {kw["file"]: kw for kw in log.named("caption_skipped")}
    assert sorted(said) == ["square-0.png", "tall-0.png"] and "No such file" in said["tall-0.png"]["reason"]
    assert all("not recorded" in kw["message"] for kw in said.values())
    assert first["square-0.png"] == "sks, a yellow sun" and first["tall-0.png"] == "sks, a green tower"  # files'
    assert log.generated() == ["tall-1.png", "wide-0.png", "wide-1.png"]

    (data / "square-0.png").write_bytes(square)  # as scanned again: the next job captions both
    (data / "tall-0.png").write_bytes(tall)
    log = _Log()
    second = {r.rel: r.caption for r in caption_records(cfg, records, home / "jobs" / "b", log)}
    (ev,) = log.named("captioning")
    assert (ev["cached"], ev["skipped"], ev["to_caption"]) == (3, 0, 2)
    assert log.generated() == ["square-0.png", "tall-0.png"] and not log.named("caption_skipped")
    assert second["square-0.png"] != "sks, a yellow sun" and second["square-0.png"].startswith("sks, ")
    assert {k: v for k, v in second.items() if k not in ("square-0.png", "tall-0.png")} == {
        k: v for k, v in first.items() if k not in ("square-0.png", "tall-0.png")}
