"""Trainers forked from a server that imported the training stack once: real processes, real SIGKILLs, cheap starts.

A fresh `python -m engine.run` spends most of its life on two shared cores importing torch, transformers and
diffusers. A multiprocessing fork server imports them once (its preload); each trainer is then forked from it and
runs engine/run.py as `python -m engine.run` does (tests.helpers.processes.trainer_main). Its events are read from
WORKDIR/events.jsonl, not stdout: the stdout contract the daemon reads keeps its own cold-start test.
"""

from __future__ import annotations

import gc
import json
import multiprocessing
import multiprocessing.connection
import os
import random
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tests.helpers.processes import CHILD_ENV, WAIT_S

# What any forked trainer imports before its first step (image families, FLUX.1, the micro Llama, TensorBoard's
# writer; a family's training code is its package's family.py, the package itself being plain data).
# multiprocessing starts one fork server per session, with the preload of the first trainer: one list for
# every test, so that no later trainer imports in each child what the first test's list left out.
PRELOAD = ["engine.recipe", "engine.families.image.base", "engine.families.image.flux2.family",
           "engine.families.image.qwen_image.family", "engine.families.image.z_image.family", "engine.families.image.chroma.family",
           "engine.families.image.krea2.family", "diffusers.pipelines.krea2.pipeline_krea2",
           "transformers.models.qwen3_vl.modeling_qwen3_vl",
           "engine.families.image.flux.family", "engine.families.causal_lm.family", "peft", "torch.utils.tensorboard",
           "diffusers.pipelines.flux2.pipeline_flux2_klein", "diffusers.pipelines.qwenimage.pipeline_qwenimage",
           "diffusers.pipelines.z_image.pipeline_z_image", "diffusers.pipelines.chroma.pipeline_chroma",
           "diffusers.models.transformers.transformer_flux", "transformers.models.qwen3.modeling_qwen3",
           "transformers.models.qwen2_5_vl.modeling_qwen2_5_vl", "transformers.models.t5.modeling_t5",
           "transformers.models.clip.modeling_clip", "transformers.models.llama.modeling_llama",
           "engine.families.image.flux3.family", "diffusers.modular_pipelines.flux3.encoders",
           "diffusers.modular_pipelines.flux3.before_denoise", "transformers.models.qwen3_vl.modeling_qwen3_vl",
           "transformers.models.got_ocr2.processing_got_ocr2",
           "engine.families.video.wan.family", "engine.families.video.base", "diffusers.pipelines.wan.pipeline_wan",
           "transformers.models.umt5.modeling_umt5", "av",
           "engine.families.image.ideogram4.family", "diffusers.pipelines.ideogram4.pipeline_ideogram4",
           "engine.families.image.qwen_image_21.family", "diffusers.pipelines.qwenimage21.pipeline_qwenimage21",
           "transformers.models.paddleocr_vl.processing_paddleocr_vl"]
LM_PRELOAD = PRELOAD  # the name tests/e2e/test_resume_exact.py passes


def start_server() -> None:
    """Start the fork server now, without waiting for it: it imports PRELOAD (seconds of CPU) on the core the test
    process (one torch thread) leaves idle, instead of in the first trainer's test. tests/conftest.py calls this
    after collection when a collected module forks trainers."""
    from multiprocessing import forkserver

    multiprocessing.set_forkserver_preload(PRELOAD)
    forkserver.ensure_running()


# multiprocessing's forkserver Popen.poll() is not thread-safe: it reads the child's exit status from the fork
# server's pipe once, and two threads polling the same child at once (Process.start() polls every earlier child,
# in _cleanup, while another thread joins the one it killed) both read it: one gets the status, the other EOF,
# which poll() turns into exit code 255. Tests that run kill chains side by side (threads) start and poll
# under this lock; the blocking wait for a child's end happens outside it, on its sentinel.
_POLL = threading.Lock()

# A forked micro-model trainer runs a step in milliseconds, faster than this side polls events.jsonl: without
# a pause after each step a test waiting for step k to kill the trainer could find it finished (seen once in
# test_tensorboard: all 12 steps in 0.09 s). The pause changes no value trained.
STEP_DELAY_S = "0.03"


