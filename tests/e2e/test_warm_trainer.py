"""The warm trainer through `lorad serve`: trainers forked from one pre-imported process train bit-identical to
cold ones, are real processes in sessions of their own, outlive the daemon like cold ones (reconciled), are never
used stale, and a zygote that dies mid-start never leads to a second trainer of one job.

One chain (each step's daemon and zygote serve the next): every zygote start costs a full import of the stack."""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from pathlib import Path

import pytest
import yaml

from daemon import protocol as p
from daemon.system import proc
from tests.helpers import daemon as helpers_daemon
from tests.helpers.daemon import Daemon, adapter_file, fast_config, held_until_sigterm, wait_until, write_yaml
from tests.helpers.processes import REPO

pytestmark = pytest.mark.slow


def log_events(d: Daemon, name: str) -> list[dict]:
    """This daemon's JSON log lines of one event (an earlier daemon of the same home wrote the start of the file)."""
    out = []
    for line in d.log()[getattr(d, "log_from", 0):].splitlines():
        if line.startswith("{") and f'"{name}"' in line:
            e = json.loads(line)
            out += [e] if e.get("event") == name else []
    return out


def submit(d: Daemon, job: dict, name: str) -> str:
    write_yaml(d.home / "inbox" / f"{name}.yaml", {**job, "name": name})
    return wait_until(lambda: [j["id"] for j in d.jobs() if j["name"] == name], 60, f"job {name} accepted")[0]


def at_step(d: Daemon, jid: str, step: int) -> None:
    events = d.home / "jobs" / jid / "events.jsonl"
    wait_until(lambda: events.exists() and any(
        e.get("event") == "step" and e["step"] >= step for e in map(json.loads, events.read_text().splitlines())),
        120, f"step {step}")


def succeeded(d: Daemon, jid: str) -> bytes:
    j = d.wait_state(jid, {"succeeded", "failed"}, 300)
    assert j["state"] == "succeeded", j
    return adapter_file(d.home / "jobs" / jid)


def started(d: Daemon, jid: str) -> list[dict]:
    return [e for e in log_events(d, "trainer_started") if e["job"] == jid]


@pytest.fixture
def tree(tmp_path, monkeypatch) -> Path:
    """lorad's own files, copied: the daemons (and their zygotes) run from the copy, which the test may change."""
    tree = tmp_path / "lorad"
    for pkg in ("engine", "daemon"):
        shutil.copytree(REPO / pkg, tree / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tree)
    monkeypatch.setattr(helpers_daemon, "REPO", tree)
    return tree


def test_warm_trainers_train_bit_identical_survive_kills_are_never_stale_and_never_doubled(
        tmp_path, tree, svc_job, svc_reference):
    job = yaml.safe_load(svc_job.read_text())
    job["data"]["path"] = str(shutil.copy(job["data"]["path"], tmp_path))  # under the allowed roots
    cfg = fast_config(tmp_path.parent)
    d = Daemon(tmp_path / "home", cfg, LORAD_DEBUG_STEP_DELAY_S="0.05").start()
    try:
        # Forked by the zygote, in a session of its own, found like a cold trainer; a SIGKILL of it is a crash.
        jid = submit(d, job, "svc")
        at_step(d, jid, 6)
        (t,) = d.trainers()
        (ready,) = log_events(d, "warm_trainer_ready")
        assert proc.parent_pid(t.pid) == ready["pid"] and os.getsid(t.pid) == t.pid
        os.kill(t.pid, signal.SIGKILL)
        # The daemon SIGKILLed under its second warm trainer: the zygote exits on EOF, the trainer is an orphan.
        at_step(d, jid, 14)
        (t,) = d.trainers()
        assert proc.parent_pid(t.pid) == ready["pid"] and not log_events(d, "warm_trainer_skipped")
        d.sigkill()
        wait_until(lambda: not proc.alive(ready["pid"]), 10, "the zygote to exit on EOF")
        assert proc.alive(t.pid)
    except BaseException:
        d.cleanup()  # not on success: the orphan is the next daemon's to find
        raise
    # The next daemon: its first zygote dies (SIGKILL) after forking the job's trainer, before answering. The start
    # failed, and the job never has two trainers: none starts while that orphan lives (it holds the job's lock);
    # then a new zygote forks it and it ends bit-identical; the zygote's death cost no job.
    marker = tmp_path / "zygote-dies"
    marker.touch()
    d = Daemon(tmp_path / "home", cfg, LORAD_TEST_ZYGOTE_DIES_AFTER_FORK=str(marker))
    d.log_from = len(d.log())
    with held_until_sigterm([t.pid]):  # the orphan must still be there when this daemon looks
        d.start(wait=False)
    d.wait_ready()
    try:
        assert [e["pid"] for e in log_events(d, "orphan_trainer")] == [t.pid]
        forked = tmp_path / "zygote-dies.pid"
        orphan = int(wait_until(lambda: forked.exists() and forked.read_text(), 60, "the fork before the death"))
        while proc.alive(orphan):
            assert started(d, jid) == [], "a second trainer started while the first one lived"
            time.sleep(0.02)
        (failed,) = log_events(d, "spawn_failed")
        assert failed["job"] == jid and "died before answering" in failed["error"]
        assert succeeded(d, jid) == svc_reference
        attempts = d.call(p.Status(job=jid))["job"]["attempts"]
        assert attempts[0]["exit_code"] == -signal.SIGKILL and attempts[-1]["exit_code"] == 0
        assert [e["warm"] for e in started(d, jid)] == [True]
        # lorad "upgraded" underneath the zygote: the next trainer starts cold, and says why.
        recipe = tree / "engine" / "recipe.py"
        st = recipe.stat()
        os.utime(recipe, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
        cold = submit(d, {**job, "train": {**job["train"], "steps": 4}}, "cold")
        d.wait_state(cold, {"succeeded"}, 300)
        assert [e["warm"] for e in started(d, cold)] == [False]
        assert [e["reason"] for e in log_events(d, "warm_trainer_skipped")] == [
            "stale: lorad's files changed since it imported them"]
        d.terminate()  # its successor, still importing, goes with it
    finally:
        d.cleanup()
