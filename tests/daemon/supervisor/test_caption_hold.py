"""data.captioner.hold_for_review, the daemon's side: a trainer that says `captions_ready` and stops leaves its job
paused and held (its stage says so in `lorad status`), a restart of the daemon keeps it held, and `lorad resume`
releases it (WORKDIR/captions_reviewed.json) so that the next attempt trains. A job paused by the user is not
released by its resume. The trainer's own side (it holds, then trains on an edit) is
tests/engine/captioning/test_captions.py's.

The trainer here is a small script that keeps the real one's rule: hold unless the release file is there."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest

from daemon import protocol as p
from daemon.client.render import print_detail, print_table
from daemon.config.daemon import DaemonConfig
from daemon.service import handlers
from daemon.service.recovery import reconcile
from daemon.store import states
from daemon.store.db import Store
from daemon.supervisor.exit_policy import HELD_FOR_REVIEW, decide_exit
from daemon.supervisor.loop import Supervisor
from daemon.system.log import setup
from engine.config.caption_edits import REVIEWED_FILE
from engine.training.stop import EXIT_STOPPED
from tests.helpers.daemon import wait_until

HOLDING_TRAINER = textwrap.dedent("""
    import json, pathlib, sys
    wd = pathlib.Path(sys.argv[1])
    def say(**ev):
        print(json.dumps(ev), flush=True)
    say(event="captioning", images=2, cached=0, to_caption=2)
    say(event="captions_committed", images=["a.png", "b.png"], done=2, total=2, eta_s=0.0)
    if not (wd / "captions_reviewed.json").exists():
        (wd / "captions.json").write_text(json.dumps({"a.png": "sks, a", "b.png": "sks, b"}))
        say(event="captions_ready", images=2, message="captions ready for review")
        sys.exit(75)
    say(event="step", step=1, total=1, loss=1.0)
    say(event="done", step=1)
