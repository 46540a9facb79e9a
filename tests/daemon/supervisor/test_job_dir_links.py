"""What a trainer user plants in its job's directory (jobs/ID/ is handed to it) never reaches past it, and never
blocks the service loop (issue 23, findings 2 and 4).

Through the real code paths: intake accepts the job, the supervisor starts it (a fake trainer that fails with a
line on stderr), `lorad logs` and `lorad status` answer over the handlers. The attacker is the test itself, with
files it owns: a symlink at events.jsonl, trainer.log or trainer.lock points at a "victim" outside the job's
directory, which must stay byte-identical and must never be shown; a FIFO at job.yaml must not stall a tick.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from daemon import protocol as p
from daemon.config.daemon import DaemonConfig
from daemon.intake.accept import Intake
from daemon.service.handlers import Context, dispatch
from daemon.store import states
from daemon.store.db import Store
from daemon.supervisor.loop import Supervisor
from tests.helpers.fakes import RecLog
from tests.helpers.jobs import QUICKSTART_DATA

FAILING_TRAINER = "import sys; print('boom: the fake trainer failed', file=sys.stderr); sys.exit(1)"
SECRET = b'{"event": "secret", "text": "the root-only file\'s contents"}\n'


@pytest.fixture
def accepted(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    store = Store(home / "state.db")
    cfg = DaemonConfig(allowed_roots=["{home}", str(QUICKSTART_DATA.parent)], backoff_base_s=0.1)
    intake = Intake(home, cfg, store, RecLog())
    job = {"name": "victim", "model": {"path": "builtin:tiny-llama", "dtype": "float32"},
           "data": {"path": str(QUICKSTART_DATA), "seq_len": 32}, "train": {"steps": 2}}
    job_id = intake.submit_text("victim.yaml", yaml.safe_dump(job)).job_id
    sup = Supervisor(home, cfg, store, [None], RecLog(), intake=intake)
    sup.trainer_command = lambda workdir: [sys.executable, "-c", FAILING_TRAINER]
    ctx = Context(home=home, store=store, intake=intake, supervisor=sup, started_at=0, socket_path=home / "s")
    yield SimpleNamespace(home=home, store=store, sup=sup, ctx=ctx, job_id=job_id, workdir=home / "jobs" / job_id)
    for c in sup.children.values():
        c.popen.kill()
        c.popen.wait()
    store.close()


def plant(workdir: Path, name: str, victim: Path) -> bytes:
    """Replace jobs/ID/NAME by a symlink to `victim` (0600, holding SECRET); what the victim holds."""
    victim.write_bytes(SECRET)
    victim.chmod(0o600)
    (workdir / name).unlink(missing_ok=True)
    (workdir / name).symlink_to(victim)
    return victim.read_bytes()


def until_no_child(sup: Supervisor, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    sup.tick()
    while sup.children and time.monotonic() < deadline:
        time.sleep(0.05)
        sup.tick()
    assert not sup.children, "the fake trainer never exited"


def test_a_link_at_events_jsonl_is_never_appended_to_or_shown_by_logs(accepted, tmp_path):
    victim = tmp_path / "events-victim"
    before = plant(accepted.workdir, "events.jsonl", victim)
    until_no_child(accepted.sup)  # attempt_started, trainer_exited: the daemon's lines for events.jsonl
    assert victim.read_bytes() == before, "the daemon appended through the planted link"
    job = accepted.store.get(accepted.job_id)
    assert "boom: the fake trainer failed" in job["last_error"], job  # it ran; its trainer.log was read
    reply = dispatch(accepted.ctx, p.Logs(job=accepted.job_id, tail=50)).decode()
    assert "secret" not in reply and "root-only" not in reply, reply
    assert "events.jsonl" in reply  # refused with a reason that names the file
    status = json.loads(dispatch(accepted.ctx, p.Status()))  # the daemon answers; the job is not lost
    assert status["ok"] and [j["id"] for j in status["data"]["jobs"]] == [accepted.job_id]
    assert accepted.sup.healthy


def test_a_link_at_trainer_log_is_never_appended_to_and_the_start_is_refused_saying_why(accepted, tmp_path):
    victim = tmp_path / "log-victim"
    before = plant(accepted.workdir, "trainer.log", victim)
    until_no_child(accepted.sup)
    assert victim.read_bytes() == before, "the trainer's stderr went through the planted link"
    job = accepted.store.get(accepted.job_id)
    assert job["state"] == states.QUEUED and "trainer.log is a symlink" in job["last_error"], job
    assert accepted.sup.healthy and json.loads(dispatch(accepted.ctx, p.Status()))["ok"]


def test_a_link_at_trainer_lock_is_never_locked_or_truncated_and_the_job_fails_saying_why(accepted, tmp_path):
    victim = tmp_path / "lock-victim"
    before = plant(accepted.workdir, "trainer.lock", victim)
    accepted.sup.tick()
    assert victim.read_bytes() == before
    job = accepted.store.get(accepted.job_id)
    assert job["state"] == states.FAILED and "trainer.lock" in job["last_error"], job
    assert accepted.sup.healthy and json.loads(dispatch(accepted.ctx, p.Status()))["ok"]


def test_a_fifo_at_job_yaml_does_not_stall_the_loop(accepted, monkeypatch):
    fifo = accepted.workdir / "job.yaml"
    fifo.unlink()
    os.mkfifo(fifo)
    monkeypatch.setattr(accepted.sup, "trainer_command",
                        lambda workdir: [sys.executable, "-c", "import time; time.sleep(30)"])
    t = threading.Thread(target=accepted.sup.tick, daemon=True)
    t0 = time.monotonic()
    t.start()
    t.join(timeout=1.0)
    stalled = t.is_alive()
    while t.is_alive() and time.monotonic() - t0 < 20:  # free a stalled tick: each open of the FIFO gets EOF
        try:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            time.sleep(0.01)
    assert not stalled, "a tick blocked opening the FIFO at jobs/ID/job.yaml"
    # The daemon acts on the job it accepted (state.db), not on what is at job.yaml now: it started it.
    assert accepted.store.get(accepted.job_id)["state"] == states.RUNNING
    assert accepted.sup.healthy and json.loads(dispatch(accepted.ctx, p.Status()))["ok"]
