"""Ctrl-C in a terminal: the first stops after the step with a checkpoint, the second at once — both say so.
A SIGTERM while the trainer is still importing its stack is a clean stop too, not a death by signal."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from tests.helpers.processes import REPO, Trainer, child_env

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


def _catches_sigterm(pid: int) -> bool:
    """Whether the process has a handler for SIGTERM (the SigCgt mask in /proc/PID/status)."""
    status = Path(f"/proc/{pid}/status").read_text()
    caught = int(next(line for line in status.splitlines() if line.startswith("SigCgt:")).split()[1], 16)
    return bool(caught >> (signal.SIGTERM - 1) & 1)


def test_a_sigterm_during_the_trainers_imports_exits_75_before_training(tmp_path, write_job):
    t = Trainer.engine(write_job(), tmp_path / "w")
    try:
        deadline = time.monotonic() + 60
        while not _catches_sigterm(t.proc.pid):  # the job is read and the stop handler in: the imports begin
            assert t.proc.poll() is None and time.monotonic() < deadline, t.stderr
            time.sleep(0.002)
        t.send(signal.SIGTERM)
        assert t.wait(timeout=60) == 75, t.stderr
    finally:
        t.proc.kill()
    assert "stopped (SIGTERM) before training began; nothing to save" in t.stderr
    assert t.events == [] and not (tmp_path / "w" / "checkpoints").exists()
