"""The warm trainer through `lorad serve`: trainers forked from one pre-imported process train bit-identical to
cold ones, are real processes in sessions of their own, and outlive the daemon like cold ones (reconciled)."""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path

import pytest

from daemon import protocol as p
from daemon.system import proc
from tests.helpers.processes import REPO
from tests.helpers import daemon as helpers_daemon
from tests.helpers.daemon import Daemon, adapter_file, daemon_job, fast_config, lorad_run, wait_until, write_yaml

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def warm_job(tmp_path_factory, micro_model) -> Path:
    d = tmp_path_factory.mktemp("warm-job")
    return write_yaml(d / "warm.yaml", daemon_job(micro_model, steps=24, every=4, seq_len=128, batch_size=4))


@pytest.fixture(scope="module")
def reference(warm_job, tmp_path_factory) -> bytes:
    """The same job, uninterrupted, through `lorad run` (a cold trainer)."""
    return adapter_file(lorad_run(warm_job, tmp_path_factory.mktemp("warm-ref")))


@pytest.fixture
def daemon(tmp_path):
    started: list[Daemon] = []

    def start() -> Daemon:
        d = Daemon(tmp_path / "home", fast_config(tmp_path.parent), LORAD_DEBUG_STEP_DELAY_S="0.05")
        started.append(d)
        return d.start()

    yield start
    for d in started:
        d.cleanup()


def log_events(d: Daemon, name: str) -> list[dict]:
    """The daemon log's JSON lines of one event."""
    out = []
    for line in d.log().splitlines():
        if line.startswith("{") and f'"{name}"' in line:
            e = json.loads(line)
            out += [e] if e.get("event") == name else []
    return out


def submit(d: Daemon, job: Path) -> str:
    shutil.copy(job, d.home / "inbox" / job.name)
    return wait_until(lambda: [j["id"] for j in d.jobs()], 60, "the job accepted")[0]


def running_trainer(d: Daemon, step: int) -> proc.Trainer:
    wd = d.home / "jobs"
    wait_until(lambda: any(e.get("event") == "step" and e["step"] >= step
                           for e in map(json.loads, filter(None, next(wd.iterdir()).joinpath("events.jsonl")
                                                                .read_text().splitlines()))),
               120, f"step {step}")
    (t,) = d.trainers()  # found by its command line, like a cold one
    return t


def test_a_warm_trainer_trains_bit_identical_and_a_sigkill_of_it_is_handled_as_today(daemon, warm_job, reference):
    d = daemon()
    jid = submit(d, warm_job)
    t = running_trainer(d, 6)
    (ready,) = log_events(d, "warm_trainer_ready")
    assert proc.parent_pid(t.pid) == ready["pid"]  # forked by the zygote, not exec'd by the daemon
    assert os.getsid(t.pid) == t.pid  # a session (and process group) of its own
    os.kill(t.pid, signal.SIGKILL)
    j = d.wait_state(jid, {"succeeded", "failed"}, 300)
    assert j["state"] == "succeeded", j
    assert adapter_file(d.home / "jobs" / jid) == reference
    attempts = d.call(p.Status(job=jid))["job"]["attempts"]
    assert [a["exit_code"] for a in attempts] == [-signal.SIGKILL, 0]
    assert not log_events(d, "warm_trainer_skipped")  # both attempts forked warm


def test_a_daemon_sigkilled_under_a_warm_trainer_leaves_an_orphan_the_next_daemon_reconciles(daemon, warm_job,
                                                                                            reference):
    d = daemon()
    jid = submit(d, warm_job)
    t = running_trainer(d, 6)
    (ready,) = log_events(d, "warm_trainer_ready")
    d.sigkill()
    wait_until(lambda: not proc.alive(ready["pid"]), 10, "the zygote to exit on EOF")
    assert proc.alive(t.pid)  # its children are left alone
    d2 = daemon()
    assert [e["pid"] for e in log_events(d2, "orphan_trainer")] == [t.pid]
    j = d2.wait_state(jid, {"succeeded", "failed"}, 300)
    assert j["state"] == "succeeded", j
    assert adapter_file(d2.home / "jobs" / jid) == reference


def test_a_stale_warm_trainer_is_never_used_and_a_killed_one_costs_no_job(tmp_path, monkeypatch, daemon, micro_model):
    # lorad's own files, copied: the daemon (and its zygote) run from the copy, which the test may change.
    tree = tmp_path / "lorad"
    for pkg in ("engine", "daemon"):
        shutil.copytree(REPO / pkg, tree / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tree)
    monkeypatch.setattr(helpers_daemon, "REPO", tree)
    d = daemon()
    job = daemon_job(micro_model, steps=3, every=3, seq_len=32)
    job["data"]["path"] = str(shutil.copy(job["data"]["path"], tmp_path))  # under the allowed roots

    def run(name: str) -> tuple[str, dict]:
        write_yaml(d.home / "inbox" / f"{name}.yaml", {**job, "name": name})
        jid = wait_until(lambda: [j["id"] for j in d.jobs() if j["name"] == name], 60, f"job {name} accepted")[0]
        assert d.wait_state(jid, {"succeeded", "failed"}, 300)["state"] == "succeeded"
        (started,) = [e for e in log_events(d, "trainer_started") if e["job"] == jid]
        return jid, started

    warm, started = run("a")
    assert started["warm"] is True
    recipe = tree / "engine" / "recipe.py"
    st = recipe.stat()
    os.utime(recipe, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # lorad "upgraded" underneath it
    cold, started = run("b")
    assert started["warm"] is False
    assert [e["reason"] for e in log_events(d, "warm_trainer_skipped")] == [
        "stale: lorad's files changed since it imported them"]
    assert adapter_file(d.home / "jobs" / cold) == adapter_file(d.home / "jobs" / warm)
    # The stale one was replaced; kill its successor: the next job still runs (forked by a third, or cold).
    ready = wait_until(lambda: log_events(d, "warm_trainer_ready")[1:], 120, "a new warm trainer")
    os.kill(ready[0]["pid"], signal.SIGKILL)
    wait_until(lambda: not proc.alive(ready[0]["pid"]), 10, "the zygote gone")
    third, _ = run("c")
    assert adapter_file(d.home / "jobs" / third) == adapter_file(d.home / "jobs" / warm)
