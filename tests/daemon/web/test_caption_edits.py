"""The job page shows each image beside its caption and edits a caption before training starts (the `caption`
verb, daemon/supervisor/caption_edits.py): with the session's CSRF token as every action, written to
WORKDIR/caption_edits.json for the trainer, refused once training has begun, naming why."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from starlette.testclient import TestClient

from daemon import protocol as p
from daemon.service import handlers
from daemon.store import states
from engine.config.caption_edits import EDITS_FILE, read_edits
from tests.helpers.images import make_images
from tests.helpers.web import BASE, Site, signed_in

CAPTIONS = {"wide-0.png": "sks, a square", "tall-0.png": "sks, a tower"}


@pytest.fixture
def site(tmp_path):
    s = Site(tmp_path)
    yield s
    s.close()


def _captioned_job(site: Site, tmp_path: Path) -> str:
    """A queued job whose caption stage has written its captions, with its data.path in state.db."""
    data = make_images(tmp_path / "data")
    jid = site.store.new_id("cap")
    workdir = site.home / "jobs" / jid
    workdir.mkdir(parents=True)
    site.store.add_job(jid, "cap", workdir, 0, 10, "submit:test", text=yaml.safe_dump({"data": {"path": str(data)}}))
    (workdir / "captions.json").write_text(json.dumps(CAPTIONS))
    return jid


def _csrf(page: str) -> str:
    return re.search(r"name=csrf value='([0-9a-f]+)'", page).group(1)


def test_the_job_page_shows_each_image_with_its_caption_and_an_edit_reaches_the_trainers_file(site, tmp_path):
    jid = _captioned_job(site, tmp_path)
    with TestClient(site.app, base_url=BASE) as client:
        signed_in(client, site.token)
        page = client.get(f"/jobs/{jid}").text
        assert "Captions (2 images)" in page and "sks, a tower" in page
        img = client.get(f"/jobs/{jid}/images/wide-0.png")
        assert img.status_code == 200 and img.content[:4] == b"\x89PNG"
        # only an image its captions name, and nothing outside data.path, even one a rewritten captions.json names
        (tmp_path / "outside.png").write_bytes(img.content)
        (site.workdir(jid) / "captions.json").write_text(json.dumps({**CAPTIONS, "../outside.png": "x"}))
        for rel in ("wide-1.png", "..%2Foutside.png", "wide-0.txt"):
            assert client.get(f"/jobs/{jid}/images/{rel}").status_code == 404, rel
        (site.workdir(jid) / "captions.json").write_text(json.dumps(CAPTIONS))

        r = client.post(f"/jobs/{jid}/caption", data={"csrf": _csrf(page), "image": "tall-0.png",
                                                       "caption": "sks, a tall\x1b[31m green tower\n"},
                        headers={"Origin": BASE})
        assert "caption of tall-0.png edited" in r.text and "(edited)" in r.text
        assert read_edits(site.workdir(jid)) == {"tall-0.png": "sks, a tall [31m green tower"}
        assert json.loads((site.workdir(jid) / "captions.json").read_text()) == CAPTIONS  # the stage's, untouched

        # without the session's CSRF token, or without the token at all: refused, nothing written
        r = client.post(f"/jobs/{jid}/caption", data={"image": "wide-0.png", "caption": "x"}, headers={"Origin": BASE})
        assert r.status_code == 403
    with TestClient(site.app, base_url=BASE) as stranger:
        r = stranger.post(f"/jobs/{jid}/caption", data={"image": "wide-0.png", "caption": "x"})
        assert r.status_code == 401
    assert set(read_edits(site.workdir(jid))) == {"tall-0.png"}


def test_an_edit_is_refused_once_training_has_begun_or_for_what_the_captions_do_not_name(site, tmp_path):
    jid = _captioned_job(site, tmp_path)

    def edit(image: str = "wide-0.png") -> dict:
        return json.loads(handlers.dispatch(site.ctx, p.EditCaption(job=jid, image=image, caption="sks, mine")))

    assert edit("nope.png")["message"] == f"job {jid} has no image 'nope.png' among its captions"
    assert edit()["ok"]
    site.store.begin_attempt(jid, 0)  # running, past its caption stage (no `captioning` progress)
    assert "has read its captions" in edit()["message"]
    site.store.update(jid, stage="captioning 1/2")  # a resumed attempt still captioning
    assert edit()["ok"]
    site.store.update(jid, stage="captioning 2/2")  # its last batch: the stage is reading the edits now
    assert "has read its captions" in edit()["message"]
    site.store.update(jid, step=1, stage=None)
    reply = edit()
    assert reply["error"] == "refused" and "has begun training (step 1)" in reply["message"]
    site.store.transition(jid, states.RUNNING, states.FAILED, "test")
    assert "is failed" in edit()["message"]

    bare = site.add_job("bare")  # no caption stage: nothing to edit
    reply = json.loads(handlers.dispatch(site.ctx, p.EditCaption(job=bare, image="a.png", caption="x")))
    assert "has no captions yet" in reply["message"]
    assert not (site.workdir(bare) / EDITS_FILE).exists()


def test_the_files_the_caption_stage_could_not_read_are_named_on_the_job_page(site, tmp_path):
    from daemon.supervisor import caption_edits
    from engine.captioning import stage

    assert caption_edits.SKIPS_FILE == stage.SKIPS_FILE  # the page reads the file the stage writes
    jid = _captioned_job(site, tmp_path)
    with TestClient(site.app, base_url=BASE) as client:
        signed_in(client, site.token)
        assert "id=captions-skipped" not in client.get(f"/jobs/{jid}").text  # nothing skipped: nothing said
        (site.workdir(jid) / "captions_skipped.json").write_text(json.dumps({"broken<b>.png": "ab" * 32}))
        page = client.get(f"/jobs/{jid}").text
        note = re.search(r"<p class=note id=captions-skipped>(.*?)</p>", page).group(1)
        assert note.startswith("1 file could not be read and was skipped") and note.endswith("broken&lt;b&gt;.png")
        (site.workdir(jid) / "captions_skipped.json").write_text(json.dumps({f"bad-{i:02d}.png": "0" for i in range(60)}))
        note = re.search(r"id=captions-skipped>(.*?)</p>", client.get(f"/jobs/{jid}").text).group(1)
        assert note.startswith("60 files") and "bad-49.png" in note and "bad-50.png" not in note
        assert note.endswith("… and 10 more")
