"""Trainers as real child processes: the environment every child gets, and a child whose JSON events we read.

Real subprocesses are slow to start here (importing torch, transformers and peft takes seconds on two shared
cores), so tests that need one keep the number of runs small and the model and job tiny.
"""

from __future__ import annotations

import json
import os
import queue
import runpy
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
PY = sys.executable

# Quiet, offline, and the same for every child so runs are comparable.
CHILD_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "TRANSFORMERS_VERBOSITY": "error",
    "PYTHONUNBUFFERED": "1",
}


def child_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "LORAD_DEBUG_CKPT_WRITE_DELAY_S"}
    env.update(CHILD_ENV)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env



# --------------------------------------------------------------------- subprocess trainer
# How long a test waits for a child's event. A child that exits is seen at once, so this only bounds a hang; at
# a load average of 12-18 on 2 cores the quickstart took ~10 s a step and 120 s was missed by a healthy run.
WAIT_S = 300.0


class Trainer:
    """`python -m engine.run` (or any command) as a child whose JSON events we read as they come."""

    def __init__(self, argv: list[str], env: dict[str, str] | None = None, cwd: Path | None = None):
        self.argv = argv
        self.proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=env or child_env(), cwd=str(cwd or REPO),
        )
        self.events: list[dict[str, Any]] = []
        self.stdout_lines: list[str] = []
        self.stderr_lines: list[str] = []
        self._new = queue.Queue()
        self._threads = [
            threading.Thread(target=self._read_stdout, daemon=True),
            threading.Thread(target=self._read_stderr, daemon=True),
        ]
        for t in self._threads:
            t.start()

    @classmethod
    def engine(cls, job: Path, workdir: Path, **env: str) -> Trainer:
        return cls([PY, "-m", "engine.run", "--job", str(job), "--workdir", str(workdir), "--progress", "json"],
                   env=child_env(**env))

    def _read_stdout(self) -> None:
        for line in self.proc.stdout:
            self.stdout_lines.append(line)
            try:
                ev = json.loads(line)
            except ValueError:
                continue
            if isinstance(ev, dict):
                self.events.append(ev)
                self._new.put(ev)

    def _read_stderr(self) -> None:
        for line in self.proc.stderr:
            self.stderr_lines.append(line)

    def wait_for(self, pred: Callable[[], bool], timeout: float = WAIT_S, poll: float = 0.005) -> None:
        """Wait until pred() is true; fail (with the child's stderr) if the child exits or time runs out."""
        deadline = time.monotonic() + timeout
        while not pred():
            if self.proc.poll() is not None:
                for t in self._threads:
                    t.join(5)
                if pred():
                    return
                raise AssertionError(f"child exited {self.proc.returncode} before the condition held;\n"
                                     f"stderr tail: {''.join(self.stderr_lines[-15:])}")
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting; stderr tail: {''.join(self.stderr_lines[-15:])}")
            time.sleep(poll)

    def wait_step(self, step: int, timeout: float = WAIT_S) -> None:
        self.wait_for(lambda: any(e.get("event") == "step" and e["step"] >= step for e in self.events), timeout)

    def send(self, sig: int) -> None:
        os.kill(self.proc.pid, sig)

    def kill(self) -> None:
        self.send(signal.SIGKILL)
        self.wait()

    def wait(self, timeout: float = 180.0) -> int:
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise
        for t in self._threads:
            t.join(10)
        return rc

    @property
    def stderr(self) -> str:
        return "".join(self.stderr_lines)

    def named(self, event: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e.get("event") == event]


def run_engine(job: Path, workdir: Path, timeout: float = 180.0, **env: str) -> Trainer:
    """Run `python -m engine.run` to its end and return the finished Trainer (rc in .proc.returncode)."""
    t = Trainer.engine(job, workdir, **env)
    t.wait(timeout)
    return t


def trainer_main(argv: list[str]) -> int:
    """`python -m engine.run ARGV` in this process, returning its exit code.

    engine/run.py is the trainer's command line, not a library (nothing imports it): it runs here as `-m` runs
    it, as __main__, without the cost of a new interpreter."""
    saved = sys.argv
    sys.argv = ["engine.run", *argv]
    try:
        runpy.run_module("engine.run", run_name="__main__", alter_sys=False)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.argv = saved
    return 0

