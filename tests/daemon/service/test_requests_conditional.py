"""Pause and cancel are conditional on the state they were meant for: a request that finds the job moved on
(the trainer exited between the asker's look and the write) is refused with a clear message and changes
nothing, so a queued job is never started and stopped at once and a finished job keeps no stale flag."""

from __future__ import annotations

import pytest

from daemon import protocol as p
from daemon.service.handlers import Context, dispatch
from daemon.store import states
from daemon.store.db import Store


def ctx_for(store: Store, tmp_path) -> Context:
    return Context(home=tmp_path, store=store, intake=None, supervisor=None, started_at=0.0,
                   socket_path=tmp_path / "lorad.sock")


def running(store: Store, tmp_path) -> str:
    jid = store.new_id("job")
    store.add_job(jid, "job", tmp_path / "jobs" / jid, 0, 100, "test")
    store.begin_attempt(jid, 0)
    return jid


def exited(store: Store, jid: str, dst: str) -> None:
    store.end_run(jid, 1, 5, "boom", lambda row: ([(dst, "trainer exited", {})], None))


def seen_as_running(store: Store, monkeypatch, jid: str) -> None:
    """The handler reads the job while it still runs; the trainer exits before the handler writes."""
    stale = store.get(jid)
    assert stale["state"] == states.RUNNING
    real_find = store.find
    monkeypatch.setattr(store, "find", lambda ref: stale if ref == jid else real_find(ref))


def reply(ctx: Context, req) -> dict:
    import json

    return json.loads(dispatch(ctx, req))


@pytest.mark.parametrize("verb", [p.Pause, p.Cancel])
def test_a_stop_asked_of_a_trainer_that_exited_meanwhile_is_refused_and_the_requeued_job_starts_unhindered(
        store, tmp_path, monkeypatch, verb):
    jid = running(store, tmp_path)
    seen_as_running(store, monkeypatch, jid)
    exited(store, jid, states.QUEUED)  # crashed: queued again for a retry
    r = reply(ctx_for(store, tmp_path), verb(job=jid))
    assert not r["ok"] and r["error"] == "conflict" and "stopped running meanwhile" in r["message"]
    assert store.get(jid)["requested"] is None  # the next attempt will not be stopped the moment it starts
    store.begin_attempt(jid, 5)
    assert store.get(jid)["requested"] is None


@pytest.mark.parametrize("verb", [p.Pause, p.Cancel])
def test_a_finished_job_keeps_no_stale_stop_flag(store, tmp_path, monkeypatch, verb):
    jid = running(store, tmp_path)
    seen_as_running(store, monkeypatch, jid)
    exited(store, jid, states.SUCCEEDED)
    r = reply(ctx_for(store, tmp_path), verb(job=jid))
    assert not r["ok"] and r["error"] == "conflict"
    job = store.get(jid)
    assert job["state"] == states.SUCCEEDED and job["requested"] is None


def test_a_request_carrying_the_state_it_was_meant_for_is_refused_once_the_job_moved_on(store, tmp_path):
    jid = running(store, tmp_path)
    exited(store, jid, states.QUEUED)
    r = reply(ctx_for(store, tmp_path), p.Pause(job=jid, expect=states.RUNNING))
    assert not r["ok"] and r["error"] == "conflict" and "queued now, not running" in r["message"]
    assert store.get(jid)["state"] == states.QUEUED  # not paused: that pause was meant for the running attempt


def test_a_stop_asked_of_a_running_job_is_recorded_for_its_trainer(store, tmp_path):
    jid = running(store, tmp_path)
    r = reply(ctx_for(store, tmp_path), p.Cancel(job=jid, expect=states.RUNNING))
    assert r["ok"] and store.get(jid)["requested"] == "cancel"