def engine_main(job: str, wd: str, env: dict[str, str]) -> None:
    """A trainer process: engine.run's main, as `python -m engine.run` runs it."""
    # The half million objects the server imported are alive for good: a full collection (the image cache's, after
    # each encoder) would walk them all, writing to every page this fork shares with the server, ~0.4 s each time.
    gc.freeze()
    # The fork server was started before pytest captured anything: its children's stderr ("lorad: resumed job ...")
    # went to the terminal, between the progress dots. Kept beside the workdir instead, for a failing test to read.
    fd = os.open(f"{wd}.stderr", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.pop("LORAD_DEBUG_CKPT_WRITE_DELAY_S", None)
    os.environ.update(env)
    if "OMP_NUM_THREADS" in env:  # torch read it when the server imported it: apply it as a new interpreter would
        import torch

        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    from tests.helpers.processes import trainer_main

    sys.exit(trainer_main(["--job", job, "--workdir", wd, "--progress", "none"]))


def cli_main(argv: list[str], stderr: str) -> None:
    """`lorad ARGV` in a forked process, its stderr to the file `stderr`."""
    os.environ.pop("LORAD_DEBUG_CKPT_WRITE_DELAY_S", None)
    os.environ.update(CHILD_ENV)
    fd = os.open(stderr, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 2)
    from daemon.client.cli import main

    sys.exit(main(argv))


def run_cli(argv: Sequence[str], stderr: Path, preload: Sequence[str] = LM_PRELOAD, timeout: float = 300) -> int:
    """`lorad ARGV` to its end in a process forked from the server; its exit code (stderr in the file)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(list(preload))
    proc = ctx.Process(target=cli_main, args=(list(argv), str(stderr)))
    with _POLL:
        proc.start()
    multiprocessing.connection.wait([proc.sentinel], timeout)
    with _POLL:
        code = proc.exitcode
    if code is None:
        proc.kill()
    return code


class ForkedTrainer:
    """One forked trainer; its events are read from WORKDIR/events.jsonl (from where this run began)."""

    def __init__(self, job: Path, wd: Path, preload: Sequence[str] = PRELOAD, **env: str):
        self.events_file = wd / "events.jsonl"
        self.offset = self.events_file.stat().st_size if self.events_file.exists() else 0
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(list(preload))
        env = {**CHILD_ENV, "LORAD_DEBUG_STEP_DELAY_S": STEP_DELAY_S, **env}
        self.proc = ctx.Process(target=engine_main, args=(str(job), str(wd), env))
        with _POLL:
            self.proc.start()

    @property
    def events(self) -> list[dict[str, Any]]:
        if not self.events_file.exists():
            return []
        with open(self.events_file, "rb") as f:
            f.seek(self.offset)
            lines = f.read().decode().split("\n")[:-1]  # a line still being written is left for the next look
        return [json.loads(line) for line in lines if line.strip()]

    def named(self, event: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e.get("event") == event]

    def wait_for(self, pred: Callable[[], bool], timeout: float = WAIT_S) -> None:
        deadline = time.monotonic() + timeout
        while not pred():
            assert self.alive() or pred(), f"trainer exited {self.exitcode()} first; {self.events[-3:]}"
            assert time.monotonic() < deadline, f"timed out; {self.events[-3:]}"
            time.sleep(0.01)

    def wait_step(self, step: int, timeout: float = WAIT_S) -> None:
        self.wait_for(lambda: any(e.get("event") == "step" and e["step"] >= step for e in self.events), timeout)

    def alive(self) -> bool:
        with _POLL:
            return self.proc.is_alive()

    def exitcode(self) -> int | None:
        with _POLL:
            return self.proc.exitcode

    def send(self, sig: int) -> None:
        os.kill(self.proc.pid, sig)

    def kill(self) -> None:
        self.send(signal.SIGKILL)
        assert self.finish(timeout=60) == -signal.SIGKILL, forkserver_state(self.proc)

    def finish(self, timeout: float) -> int | None:
        """Wait up to `timeout` for the trainer to end; its exit code (None while it still runs)."""
        multiprocessing.connection.wait([self.proc.sentinel], timeout)  # its end, seen without reading its status
        return self.exitcode()


def run_to_end(job: Path, wd: Path, timeout: float = WAIT_S) -> ForkedTrainer:
    """A trainer run to its end (exit 0), uninterrupted; the finished trainer (its events)."""
    t = ForkedTrainer(job, wd)
    assert t.finish(timeout) == 0, t.events[-5:]
    return t


def killed_then_resumed(job: Path, wd: Path, kill_at: tuple[int, int], timeout: float = WAIT_S) -> int:
    """SIGKILL a trainer at a random step in kill_at (both included, and after its first committed checkpoint),
    then run a second one to the end; the step it resumed from, which is past 0 and before the last."""
    # Saves at nice 0: a niced save under load can commit first at the last step, after which no kill is possible.
    t = ForkedTrainer(job, wd, LORAD_CKPT_WRITER_NICE="0")
    t.wait_for(lambda: bool(t.named("checkpoint_committed")), timeout)
    t.wait_step(random.randint(*kill_at), timeout)
    t.kill()
    t = run_to_end(job, wd, timeout)
    resumed, (done,) = t.named("resumed"), t.named("done")
    assert resumed and 0 < resumed[0]["from_step"] < done["step"], (resumed, done)
    return resumed[0]["from_step"]


def _fd_target(fd: int) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError as e:
        return f"not open ({e.strerror})"


def forkserver_state(p: multiprocessing.process.BaseProcess) -> str:
    """Why a forked child's status never came (exit code 255): is the fork server alive, are our pipes to it open."""
    from multiprocessing import forkserver

    pid, alive_fd = forkserver._forkserver._forkserver_pid, forkserver._forkserver._forkserver_alive_fd
    try:
        server: Any = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError as e:
        server = f"not our child ({e.strerror})"
    return (f"exitcode {p.exitcode}; fork server {pid}: waitpid {server}; sentinel fd {p.sentinel}: "
            f"{_fd_target(p.sentinel)}; alive fd {alive_fd}: {_fd_target(alive_fd)}; "
            f"threads {[t.name for t in threading.enumerate()]}")
