"""A trainer's stdout is input from job code: bounded lines, checked fields, each kind of bad line said once.

The trainer here is a small script that breaks the contract the ways a hostile or broken job could: a 100 MB
line, a string loss (which reached state.db and broke `lorad status` for everyone), a step of 10**100 (which
made every tick fail) and a NaN step, each repeated; then it trains on, and finishes.
"""

from __future__ import annotations

import json
import sys
import textwrap
import tracemalloc

import pytest

from daemon import protocol as p
from daemon.client.render import print_detail, print_table
from daemon.config.daemon import DaemonConfig
from daemon.service.handlers import Context, dispatch
from daemon.store import states
from daemon.store.db import Store
from daemon.supervisor.loop import Supervisor
from tests.helpers.daemon import job_events, wait_until
from tests.helpers.fakes import RecLog

HOSTILE = textwrap.dedent("""
    import json, sys, time
    out = sys.stdout.buffer
    def say(ev):
        out.write(json.dumps(ev).encode() + b"\\n"); out.flush()
    say({"event": "step", "step": 1, "total": 10, "loss": 2.0, "s_per_step": 0.1})
    out.write(b'{"event": "step", "step": 2, "loss": "' + b"x" * 100_000_000 + b'"}\\n'); out.flush()
    for _ in range(200):
        say({"event": "step", "step": 2, "total": 10, "loss": "high"})
        say({"event": "step", "step": 10**100, "total": 10, "loss": 1.0})
        out.write(b'{"event": "step", "step": NaN, "total": 10}\\n')
    say({"event": "checkpoint_committed", "step": 10**100, "path": "x"})
    time.sleep(0.5)  # the daemon's ticks and `lorad status` see what it made of the bad lines
    say({"event": "step", "step": 3, "total": 10, "loss": 0.5, "s_per_step": 0.1})
    say({"event": "done", "step": 3})
""")


@pytest.fixture
def sup(tmp_path):
    store = Store(tmp_path / "state.db")
    s = Supervisor(tmp_path, DaemonConfig(stop_grace_s=5), store, [None], RecLog())
    s.trainer_command = lambda workdir: [sys.executable, "-c", HOSTILE]
    yield s
    for c in s.children.values():
        c.popen.kill()
    store.close()


def test_a_trainer_breaking_the_stdout_contract_is_refused_line_by_line_and_status_keeps_working(sup, tmp_path):
    jid = sup.store.new_id("hostile")
    workdir = tmp_path / "jobs" / jid
    workdir.mkdir(parents=True)
    (workdir / "job.yaml").write_text("name: hostile\n")
    sup.store.add_job(jid, "hostile", workdir, 0, 10, "test")
    ctx = Context(home=tmp_path, store=sup.store, intake=None, supervisor=sup, started_at=0,
                  socket_path=tmp_path / "s")

    replies = []
    tracemalloc.start()
    try:
        def settled():
            sup.tick()
            replies.append(json.loads(dispatch(ctx, p.Status())))
            return sup.store.get(jid)["state"] not in (states.QUEUED, states.RUNNING) and not sup.children

        wait_until(settled, 60, "the hostile trainer's job to end", poll=0.02)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 20 << 20, f"the daemon held {peak >> 20} MiB while reading a 100 MB line"

    # The job went on with what it could believe, and finished.
    job = sup.store.get(jid)
    assert job["state"] == states.SUCCEEDED and job["step"] == 3 and job["loss"] == 0.5
    # No tick step failed (the watchdog kept being fed), and `lorad status` answered all along.
    assert not sup.log.named("tick_step_failed"), sup.log.named("tick_step_failed")
    assert all(r["ok"] for r in replies), [r for r in replies if not r["ok"]][:1]

    # `lorad status` now, the list and one job, through the handler and the CLI's rendering.
    listed = json.loads(dispatch(ctx, p.Status()))
    one = json.loads(dispatch(ctx, p.Status(job=jid)))
    assert listed["ok"] and one["ok"], (listed, one)
    print_table(p.parse_reply(p.Status(), listed["data"]))
    print_detail(p.parse_reply(p.Status(job=jid), one["data"]))

    # Each kind of bad line said once (not 200 times), with a reason, in the daemon's log and the job's events.
    said = sup.log.named("trainer_output_refused")
    kinds = sorted(kw["kind"] for kw in said)
    assert kinds == ["checkpoint_committed.step", "step.loss", "step.step", "too_long"], said
    reasons = {kw["kind"]: kw["reason"] for kw in said}
    assert "100000" in reasons["too_long"] and "1048576" in reasons["too_long"]
    assert "less than or equal to" in reasons["step.step"] and "valid number" in reasons["step.loss"]
    assert [e["kind"] for e in job_events(workdir) if e["event"] == "trainer_output_refused"] == \
        [kw["kind"] for kw in said]
    assert sup.log.named("trainer_exited")[0]["refused_lines"] == 1 + 200 * 3 + 1


def test_lines_are_cut_at_the_cap_wherever_the_chunks_end():
    import io

    from daemon.supervisor.trainer_output import TooLong, lines

    data = b"short\n" + b"x" * 9 + b"\n12345678\n" + b"y" * 30 + b"\n\ntail"
    got = list(lines(io.BufferedReader(io.BytesIO(data), buffer_size=4), cap=8))
    assert got == [b"short", TooLong(9), b"12345678", TooLong(30), b"", b"tail"]
    assert list(lines(io.BufferedReader(io.BytesIO(b"z" * 20)), cap=8)) == [TooLong(20)]


def test_the_step_read_back_from_events_jsonl_at_start_up_is_checked_the_same_way(tmp_path):
    from daemon.supervisor.disk_progress import last_event_step

    with open(tmp_path / "events.jsonl", "w") as f:
        f.write(json.dumps({"event": "step", "step": 7, "total": 10, "loss": 1.0}) + "\n")
        f.write(json.dumps({"event": "step", "step": 10**100, "total": 10}) + "\n")  # the trainer user can write it
        f.write(json.dumps({"event": "done", "step": True}) + "\n")
    assert last_event_step(tmp_path) == 7
