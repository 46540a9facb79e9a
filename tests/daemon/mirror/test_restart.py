"""The mirror across a daemon restart, through the daemon's own parts in process (sshd's SFTP on loopback).

A job that succeeded while its mirror was down has its output mirrored once a restarted daemon finds the
server back; `lorad submit --from` answers at once with the job `fetching`, shows the download's progress, and
a download cut short by the daemon stopping starts again at the next start, then queues the job with the
mirror's checkpoint in place. (The same with a SIGKILLed `lorad serve`: tests/e2e/test_mirror_resume.py.)
"""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from daemon import protocol as p
from daemon.config.daemon import DaemonConfig
from daemon.config.mirrors import MirrorSettings
from daemon.intake.accept import Intake
from daemon.mirror.remote import Remote
from daemon.mirror.service import PENDING, Mirrors
from daemon.mirror.uploader import JobMirror
from daemon.service import handlers
from daemon.store import states
from daemon.store.db import Store
from daemon.supervisor.disk_progress import committed_checkpoints
from engine.config.job import dump_job
from tests.helpers.daemon import wait_until
from tests.helpers.fakes import RecLog
from tests.helpers.processes import REPO


@pytest.fixture
def home(tmp_path, finished_tiny_job, sftp_server):
    """A daemon's store, intake and config (its one mirror: the SFTP server), and the finished tiny job."""
    _job, cfg, workdir, _names = finished_tiny_job
    h = tmp_path / "home"
    h.mkdir()
    settings = sftp_server.mirror(f"restart-{tmp_path.name}")
    dcfg = DaemonConfig.model_validate({"allowed_roots": ["{home}", str(Path(cfg.model.path).parent.parent),
                                                          str(REPO)],
                                        "mirrors": {"nas": settings}, "default_mirror": "nas"})
    store = Store(h / "state.db")
    yield SimpleNamespace(path=h, cfg=dcfg, store=store, log=RecLog(), text=dump_job(cfg), workdir=workdir,
                          remote=Remote("nas", MirrorSettings.model_validate(settings)))
    store.close()


def context(home, mirrors: Mirrors) -> handlers.Context:
    sup = SimpleNamespace(mirrors=mirrors, wake=threading.Event(), notes=[], policy=None, children={})
    return handlers.Context(home=home.path, store=home.store, intake=Intake(home.path, home.cfg, home.store, home.log),
                            supervisor=sup, started_at=time.time(), socket_path=home.path / "lorad.sock")

def on_the_mirror(home, key: str) -> None:
    """The finished tiny job's step-12 checkpoint uploaded under KEY, as its uploader would have."""
    up = JobMirror(key, home.workdir, key, home.remote, 2, home.text, RecLog()).start()
    up.committed(12)
    wait_until(lambda: up.status()["remote_step"] == 12, 60, "the checkpoint on the mirror")
    up.close(timeout=5)


def test_a_job_that_succeeded_while_its_mirror_was_down_is_mirrored_after_a_restart(home, sftp_server):
    ctx = context(home, first := Mirrors(home.path, home.cfg, home.store, home.log))
    jid = ctx.intake.submit_text("tiny.yaml", home.text).job_id
    workdir = Path(home.store.get(jid)["workdir"])
    for part in ("checkpoints", "output", "events.jsonl"):  # what its trainer left: commits and the output
        (shutil.copytree if part != "events.jsonl" else shutil.copy)(home.workdir / part, workdir / part)
    sftp_server.server.kill()
    try:
        first.committed(jid, 12)
        home.store.transition(jid, states.QUEUED, states.RUNNING, "test")
        home.store.transition(jid, states.RUNNING, states.SUCCEEDED, "test", output=str(workdir / "output"))
        first.finished(jid)
        wait_until(lambda: first.status(jid)["last_error"], 30, "the mirror's failure")
        first.close()  # the daemon goes, its output never mirrored
    finally:
        sftp_server.server.start()
    assert home.store.get_meta(PENDING) == f'["{jid}"]'  # what the next daemon must finish

    ctx = context(home, again := Mirrors(home.path, home.cfg, home.store, home.log))
    again.resume(ctx.wake)
    try:
        wait_until(lambda: (again.status(jid) or {}).get("caught_up"), 60, "the output mirrored after the restart")
        row = handlers.status(ctx, p.Status()).jobs[0]
        assert row.state == "succeeded" and row.mirror.caught_up and row.mirror.output_mirrored
        assert row.mirror.remote_step == 12 and row.mirror.behind_steps == 0
        for name in ("adapter_model.safetensors", "lorad-output.json"):
            assert home.remote.get(f"{jid}/output/{name}") == (workdir / "output" / name).read_bytes()
        assert home.store.get_meta(PENDING) == "[]"  # caught up and final: the next start has nothing to do
    finally:
        again.close()


