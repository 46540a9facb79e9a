"""Shared fixtures: the micro causal LM, tiny job files, a finished tiny job, a store, signal handlers kept.

The functions these fixtures are built from live in tests/helpers/ (processes, jobs, daemon, images, web, fakes).
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

# The Triton kernels' tests (tests/**/test_*triton*.py) run them on the CPU through Triton's interpreter, which
# triton chooses when it decorates a kernel, its own library's included, and peft and diffusers import triton
# while tests are collected: so it is set here, first. Not where there is a GPU: there the kernels (ours and
# inductor's) compile for it, and the same tests run on CUDA tensors.
if not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Collection imports torch, transformers and diffusers (half a million objects, next to no garbage): the collector
# stays off until they are frozen out of its reach (pytest_collection_finish).
gc.disable()

from tests.helpers.daemon import adapter_file, daemon_job, lorad_run, write_yaml  # noqa: E402
from tests.helpers.images import tiny_image_model  # noqa: E402, F401 - a session fixture for every test module
from tests.helpers.jobs import QUICKSTART_DATA, build_micro_llama, deep_update, tiny_job_dict  # noqa: E402
from tests.helpers.storage import s3_server, sftp_server  # noqa: E402, F401 - loopback servers, started on first use

# Tables are as wide as the terminal; tests read their cells. Without this, the width depended on how pytest
# was started (a terminal, a pipe, an xdist worker), and a note cut to fit a narrow one failed a test.
os.environ["COLUMNS"] = "120"
# torch runs on one thread in the test process and in every process it starts (children, the fork server and the
# trainers forked from it inherit this; torch reads it when first imported, which is after this file). The models
# are tiny: a second thread buys nothing but waits, and with several trainers side by side on two cores those
# waits made a 12-step micro-LM run take 2-9 s instead of 0.2-0.7 s. Runs compared bit for bit all use one thread.
os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_collection_finish(session) -> None:
    """What the test modules imported (torch, transformers, diffusers, pytest: ~half a million objects) lives until
    the end: frozen out of the collector's reach (it was off while they were imported), a full collection (the image
    cache runs one after each encoder) walks only what tests made since, not all of it again (~0.4-0.9 s each)."""
    # Hypothesis runs its plugins when first imported; trio's finds its PRNG's owner by gc.get_referrers, which
    # does not see frozen objects (it warned). Imported before the freeze, as a test module that uses it would be.
    with contextlib.suppress(ImportError):
        import hypothesis  # noqa: F401
    gc.freeze()
    gc.enable()
    if "tests.helpers.forked" in sys.modules:  # a collected module forks trainers
        sys.modules["tests.helpers.forked"].start_server()


@pytest.fixture(scope="session")
def micro_model(tmp_path_factory) -> Path:
    return build_micro_llama(tmp_path_factory.mktemp("models") / "micro-llama")


@pytest.fixture(scope="session")
def svc_job(tmp_path_factory, micro_model) -> Path:
    """The daemon tests' job: long enough for three kills (tests/e2e/test_serve.py, test_warm_trainer.py)."""
    d = tmp_path_factory.mktemp("svc-job")
    return write_yaml(d / "svc.yaml", daemon_job(micro_model, steps=24, every=4, seq_len=128, batch_size=4))


@pytest.fixture(scope="session")
def svc_reference(svc_job, tmp_path_factory) -> bytes:
    """The uninterrupted run of svc_job through `lorad run` (a cold trainer): its adapter, computed once."""
    return adapter_file(lorad_run(svc_job, tmp_path_factory.mktemp("ref-home")))


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
    from engine.recipe import train

    root = tmp_path_factory.mktemp("finished")
    job = root / "tiny.yaml"
    d = deep_update(tiny_job_dict(micro_model, QUICKSTART_DATA),
                    {"train": {"steps": 12}, "checkpoint": {"every_steps": 3, "keep": 10}})
    job.write_text(yaml.safe_dump(d))
    cfg = load_job(job)
    workdir = root / "home" / "jobs" / cfg.name
    # Periodic saves run niced, one in flight at a time; on a crowded machine a save could outlast the next steps
    # and land less often than every 3 steps. This fixture needs several checkpoints, not a test of that policy:
    # the writer runs at nice 0 and each step rests 0.15 s, so a save has its three steps' time to land.
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LORAD_CKPT_WRITER_NICE", "0")
        mp.setenv("LORAD_DEBUG_STEP_DELAY_S", "0.15")
        assert train(cfg, workdir, progress="none") == 0
    names = sorted(p.name for p in (workdir / "checkpoints").iterdir())
    assert len(names) >= 3 and names[-1] == "step-00000012", names
    return job, cfg, workdir, names


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
