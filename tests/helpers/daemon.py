"""Helpers for the daemon tests: a real `lorad serve` subprocess in a temp home, its socket, its trainers."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from daemon import protocol as p
from daemon.client.connection import Client, DaemonDown
from daemon.system import proc
from engine.report.events import read_events as job_events
from tests.helpers.jobs import QUICKSTART_DATA
from tests.helpers.processes import REPO, child_env

PY = sys.executable


def fast_config(tmp_root: Path, **over: Any) -> dict[str, Any]:
    """A daemon config for tests: short loop period, short backoffs, paths under the temp dir and the repo."""
    cfg = {
        "allowed_roots": ["{home}", str(tmp_root), str(REPO)],
        "tick_s": 0.1,
        "inbox_settle_s": 0.2,
        "inbox_rescan_s": 1.0,
        "backoff_base_s": 0.5,
        "backoff_max_s": 2.0,
        "stop_grace_s": 60.0,
        "power": {"telemetry": {"backend": "off"}},
        "web": {"listen": "127.0.0.1:0"},  # tests run side by side: never the fixed default port
        # The suite runs as root in a container (CI too): the explicit setting (daemon/system/privilege.py); a no-op
        # for a daemon that is not root.
        "run_as_root": True,
    }
    cfg.update(over)
    return cfg


def daemon_job(model: Path, steps: int = 40, every: int = 4, name: str = "svc", seq_len: int = 32,
               **train: Any) -> dict[str, Any]:
    """A tiny job for the service tests (micro model, short sequences): a few seconds of compute."""
    return {
        "name": name,
        "model": {"family": "causal_lm", "path": str(model), "dtype": "float32"},
        "lora": {"rank": 8, "alpha": 16, "dropout": 0.1, "targets": ["q_proj", "v_proj"]},
        "data": {"path": str(QUICKSTART_DATA), "text_field": "text", "seq_len": seq_len},
        "train": {"steps": steps, "batch_size": 2, "lr": 0.002, "warmup_steps": 2, "optimizer": "adamw",
                  "seed": 5, **train},
        "checkpoint": {"every_steps": every, "every_seconds": None, "keep": 2},
    }


def write_yaml(path: Path, data: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def wait_until(pred: Callable[[], Any], timeout: float, what: str, poll: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(poll)


def sigterm_pending(pid: int) -> bool:
    """A stopped process's SIGTERM, sent and not yet handled (the process-wide pending set in /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("ShdPnd:"):
            return bool(int(line.split()[1], 16) & (1 << (signal.SIGTERM - 1)))
    return False


@contextlib.contextmanager
def held_until_sigterm(pids: list[int], timeout: float = 120):
    """Orphaned trainers held still (SIGSTOP) while the body starts the next daemon, until it has sent each one
    SIGTERM: on a loaded machine an orphan could otherwise finish its job alone while that daemon starts."""
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield
        wait_until(lambda: all(sigterm_pending(pid) for pid in pids), timeout, "the new daemon's SIGTERM to the orphan")
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)


