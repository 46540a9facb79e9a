"""Shared fixtures: a micro causal LM, tiny job files, and a trainer subprocess you can watch and kill.

Real subprocesses are slow to start here (importing torch, transformers and
peft takes seconds on two shared cores), so tests that need one keep the
number of runs small and the model and job tiny.
"""

from __future__ import annotations

import copy
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable
QUICKSTART_DATA = REPO / "configs" / "examples" / "data" / "quickstart.jsonl"

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


# --------------------------------------------------------------------- model
def build_micro_llama(dest: Path) -> Path:
    """A 2-layer, 128-wide random Llama with the built-in byte-level tokenizer.

    128 wide so that a rank-32 LoRA A matrix has 4096 elements, the size from
    which bitsandbytes keeps 8-bit optimizer state: the tests exercise real
    8-bit states, not only its 32-bit fallback for small tensors.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from engine.builtin.models import byte_level_tokenizer

    tok = byte_level_tokenizer()
    cfg = LlamaConfig(
        vocab_size=len(tok), bos_token_id=1, eos_token_id=2, pad_token_id=0,
        hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    with torch.random.fork_rng():
        torch.manual_seed(7)
        model = LlamaForCausalLM(cfg)
    model.save_pretrained(dest)
    tok.save_pretrained(dest)
    return dest


@pytest.fixture(scope="session")
def micro_model(tmp_path_factory) -> Path:
    return build_micro_llama(tmp_path_factory.mktemp("models") / "micro-llama")


# --------------------------------------------------------------------- jobs
def tiny_job_dict(model_path: Path | str, data_path: Path | str) -> dict[str, Any]:
    """A quickstart-like job that trains in well under a second of compute."""
    return {
        "name": "tiny",
        "model": {"family": "causal_lm", "path": str(model_path), "dtype": "float32"},
        # dropout > 0: the RNG state must be restored for a resume to be exact.
        "lora": {"rank": 32, "alpha": 32, "dropout": 0.1, "targets": ["q_proj", "v_proj"]},
        "data": {"path": str(data_path), "text_field": "text", "seq_len": 32, "packing": True},
        "train": {
            "steps": 24, "batch_size": 2, "grad_accum": 1, "lr": 0.002, "schedule": "cosine",
            "warmup_steps": 3, "weight_decay": 0.01, "optimizer": "adamw8bit", "seed": 11, "max_grad_norm": 1.0,
        },
        "checkpoint": {"every_steps": 4, "every_seconds": None, "keep": 3},
    }


def deep_update(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_update(out[k], v)
        else:
            out[k] = v
    return out


def tiny_job(model_path: Path | str, base_dir: Path, **sections: Any):
    """The tiny job on the quickstart data, its `sections` updated (e.g. train={"steps": 2}), validated."""
    from engine.config.job import parse_job

    return parse_job(deep_update(tiny_job_dict(model_path, QUICKSTART_DATA), sections), base_dir)


@pytest.fixture
def write_job(tmp_path, micro_model) -> Callable[..., Path]:
    """write_job(filename="job.yaml", **section_overrides) -> path of a tiny job file in tmp_path."""

    def _write(filename: str = "job.yaml", **over: Any) -> Path:
        d = deep_update(tiny_job_dict(micro_model, QUICKSTART_DATA), over)
        path = tmp_path / filename
        path.write_text(yaml.safe_dump(d, sort_keys=False))
        return path

    return _write


@pytest.fixture(scope="session")
def finished_tiny_job(tmp_path_factory, micro_model):
    """A finished 12-step tiny job trained in-process, laid out as `lorad run --home ROOT/home` keeps it.

    Returns (job file, config, workdir, [checkpoint names, oldest first]); at least three checkpoints,
    the last at step 12. Which middle steps were saved depends on when the background writer was free.
    Shared read-only: copy it before changing anything.
    """
    from engine.config.job import load_job
    from engine.run import train

    root = tmp_path_factory.mktemp("finished")
    job = root / "tiny.yaml"
    d = deep_update(tiny_job_dict(micro_model, QUICKSTART_DATA),
                    {"train": {"steps": 12}, "checkpoint": {"every_steps": 3, "keep": 10}})
    job.write_text(yaml.safe_dump(d))
    cfg = load_job(job)
    workdir = root / "home" / "jobs" / cfg.name
    # Periodic saves run niced; on a crowded machine they may land less often than every 3 steps.
    # This fixture needs several checkpoints, not a test of that policy, so the writer runs at nice 0.
    saved = os.environ.get("LORAD_CKPT_WRITER_NICE")
    os.environ["LORAD_CKPT_WRITER_NICE"] = "0"
    try:
        assert train(cfg, workdir, progress="none") == 0
    finally:
        if saved is None:
            os.environ.pop("LORAD_CKPT_WRITER_NICE")
        else:
            os.environ["LORAD_CKPT_WRITER_NICE"] = saved
    names = sorted(p.name for p in (workdir / "checkpoints").iterdir())
    assert len(names) >= 3 and names[-1] == "step-00000012", names
    return job, cfg, workdir, names


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


def read_events(workdir: Path) -> list[dict[str, Any]]:
    path = Path(workdir) / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def adapter_bytes(workdir: Path) -> dict[str, bytes]:
    """The final adapter's tensors, by name, as raw bytes (for bit-exact comparison)."""
    import torch
    from safetensors.torch import load_file

    tensors = load_file(str(Path(workdir) / "output" / "adapter_model.safetensors"))
    return {k: v.contiguous().view(-1).view(torch.uint8).numpy().tobytes() for k, v in tensors.items()}


@pytest.fixture
def store(tmp_path):
    """A fresh daemon store (state.db) in tmp_path, closed after the test."""
    from daemon.store.db import Store

    s = Store(tmp_path / "state.db")
    yield s
    s.close()


@pytest.fixture
def keep_signal_handlers():
    """engine.run.main and `lorad run` install SIGTERM/SIGINT/SIGUSR1 handlers; give pytest its own back."""
    import signal

    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)}
    yield
    for s, h in saved.items():
        signal.signal(s, h)