""")


def _supervisor(home: Path, store: Store) -> Supervisor:
    s = Supervisor(home, DaemonConfig(stop_grace_s=5), store, [None], setup())
    s.trainer_command = lambda workdir: [sys.executable, "-c", HOLDING_TRAINER, str(workdir)]
    return s


def _run_ticks(sup: Supervisor, until) -> None:
    def once():
        sup.tick()
        return until()

    wait_until(once, 20, "the supervisor", poll=0.05)


@pytest.fixture
def home(tmp_path):
    (tmp_path / "jobs").mkdir()
    return tmp_path


def test_held_after_its_captions_kept_held_over_a_restart_and_released_by_resume(home, capsys):
    store = Store(home / "state.db")
    sup = _supervisor(home, store)
    jid = store.new_id("held")
    wd = home / "jobs" / jid
    wd.mkdir()
    store.add_job(jid, "held", wd, 0, 1, "test")
    _run_ticks(sup, lambda: store.get(jid)["state"] == states.PAUSED and not sup.children)
    job = store.get(jid)
    assert (job["stage"], job["step"], job["checkpoint_step"]) == (HELD_FOR_REVIEW, 0, None)
    assert not (wd / REVIEWED_FILE).exists()
    store.close()

    # The daemon restarts: state.db reopened and reconciled; nothing starts a held job.
    store = Store(home / "state.db")
    reconcile(home, DaemonConfig(), store, setup(), boot_id=None)
    sup = _supervisor(home, store)
    for _ in range(5):
        sup.tick()
    job = store.get(jid)
    assert (job["state"], job["stage"]) == (states.PAUSED, HELD_FOR_REVIEW) and not sup.children

    print_table({"jobs": [p.JobRow.model_validate(job).model_dump()]})
    print_detail({"job": p.JobDetail.model_validate({**job, "attempts": [], "events": []}).model_dump()})
    out = capsys.readouterr().out
    assert f"captions ready for review: edit, then lorad resume {jid}" in out
    assert f"lorad caption {jid} IMAGE TEXT" in out and f"then `lorad resume {jid}`" in out

    ctx = handlers.Context(home=home, store=store, intake=None, supervisor=sup, started_at=0.0,
                           socket_path=home / "sock")
    handlers.caption(ctx, p.EditCaption(job=jid, image="a.png", caption="sks, mine"))  # allowed while held
    assert json.loads(handlers.resume(ctx, p.Resume(job=jid)).model_dump_json())["state"] == states.QUEUED
    assert (wd / REVIEWED_FILE).exists() and store.get(jid)["stage"] is None
    _run_ticks(sup, lambda: store.get(jid)["state"] == states.SUCCEEDED)
    store.close()


def test_a_job_the_user_paused_is_not_released_by_its_resume(home):
    store = Store(home / "state.db")
    jid = store.new_id("paused")
    (home / "jobs" / jid).mkdir()
    store.add_job(jid, "paused", home / "jobs" / jid, 0, 1, "test")
    store.transition(jid, states.QUEUED, states.PAUSED, "lorad pause")
    ctx = handlers.Context(home=home, store=store, intake=None, supervisor=None, started_at=0.0,
                           socket_path=home / "sock")
    handlers.resume(ctx, p.Resume(job=jid))
    assert store.get(jid)["state"] == states.QUEUED and not (home / "jobs" / jid / REVIEWED_FILE).exists()
    store.close()


@pytest.mark.parametrize("code, stop, state", [
    (EXIT_STOPPED, None, states.PAUSED),  # its own stop after `captions_ready`
    (-9, None, states.PAUSED),  # killed after saying it: still held, nothing of training lost
    (EXIT_STOPPED, "pause", states.PAUSED),  # the user's pause: paused, not held (its resume holds again)
    (EXIT_STOPPED, "cancel", states.CANCELLED),
    (EXIT_STOPPED, "shutdown", states.INTERRUPTED),  # resumed after the restart, and holds again
])
def test_the_exit_of_a_trainer_that_said_captions_ready(code, stop, state):
    d = decide_exit(code, stop, 0, DaemonConfig(), None, held=True)
    assert d.state == state and (d.reason == HELD_FOR_REVIEW) == (stop is None)


def test_the_dashboard_shows_the_hold_and_its_resume_releases_it_with_the_csrf_token(tmp_path):
    import re

    from starlette.testclient import TestClient

    from tests.helpers.web import BASE, Site, signed_in

    site = Site(tmp_path)
    try:
        jid = site.add_job("held")
        wd = site.workdir(jid)
        (wd / "captions.json").write_text(json.dumps({"red.mp4": "sks, a red square", "still.png": "sks, yellow"}))
        site.store.transition(jid, states.QUEUED, states.PAUSED, HELD_FOR_REVIEW, stage=HELD_FOR_REVIEW)
        with TestClient(site.app, base_url=BASE) as client:
            signed_in(client, site.token)
            page = client.get(f"/jobs/{jid}").text
            assert "id=captions-held" in page and "<textarea" in page  # held: every caption editable
            assert f"<video src='/jobs/{jid}/images/red.mp4'" in page and f"<img src='/jobs/{jid}/images/still.png'" in page
            assert client.post(f"/jobs/{jid}/resume", data={}, headers={"Origin": BASE}).status_code == 403
            assert not (wd / REVIEWED_FILE).exists()  # no CSRF token: refused, nothing released
            csrf = re.search(r"name=csrf value='([0-9a-f]+)'", page).group(1)
            r = client.post(f"/jobs/{jid}/resume", data={"csrf": csrf}, headers={"Origin": BASE})
            assert "it trains on its captions as they are now" in r.text
        assert (wd / REVIEWED_FILE).exists() and site.store.get(jid)["state"] == states.QUEUED
    finally:
        site.close()


def test_the_hold_is_a_notification_of_its_own():
    from daemon.config.notify import NotifySettings
    from daemon.supervisor.notifications import event_of_exit

    assert event_of_exit(states.PAUSED, HELD_FOR_REVIEW) == "captions_ready"
    assert event_of_exit(states.PAUSED, "paused by the user") is None
    assert "captions_ready" in NotifySettings().on  # sent by default, as the other events
