"""`lorad status JOB` says when a block type has fallen back to eager (engine/frozen_base/compiling.py's
`compile_fallback` event), and a trainer repeating that line cannot flood the store."""

from __future__ import annotations

import json
import sys
import textwrap

from daemon import protocol as p
from daemon.client.render import print_detail
from daemon.config.daemon import DaemonConfig
from daemon.service.handlers import Context, dispatch
from daemon.store import states
from daemon.store.db import Store
from daemon.supervisor.loop import COMPILE_FALLBACKS, Supervisor
from tests.helpers.daemon import wait_until
from tests.helpers.fakes import RecLog

TRAINER = textwrap.dedent("""
    import json, sys
    def say(ev):
        sys.stdout.write(json.dumps(ev) + "\\n"); sys.stdout.flush()
    say({"event": "step", "step": 1, "total": 2, "loss": 1.0, "s_per_step": 0.1})
    say({"event": "compile_fallback", "block": "FluxTransformerBlock",
         "reason": "dynamo's recompile limit (8 per code object)"})
    for i in range(50):  # a broken (or hostile) trainer saying it again and again
        say({"event": "compile_fallback", "block": f"Other{i}", "reason": "x" * 10_000})
    say({"event": "step", "step": 2, "total": 2, "loss": 0.5, "s_per_step": 0.1})
    say({"event": "done", "step": 2})
""")


def test_status_names_the_block_that_runs_eagerly_and_keeps_a_bounded_few(tmp_path, capsys):
    store = Store(tmp_path / "state.db")
    sup = Supervisor(tmp_path, DaemonConfig(stop_grace_s=5), store, [None], RecLog())
    sup.trainer_command = lambda workdir: [sys.executable, "-c", TRAINER]
    try:
        jid = store.new_id("compiled")
        workdir = tmp_path / "jobs" / jid
        workdir.mkdir(parents=True)
        (workdir / "job.yaml").write_text("name: compiled\n")
        store.add_job(jid, "compiled", workdir, 0, 2, "test")

        def settled():
            sup.tick()
            return store.get(jid)["state"] == states.SUCCEEDED and not sup.children

        wait_until(settled, 60, "the job to end", poll=0.02)
        kept = [e for e in store.events(jid) if e["kind"] == "compile_fallback"]
        assert len(kept) == COMPILE_FALLBACKS and all(len(e["data"]["reason"]) <= 300 for e in kept)
        ctx = Context(home=tmp_path, store=store, intake=None, supervisor=sup, started_at=0, socket_path=tmp_path / "s")
        one = json.loads(dispatch(ctx, p.Status(job=jid)))
        capsys.readouterr()
        print_detail(p.parse_reply(p.Status(job=jid), one["data"]))
        out = capsys.readouterr().out
        assert "compile: eager: FluxTransformerBlock (dynamo's recompile limit (8 per code object))" in out
    finally:
        for c in sup.children.values():
            c.popen.kill()
        store.close()