def test_submit_from_answers_at_once_and_a_download_cut_short_starts_again_at_the_next_start(home, monkeypatch):
    on_the_mirror(home, "tiny-1")
    monkeypatch.setenv("LORAD_DEBUG_MIRROR_FETCH_DELAY_S", "0.4")  # a slow link: each file takes its time
    ctx = context(home, first := Mirrors(home.path, home.cfg, home.store, home.log))
    t0 = time.monotonic()
    reply = handlers.submit(ctx, p.Submit(name="from-mirror.yaml", from_mirror="nas/tiny-1"))
    assert time.monotonic() - t0 < 10 and "step-00000012" in reply.restored, reply.restored
    jid = reply.job
    assert home.store.get(jid)["state"] == "fetching"

    def progress() -> str | None:
        shown = handlers.status(ctx, p.Status(job=jid)).job.mirror.fetching
        return shown if shown and "1/" in shown else None

    shown = wait_until(progress, 30, "the download's progress")
    assert shown.startswith("step-00000012: 1/") and " MB" in shown
    first.close()  # the daemon stops mid-download: nothing is queued, the staging folder is left half full
    first.fetches[jid].thread.join(10)
    workdir = Path(home.store.get(jid)["workdir"])
    assert home.store.get(jid)["state"] == "fetching" and not (workdir / "checkpoints").exists()

    monkeypatch.setenv("LORAD_DEBUG_MIRROR_FETCH_DELAY_S", "0")
    again = Mirrors(home.path, home.cfg, home.store, home.log)
    again.resume(lambda: None)
    try:
        wait_until(lambda: home.store.get(jid)["state"] == "queued", 60, "the job queued after the download")
        got = committed_checkpoints(workdir)
        assert [c.path.name for c in got] == ["step-00000012"]
        for f in (home.workdir / "checkpoints" / "step-00000012").rglob("*"):
            if f.is_file():
                assert (got[0].path / f.relative_to(home.workdir / "checkpoints" / "step-00000012")).read_bytes() \
                    == f.read_bytes()
        assert not (home.path / "mirror-staging" / jid).exists()
    finally:
        again.close()


def test_a_job_that_cannot_use_the_mirrors_checkpoints_is_refused_at_submit(home):
    on_the_mirror(home, "tiny-1")
    other = yaml.safe_load(home.text)
    other["train"]["lr"] = 0.005
    ctx = context(home, mirrors := Mirrors(home.path, home.cfg, home.store, home.log))
    try:
        with pytest.raises(p.ProtocolError, match=r"train\.lr 0\.002 → 0\.005"):
            handlers.submit(ctx, p.Submit(name="mine.yaml", from_mirror="nas/tiny-1", text=yaml.safe_dump(other)))
        assert home.store.jobs() == []  # nothing accepted, nothing downloading
    finally:
        mirrors.close()


def test_a_download_whose_checkpoints_turn_out_unusable_ends_the_job_failed_with_the_reason(home):
    # Submit saw only the newest manifest; here the job's own settings differ from every remote checkpoint
    # (accepted as fetching by an earlier daemon): the download refuses them, and the job ends failed, saying why.
    on_the_mirror(home, "tiny-1")
    other = yaml.safe_load(home.text)
    other["train"]["lr"] = 0.005
    intake = Intake(home.path, home.cfg, home.store, home.log)
    jid = intake.submit_text("mine.yaml", yaml.safe_dump(other), "mirror:nas/tiny-1", state=states.FETCHING).job_id
    mirrors = Mirrors(home.path, home.cfg, home.store, home.log)
    mirrors.resume()
    try:
        job = wait_until(lambda: (j := home.store.get(jid))["state"] == "failed" and j, 60, "the job to fail")
        assert "train.lr 0.002 → 0.005" in job["last_error"]
        assert not (Path(job["workdir"]) / "checkpoints").exists()
    finally:
        mirrors.close()


def test_a_fetching_job_whose_mirror_left_the_config_ends_failed_at_the_next_start(home):
    intake = Intake(home.path, home.cfg, home.store, home.log)
    jid = intake.submit_text("tiny.yaml", home.text, "mirror:old-nas/tiny-1", state=states.FETCHING).job_id
    mirrors = Mirrors(home.path, home.cfg, home.store, home.log)
    mirrors.resume()
    job = home.store.get(jid)
    assert job["state"] == "failed" and "'old-nas' is not in this daemon's config" in job["last_error"]


def test_retrying_a_job_whose_download_failed_downloads_again_instead_of_training_from_step_0(home):
    on_the_mirror(home, "tiny-2")
    jid = Intake(home.path, home.cfg, home.store, home.log).submit_text(
        "tiny.yaml", home.text, "mirror:nas/tiny-2", state=states.FETCHING).job_id
    # A daemon started with its mirror missing from the config: the download cannot be made, the job fails.
    Mirrors(home.path, home.cfg.model_copy(update={"mirrors": {}, "default_mirror": None}), home.store,
            home.log).resume()
    assert home.store.get(jid)["state"] == "failed"
    # The mirror back in the config, `lorad retry`: the job downloads again, then queues with the checkpoint.
    mirrors = Mirrors(home.path, home.cfg, home.store, home.log)
    try:
        again = handlers.retry(context(home, mirrors), p.Retry(job=jid))
        assert again.state == "fetching" and "downloaded from the mirror again" in again.message
        job = wait_until(lambda: (j := home.store.get(jid))["state"] == "queued" and j, 60, "the job queued")
        assert (Path(job["workdir"]) / "checkpoints" / "step-00000012" / "manifest.json").is_file()
    finally:
        mirrors.close()
