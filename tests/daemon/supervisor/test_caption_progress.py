"""The caption stage's events (engine/captioning/stage.py: `captioning`, then `captions_committed` per batch) are
the job's progress while it captions: in `lorad status`, `lorad status ID` and on the dashboard, with the stage's
ETA; the first training step (or the phase after the stage) takes the progress back."""

from __future__ import annotations

import time

import pytest
from starlette.testclient import TestClient

from daemon.client.render import print_detail, print_table
from daemon.protocol import JobDetail, JobRow
from daemon.store import states
from daemon.supervisor import trainer_output
from daemon.supervisor.trainer import Child
from tests.helpers.web import BASE, Site, signed_in

# what the caption stage prints (engine/captioning/stage.py)
STARTED = {"event": "captioning", "images": 8, "cached": 2, "to_caption": 6, "captioner": "builtin:tiny-captioner"}
BATCH = {"event": "captions_committed", "images": ["a.png", "b.png"], "done": 2, "total": 6, "eta_s": 90.0}


def _child(job_id: str, tmp_path) -> Child:
    return Child(job_id=job_id, name="tiny", workdir=tmp_path, popen=None, pid=1, pid_start=None, gpu=None,
                 attempt=1, start_step=0, total=12, power={})


def _heard(c: Child, *events: dict) -> None:
    for ev in events:  # through the daemon's check of trainer stdout, as the reader thread does
        c.heard(trainer_output.checked(dict(ev)), time.monotonic())


@pytest.fixture
def site(tmp_path):
    s = Site(tmp_path)
    yield s
    s.close()


def test_captioning_is_the_running_jobs_progress_in_both_status_views_and_on_the_dashboard(site, tmp_path, capsys):
    jid = site.add_job("tiny", total=12)
    site.store.transition(jid, states.QUEUED, states.RUNNING, "test", gpu=0)
    c = _child(jid, tmp_path)
    _heard(c, STARTED)
    assert c.progress()["stage"] == "captioning 0/6"
    _heard(c, BATCH)
    site.store.update(jid, **c.progress())
    job = site.store.get(jid)
    assert (job["stage"], job["eta_s"]) == ("captioning 2/6", 90.0)

    print_table({"jobs": [JobRow.model_validate(job).model_dump()]})
    header, row = (ln.split() for ln in capsys.readouterr().out.splitlines()[:2])
    at = header.index("STEP")
    assert row[at:at + 2] == ["captioning", "2/6"] and "1m30s" in row
    print_detail({"job": JobDetail.model_validate({**job, "attempts": [], "events": []}).model_dump()})
    assert "step: 0/12 (captioning 2/6 images)" in capsys.readouterr().out

    client = TestClient(site.app, base_url=BASE)
    signed_in(client, site.token)
    for page in (client.get("/jobs").text, client.get(f"/jobs/{jid}").text):
        assert "captioning 2/6 images" in page and "width:33.3%" in page and "1m30s" in page


def test_the_stage_ends_with_the_phase_after_it_or_the_first_step(tmp_path):
    c = _child("tiny-1", tmp_path)
    _heard(c, STARTED, BATCH, {"event": "phase", "phase": "prepare"})
    assert c.progress()["stage"] == "captioning 2/6"  # the latent cache is still the prepare phase
    _heard(c, {"event": "phase", "phase": "load_model"})
    assert c.progress()["stage"] is None and c.eta_s is None
    _heard(c, BATCH, {"event": "step", "step": 1, "total": 12, "loss": 1.0, "eta_s": 30.0})
    assert c.progress()["stage"] is None and c.progress()["eta_s"] == 30.0


def test_a_cached_stage_shows_nothing_and_bad_counts_are_refused(tmp_path):
    c = _child("tiny-1", tmp_path)
    _heard(c, {**STARTED, "cached": 8, "to_caption": 0})
    assert c.progress()["stage"] is None  # nothing to generate: no stage to watch
    for bad in ({**BATCH, "done": "2"}, {**BATCH, "total": -1}, {**BATCH, "eta_s": -5.0}):
        with pytest.raises(trainer_output.Refused, match="captions_committed line refused"):
            trainer_output.checked(bad)
