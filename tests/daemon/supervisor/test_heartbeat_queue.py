"""The heartbeat queue between a trainer's stdout and the loop is bounded: a trainer printing faster than the loop
drains costs the daemon a bounded amount of memory, its latest progress and its other events are kept, and the
loss is said once."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from daemon.config.daemon import DaemonConfig
from daemon.store.db import Store
from daemon.supervisor.beats import LIMIT, BeatQueue
from daemon.supervisor.loop import Supervisor
from daemon.supervisor.trainer import Child
from tests.helpers.fakes import RecLog

STEPS = 3 * LIMIT
FLOOD = textwrap.dedent(f"""
    import json, sys
    out = sys.stdout
    for i in range(1, {STEPS} + 1):
        out.write(json.dumps({{"event": "step", "step": i, "total": {STEPS}, "loss": 1.0}}) + "\\n")
        if i == 10:
            out.write(json.dumps({{"event": "checkpoint_committed", "step": 10, "path": "c"}}) + "\\n")
    out.flush()
""")


class Counting:
    def __init__(self):
        self.events: list[dict] = []

    def on_heartbeat(self, job_id, event):
        self.events.append(event)

    def __getattr__(self, name):
        return lambda *a, **k: None


def test_a_trainer_flooding_a_stalled_loop_queues_at_most_the_limit_keeping_its_latest_step(tmp_path):
    store = Store(tmp_path / "state.db")
    sup = Supervisor(tmp_path, DaemonConfig(stop_grace_s=5), store, [None], RecLog(), policy=Counting())
    jid = store.new_id("flood")
    wd = tmp_path / "jobs" / jid
    wd.mkdir(parents=True)
    store.add_job(jid, "flood", wd, 0, STEPS, "test")
    store.begin_attempt(jid, 0)
    popen = subprocess.Popen([sys.executable, "-c", FLOOD], stdout=subprocess.PIPE, start_new_session=True)
    c = Child(job_id=jid, name="flood", workdir=wd, popen=popen, pid=popen.pid, pid_start=None, gpu=None,
              attempt=1, start_step=0, total=STEPS, power={})
    sup.children[jid] = c
    c.start_reader(sup.beats, sup.wake)
    c.reader.join(30)  # the loop has not ticked while the trainer printed everything
    popen.wait(10)
    try:
        sup.heartbeats()
        seen = sup.policy.events
        assert len(seen) <= LIMIT, f"{len(seen)} heartbeats were queued (limit {LIMIT})"
        assert seen[-1]["step"] == STEPS  # the latest progress is never what goes
        assert [e["event"] for e in seen].count("checkpoint_committed") == 1  # nor an event that is not a step
        assert store.get(jid)["checkpoint_step"] == 10
        said = sup.log.named("heartbeats_dropped")
        assert len(said) == 1 and said[0]["merged_steps"] == STEPS + 1 - len(seen) and said[0]["dropped"] == 0
        sup.heartbeats()
        assert len(sup.log.named("heartbeats_dropped")) == 1  # said once
    finally:
        store.close()


def test_when_only_other_events_fill_the_queue_the_oldest_goes_and_is_counted():
    q = BeatQueue(limit=3)
    for i in range(5):
        q.put(("j", 1, {"event": "phase", "n": i}))
    q.put(("j", 1, {"event": "step", "step": 1}))
    assert [q.pop()[2].get("n") for _ in range(3)] == [3, 4, None]
    assert q.pop() is None and (q.merged, q.dropped) == (0, 3)
