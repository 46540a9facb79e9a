"""Priority means something: the preemption decision and the queue's order as tables, then the supervisor acting
on them with small python scripts as trainers (no torch)."""

from __future__ import annotations

import json
import sys

import pytest

from daemon import protocol as p
from daemon.client.render import print_table
from daemon.config.daemon import DaemonConfig
from daemon.service.handlers import Context, dispatch
from daemon.store import states
from daemon.store.db import Store
from daemon.supervisor.loop import Supervisor
from daemon.supervisor.scheduling import Runner, Waiter, status_order, to_preempt
from daemon.system.log import setup
from tests.daemon.supervisor.test_supervisor import FAKE_TRAINER, FakePolicy, run_ticks


def R(jid, prio, devices=1, started=0.0, stopping=False):
    return Runner(jid, prio, devices, started, stopping)


@pytest.mark.parametrize("first, running, free, enabled, yields", [
    (None, [R("a", 0)], 0, True, []),  # nothing waits
    (Waiter("h", 10, 1), [R("a", 0)], 1, True, []),  # a device is free: it just starts
    (Waiter("h", 10, 1), [R("a", 0)], 0, True, ["a"]),  # every device runs lower-priority work: it yields
    (Waiter("h", 10, 1), [R("a", 0)], 0, False, []),  # preempt: false
    (Waiter("h", 0, 1), [R("a", 0)], 0, True, []),  # equal priority never preempts
    (Waiter("h", 5, 1), [R("a", 9)], 0, True, []),  # higher-priority work keeps running
    (Waiter("h", 10, 1), [R("a", 3), R("b", 1), R("c", 1, started=5.0)], 0, True, ["c"]),  # lowest, then youngest
    (Waiter("h", 10, 2), [R("a", 3), R("b", 1), R("c", 12)], 0, True, ["b", "a"]),  # a gang: just enough room
    (Waiter("h", 10, 3), [R("a", 3), R("b", 1), R("c", 12)], 0, True, []),  # not enough room even so: nobody
    (Waiter("h", 10, 2), [R("a", 3), R("b", 1)], 1, True, ["b"]),  # one free device plus one yielded
    (Waiter("h", 10, 1), [R("a", 0, stopping=True), R("b", 0)], 0, True, []),  # a stop under way makes room
])
def test_who_yields_to_the_first_job_in_line(first, running, free, enabled, yields):
    assert to_preempt(first, running, free, enabled) == yields


def J(jid, state, prio=0, seq=0, not_before=0.0):
    return {"id": jid, "state": state, "priority": prio, "seq": seq, "not_before": not_before}


def test_status_lists_running_then_the_queue_in_the_order_it_will_run_then_the_rest():
    jobs = [J("done", "succeeded", seq=1), J("low", "queued", 0, seq=2), J("run", "running", 0, seq=3),
            J("high", "queued", 10, seq=4), J("later", "queued", 50, seq=5, not_before=2000.0),
            J("low2", "queued", 0, seq=6), J("paused", "paused", seq=7), J("wait", "waiting", seq=8),
            J("failed", "failed", seq=0)]
    order = [j["id"] for j in status_order(jobs, now=1000.0)]
    assert order == ["run", "high", "low", "low2", "later", "wait", "paused", "failed", "done"]


@pytest.fixture
def sup(tmp_path):
    store = Store(tmp_path / "state.db")
    s = Supervisor(tmp_path, DaemonConfig(stop_grace_s=5, retry_budget=0), store, [None], setup(), policy=FakePolicy())
    s.trainer_command = lambda workdir: [sys.executable, "-c", FAKE_TRAINER, str(tmp_path / "marks")]
    yield s
    for c in s.children.values():
        c.popen.kill()
    store.close()


def queued(sup: Supervisor, tmp_path, name: str, priority: int) -> str:
    jid = sup.store.new_id(name)
    wd = tmp_path / "jobs" / jid
    wd.mkdir(parents=True)
    sup.store.add_job(jid, name, wd, priority, 1000, "test")
    return jid


def test_a_higher_priority_job_makes_the_lower_one_checkpoint_and_yield_with_nothing_counted(sup, tmp_path):
    low = queued(sup, tmp_path, "low", 0)
    run_ticks(sup, lambda: low in sup.children and sup.store.get(low)["step"] > 0)
    high = queued(sup, tmp_path, "high", 10)
    run_ticks(sup, lambda: high in sup.children)
    job = sup.store.get(low)
    assert job["state"] == states.QUEUED and job["retries"] == 0  # retry_budget 0: a counted crash would fail it
    exits = [e["data"] for e in sup.store.events(low) if e["kind"] == "transition"]
    assert exits[-2]["to"] == states.INTERRUPTED and exits[-2]["reason"] == f"preempt: yields to {high} (priority 10)"
    assert sup.store.attempts(low)[-1]["exit_code"] == 75  # it checkpointed and exited as asked
    sup.store.update(high, priority=-5)  # now the yielded job outranks the running one: it comes back
    run_ticks(sup, lambda: low in sup.children)


def test_with_preempt_off_a_higher_priority_job_waits_for_a_free_device(sup, tmp_path):
    sup.cfg = DaemonConfig(preempt=False)
    low = queued(sup, tmp_path, "low", 0)
    run_ticks(sup, lambda: low in sup.children and sup.store.get(low)["step"] > 0)
    high = queued(sup, tmp_path, "high", 10)
    for _ in range(5):
        sup.tick()
    assert low in sup.children and sup.children[low].stop_reason is None
    assert sup.store.get(high)["state"] == states.QUEUED


def test_lorad_status_shows_the_priority_column_and_the_queue_in_run_order(tmp_path, capsys):
    store = Store(tmp_path / "state.db")
    try:
        for name, prio in (("first", 0), ("second", 7), ("third", 3)):
            store.add_job(f"{name}-0000", name, tmp_path / name, prio, 10, "test")
        ctx = Context(home=tmp_path, store=store, intake=None, supervisor=None, started_at=0.0,
                      socket_path=tmp_path / "s")
        data = json.loads(dispatch(ctx, p.Status()))["data"]
        assert [j["id"] for j in data["jobs"]] == ["second-0000", "third-0000", "first-0000"]
        print_table(data)
        lines = capsys.readouterr().out.splitlines()
        assert lines[0].split()[:4] == ["ID", "NAME", "STATE", "PRIO"]
        assert lines[1].split()[:4] == ["second-0000", "second", "queued", "7"]
    finally:
        store.close()