class Daemon:
    """`python -m daemon.client.cli serve --home HOME --config CFG` as a child of the test."""

    def __init__(self, home: Path, config: dict[str, Any], **env: str):
        self.home = Path(home)
        self.home.mkdir(parents=True, exist_ok=True)
        self.config_path = write_yaml(self.home.parent / f"{self.home.name}-daemon.yaml", config)
        self.env = child_env(**env)
        self.proc: subprocess.Popen | None = None
        self.log_path = self.home.parent / f"{self.home.name}-daemon.log"
        self.client = Client(self.home / "lorad.sock", timeout_s=30)
        self.started_at = 0.0
        self.run_as: dict[str, Any] = {}  # subprocess's user=, group=, extra_groups=: a daemon as another user

    def start(self, wait: bool = True) -> Daemon:
        self.started_at = time.monotonic()
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen([PY, "-m", "daemon.client.cli", "serve", "--home", str(self.home),
                                      "--config", str(self.config_path)],
                                     stdout=log, stderr=subprocess.STDOUT, env=self.env, cwd=str(REPO), **self.run_as)
        log.close()
        if wait:
            self.wait_ready()
        return self

    def wait_ready(self, timeout: float = 60) -> None:
        def up():
            if self.proc.poll() is not None:
                raise AssertionError(f"lorad serve exited {self.proc.returncode}:\n{self.log()[-3000:]}")
            try:
                return self.client.call(p.Ping())
            except (DaemonDown, OSError):
                return None

        wait_until(up, timeout, "the daemon to answer ping")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def call(self, req: p.BaseModel) -> dict[str, Any]:
        return self.client.call(req)

    def job(self, job_id: str) -> dict[str, Any]:
        return self.call(p.Status(job=job_id))["job"]

    def jobs(self) -> list[dict[str, Any]]:
        return self.call(p.Status())["jobs"]

    def wait_job(self, pred: Callable[[list[dict[str, Any]]], Any], timeout: float, what: str) -> Any:
        return wait_until(lambda: pred(self.jobs()), timeout, what, poll=0.1)

    def wait_state(self, job_id: str, states: set[str], timeout: float) -> dict[str, Any]:
        def check():
            self._alive()
            j = self.job(job_id)
            return j if j["state"] in states else None

        return wait_until(check, timeout, f"job {job_id} to reach {states}", poll=0.1)

    def _alive(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise AssertionError(f"lorad serve exited {self.proc.returncode}:\n{self.log()[-3000:]}")

    def cli(self, *args: str, check: bool = True, real: bool = False) -> subprocess.CompletedProcess:
        """The `lorad` CLI against this daemon: in this process (its imports cost ~1 s a call as a child), or with
        real=True as `python -m daemon.client.cli`, the process a user runs."""
        argv = [*args, "--home", str(self.home)]
        if real:
            r = subprocess.run([PY, "-m", "daemon.client.cli", *argv], capture_output=True, text=True,
                               env=self.env, cwd=str(REPO), timeout=60)
        else:
            r = cli_in_process(argv, self.env)
        if check and r.returncode != 0:
            raise AssertionError(f"lorad {' '.join(args)} exited {r.returncode}: {r.stderr}")
        return r

    def trainers(self) -> list[proc.Trainer]:
        return proc.find_trainers(self.home / "jobs")

    def sigkill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(30)

    def terminate(self, timeout: float = 120) -> int:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def cleanup(self) -> None:
        self.sigkill()
        for t in self.trainers():
            proc.signal_group(t.pid, signal.SIGKILL)


@contextlib.contextmanager
def environment(env: dict[str, str]):
    """os.environ is `env` inside the block (what a child given env= would see), the test's own again after."""
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def cli_in_process(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    """daemon.client.cli.main(argv) with its stdout, stderr and exit code caught, as a child's would be."""
    from daemon.client.cli import main

    out, err = io.StringIO(), io.StringIO()
    # A child's stdout is a pipe, not a terminal: without COLUMNS its tables are 120 wide (shutil's fallback).
    env = {"COLUMNS": "120", **env}
    with environment(env), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(argv))
        except SystemExit as e:  # argparse's usage errors and --help
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            if not isinstance(e.code, int | None):
                print(e.code, file=sys.stderr)
    return subprocess.CompletedProcess(["lorad", *argv], code or 0, out.getvalue(), err.getvalue())


def last_step(workdir: Path) -> int:
    steps = [e["step"] for e in job_events(workdir) if e.get("event") == "step"]
    return steps[-1] if steps else 0


def adapter_file(workdir: Path) -> bytes:
    return (Path(workdir) / "output" / "adapter_model.safetensors").read_bytes()


# The uninterrupted reference runs of this pytest session, by job (a run is a cold trainer: ~10 s or more here).
_REFERENCE_RUNS: dict[str, Path] = {}


def lorad_run(job: Path, home: Path, timeout: float = 300) -> Path:
    """`lorad run JOB --home HOME` to the end (the uninterrupted reference); returns its workdir. Runs once per
    session for each job: a later call with the same job (same file content) gets the first run's workdir. The
    process is forked from the server that imported the training stack (tests/helpers/forked.py)."""
    from tests.helpers.forked import run_cli

    key = json.dumps(yaml.safe_load(job.read_text()), sort_keys=True)
    if key in _REFERENCE_RUNS:
        return _REFERENCE_RUNS[key]
    err = Path(home).parent / f"{Path(home).name}-lorad-run.stderr"
    rc = run_cli(["run", str(job), "--home", str(home), "--quiet"], err, timeout=timeout)
    assert rc == 0, err.read_text()[-3000:]
    _REFERENCE_RUNS[key] = Path(home) / "jobs" / json.loads(key)["name"]
    return _REFERENCE_RUNS[key]


def pids_alive(pids: list[int]) -> list[int]:
    return [pid for pid in pids if proc.alive(pid)]


def env_without(*keys: str) -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in keys}
