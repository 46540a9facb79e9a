"""The saved steps' LoRA files, as a user reaches them: `lorad export` (list, copy out, refusals) and the dashboard
(each step beside its samples, a download per file, nothing the manifest does not list).

The job directory is laid out as the trainer commits it (a manifest with the size and sha256 of every file,
written last); no trainer runs here (tests/e2e/test_checkpoint_exports.py trains real ones)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from daemon.client import export as export_verb
from daemon.service import handlers
from tests.helpers.jobs import EXPORT_FILES as FILES
from tests.helpers.jobs import commit_checkpoint
from tests.helpers.web import BASE, Site, signed_in


@pytest.fixture
def site(tmp_path):
    s = Site(tmp_path)
    yield s
    s.close()


def _export(site: Site, job: str, step: int | None = None, to: Path | None = None, force: bool = False,
            as_json: bool = False) -> int:
    args = argparse.Namespace(job=job, step=step, to=None if to is None else str(to), force=force, json=as_json)
    return export_verb.cmd_export(args)


@pytest.fixture
def via_handlers(site, monkeypatch):
    """`lorad export`'s socket call answered by the daemon's own handler, in-process."""
    def call(args, req):
        reply = json.loads(handlers.dispatch(site.ctx, req))
        if not reply["ok"]:
            raise handlers.p.ProtocolError(reply["error"], reply["message"])
        return reply["data"]

    monkeypatch.setattr(export_verb, "call", call)


def test_lorad_export_lists_the_steps_and_copies_one_out(site, via_handlers, tmp_path, capsys):
    jid = site.add_job()
    commit_checkpoint(site.workdir(jid), 4)
    commit_checkpoint(site.workdir(jid), 8, {"pytorch_lora_weights.safetensors": b"step-8"})
    # a save killed half-way: no manifest, never offered
    (site.workdir(jid) / "checkpoints" / "step-00000012.tmp-1-2" / "export").mkdir(parents=True)
    assert _export(site, jid, as_json=True) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [s["step"] for s in listed["steps"]] == [8, 4]
    assert [f["name"] for f in listed["steps"][1]["files"]] == sorted(FILES)

    dest = tmp_path / "out"
    assert _export(site, jid, step=4, to=dest) == 0
    assert {n: (dest / n).read_bytes() for n in FILES} == FILES
    assert not [p for p in dest.rglob(".*tmp*")]
    # the files are there now: refused without --force, and nothing is changed
    (dest / "pytorch_lora_weights.safetensors").write_bytes(b"mine")
    assert _export(site, jid, step=4, to=dest) == 1
    assert "--force" in capsys.readouterr().err
    assert (dest / "pytorch_lora_weights.safetensors").read_bytes() == b"mine"
    assert _export(site, jid, step=4, to=dest, force=True) == 0
    assert (dest / "pytorch_lora_weights.safetensors").read_bytes() == FILES["pytorch_lora_weights.safetensors"]


def test_lorad_export_refuses_a_step_not_saved_and_a_file_that_fails_its_checksum(site, via_handlers, tmp_path,
                                                                                 capsys):
    from daemon.client.cli import _main

    jid = site.add_job()
    ckpt = commit_checkpoint(site.workdir(jid), 4)
    with pytest.raises(handlers.p.ProtocolError, match=rf"job {jid} has no saved step 5 \(saved steps: 4\)"):
        _export(site, jid, step=5, to=tmp_path / "a")
    (ckpt / "export" / "pytorch_lora_weights.safetensors").write_bytes(b"diffusers-bytez")  # same size, flipped
    assert _export(site, jid, step=4, to=tmp_path / "b") == 1
    err = capsys.readouterr().err
    assert f"job {jid} step 4" in err and "fails verification" in err
    assert not (tmp_path / "b" / "pytorch_lora_weights.safetensors").exists()
    assert _main(["export", jid, "--step", "-1"]) == 2  # the CLI checks the protocol's bounds


def test_the_job_page_shows_each_saved_step_with_its_samples_and_downloads(site, tmp_path):
    jid = site.add_job()
    wd = site.workdir(jid)
    commit_checkpoint(wd, 4)
    png = wd / "samples" / "step-00000004" / "p0.png"
    png.parent.mkdir(parents=True)
    png.write_bytes(b"\x89PNG")
    with (wd / "events.jsonl").open("a") as f:
        f.write(json.dumps({"event": "samples", "step": 4, "paths": [str(png)], "prompts": ["a"], "level": "info"})
                + "\n")
    with TestClient(site.app, base_url=BASE) as c:
        assert c.get(f"/jobs/{jid}/exports/4/pytorch_lora_weights.safetensors").status_code in (401, 403)
        signed_in(c, site.token)
        page = c.get(f"/jobs/{jid}").text
        saved = page[page.index("<table id=saved-steps>"):]
        saved = saved[:saved.index("</table>")]
        row = saved[saved.index("<td class=num>4</td>"):]  # the step, its samples, its files, in one row
        assert f"/jobs/{jid}/samples/4/p0.png" in row
        for name, data in FILES.items():
            assert f"/jobs/{jid}/exports/4/{name}" in row
            r = c.get(f"/jobs/{jid}/exports/4/{name}")
            assert r.status_code == 200 and r.content == data
            assert "attachment" in r.headers["content-disposition"]
        # only names the step's manifest lists as exports; nothing through a symlink
        (wd / "checkpoints" / "step-00000004" / "export" / "extra.bin").write_bytes(b"x")
        for path in ("4/extra.bin", "4/../state.json", "4/..%2Fstate.json", "4/../manifest.json", "5/raw",
                     "4/raw"):
            assert c.get(f"/jobs/{jid}/exports/{path}").status_code == 404, path
        exp = wd / "checkpoints" / "step-00000004" / "export"
        (exp / "pytorch_lora_weights.safetensors").unlink()
        (exp / "pytorch_lora_weights.safetensors").symlink_to(wd / "checkpoints" / "step-00000004" / "state.json")
        assert c.get(f"/jobs/{jid}/exports/4/pytorch_lora_weights.safetensors").status_code == 404


def test_a_video_jobs_sample_clips_play_beside_each_saved_step(site):
    """The video families' samples are MP4 clips: the page plays each in a <video> beside its step, the sample route
    serves it as video/mp4, and still only .png / .mp4 names under the job's samples/."""
    jid = site.add_job()
    wd = site.workdir(jid)
    commit_checkpoint(wd, 4)
    clip = wd / "samples" / "step-00000004" / "00.mp4"
    clip.parent.mkdir(parents=True)
    clip.write_bytes(b"\x00\x00\x00\x18ftypisom")
    with (wd / "events.jsonl").open("a") as f:
        f.write(json.dumps({"event": "samples", "step": 4, "paths": [str(clip)], "prompts": ["a"], "level": "info"})
                + "\n")
    with TestClient(site.app, base_url=BASE) as c:
        signed_in(c, site.token)
        page = c.get(f"/jobs/{jid}").text
        saved = page[page.index("<table id=saved-steps>"):]
        row = saved[saved.index("<td class=num>4</td>"):saved.index("</table>")]
        assert f"<video class=thumb src='/jobs/{jid}/samples/4/00.mp4'" in row
        assert f"src='/jobs/{jid}/samples/4/00.mp4'" in page[page.index("grid-samples"):]
        r = c.get(f"/jobs/{jid}/samples/4/00.mp4")
        assert r.status_code == 200 and r.headers["content-type"] == "video/mp4" and r.content == clip.read_bytes()
        (clip.parent / "00.mov").write_bytes(b"x")
        assert c.get(f"/jobs/{jid}/samples/4/00.mov").status_code == 404
