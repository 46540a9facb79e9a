"""A mirror that cannot work, seen through the daemon's own handlers (in process, the S3 server on loopback):
refused at `lorad submit` when it can be told, else one line in `lorad status` while the job goes on."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import yaml

from daemon import protocol as p
from daemon.client import render
from daemon.config.daemon import DaemonConfig
from daemon.intake.accept import Intake
from daemon.mirror.service import Mirrors
from daemon.service import handlers
from daemon.store.db import Store
from tests.helpers.daemon import wait_until
from tests.helpers.fakes import RecLog
from tests.helpers.jobs import good_job
from tests.helpers.processes import REPO

SECRET = "not-the-secret-at-all"


@pytest.fixture
def daemon(tmp_path, s3_server):
    """The handlers of a daemon whose mirrors are: good (the server), bad (a wrong secret), gone (no bucket),
    nowhere (nothing listens)."""
    wrong = tmp_path / "wrong.yaml"
    wrong.write_text(yaml.safe_dump({**yaml.safe_load(s3_server.credentials.read_text()), "secret": SECRET}))
    home = tmp_path / "home"
    home.mkdir()
    cfg = DaemonConfig.model_validate({"allowed_roots": ["{home}", str(REPO)], "mirrors": {
        "good": s3_server.mirror("submit"),
        "bad": s3_server.mirror("submit", credentials_file=str(wrong)),
        "gone": {**s3_server.mirror("submit"), "url": "s3://no-such-bucket/x"},
        "nowhere": s3_server.mirror("submit", endpoint_url="http://127.0.0.1:9", timeout_s=1.0)}})
    store = Store(home / "state.db")
    log = RecLog()
    mirrors = Mirrors(home, cfg, store, log)
    sup = SimpleNamespace(mirrors=mirrors, wake=threading.Event(), notes=[], policy=None, children={})
    ctx = handlers.Context(home=home, store=store, intake=Intake(home, cfg, store, log), supervisor=sup,
                           started_at=time.time(), socket_path=home / "lorad.sock")
    yield ctx
    mirrors.close()
    store.close()


def submit(ctx, mirror: str | None, name: str = "job"):
    job = good_job(name, output={"mirror": mirror} if mirror else {})
    return handlers.submit(ctx, p.Submit(name=f"{name}.yaml", text=yaml.safe_dump(job)))


@pytest.mark.parametrize("mirror, said", [
    ("bad", "signature"), ("gone", "bucket does not exist"), ("nowhere", "127.0.0.1:9"),
    ("elsewhere", "'elsewhere' is not in this daemon's config"),
])
def test_a_mirror_that_cannot_work_is_refused_at_submit_in_one_line_without_the_secret(daemon, mirror, said):
    with pytest.raises(p.ProtocolError) as e:
        submit(daemon, mirror)
    assert e.value.code == "invalid_job" and said in e.value.message.lower()
    assert "\n" not in e.value.message and SECRET not in e.value.message
    assert daemon.store.jobs() == []  # nothing queued
    assert submit(daemon, "good").job  # the same job with a mirror that works is taken


def test_a_mirror_that_fails_later_is_one_line_in_the_status_while_the_job_goes_on(daemon, capsys):
    # An inbox job is not checked at submit: its mirror's failure shows in the status, and nothing stops the job.
    jid = daemon.intake.submit_text("inbox.yaml", yaml.safe_dump(good_job("inbox", output={"mirror": "bad"}))).job_id
    daemon.supervisor.mirrors.committed(jid, 4)
    wait_until(lambda: (daemon.supervisor.mirrors.status(jid) or {}).get("last_error"), 30, "the mirror's error")
    reply = handlers.status(daemon, p.Status())
    render.print_table(reply.wire())
    (line,) = [ln for ln in capsys.readouterr().out.splitlines() if jid in ln]
    assert "mirror behind by 4 steps" in line and "mirror error" in line and SECRET not in line
    assert reply.jobs[0].state == "queued"  # the job's state is the trainer's business, not the mirror's
    detail = handlers.status(daemon, p.Status(job=jid)).job.mirror
    assert detail.behind_steps == 4 and detail.remote_step is None and "signature" in detail.last_error.lower()
    gone = daemon.intake.submit_text("gone.yaml", yaml.safe_dump(good_job("gone", output={"mirror": "gone"}))).job_id
    daemon.supervisor.mirrors.committed(gone, 4)
    wait_until(lambda: (daemon.supervisor.mirrors.status(gone) or {}).get("last_error"), 30, "the missing bucket")
    assert "bucket does not exist" in daemon.supervisor.mirrors.status(gone)["last_error"]


def test_a_job_done_before_its_mirror_says_so_in_the_queue(capsys):
    lag = p.MirrorLag(mirror="r2", key="svc-1", local_step=24, remote_step=20, behind_steps=4, behind_s=12.0)
    row = {"id": "svc-1", "name": "svc", "state": "succeeded", "priority": 0, "step": 24, "total": 24}
    render.print_table(p.QueueReply(jobs=[p.JobRow(**row, mirror=lag)]))
    (line,) = [ln for ln in capsys.readouterr().out.splitlines() if "svc-1" in ln]
    assert "done, mirror behind" in line and "by 4 steps" in line
    render.print_table(p.QueueReply(jobs=[p.JobRow(**row, mirror=lag.model_copy(update=dict(
        remote_step=24, behind_steps=0, behind_s=0.0, output_mirrored=True, caught_up=True)))]))
    (line,) = [ln for ln in capsys.readouterr().out.splitlines() if "svc-1" in ln]
    assert "succeeded" in line and "mirror" not in line
