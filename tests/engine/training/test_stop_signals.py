"""Ctrl-C in a terminal: the first stops after the step with a checkpoint, the second at once — both say so."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

from tests.helpers.processes import REPO, child_env

WAITS_FOR_CTRL_C = textwrap.dedent("""
    import sys, time
    from engine.training.stop import StopFlag
    stop = StopFlag()
    stop.install()
    print("ready", flush=True)
    while True:
        time.sleep(0.05)
        if stop.requested:
            print("asked", flush=True)
            time.sleep(60)  # the final checkpoint, taking its time
""")


def test_two_ctrl_cs_exit_130_with_a_message_each():
    p = subprocess.Popen([sys.executable, "-c", WAITS_FOR_CTRL_C], cwd=REPO, env=child_env(), text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert p.stdout.readline() == "ready\n"
        p.send_signal(signal.SIGINT)
        assert p.stdout.readline() == "asked\n"
        p.send_signal(signal.SIGINT)
        assert p.wait(timeout=10) == 130
    finally:
        p.kill()
    err = p.stderr.read()
    assert "stopping after this step with a checkpoint (Ctrl-C again to stop at once)" in err
    assert "interrupted twice: stopped at once, without a final checkpoint" in err
