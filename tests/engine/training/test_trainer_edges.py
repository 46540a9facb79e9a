"""The trainer at the edges: signals during start-up, a stop during a step, disk full outside the checkpoint
writer, a torn events.jsonl, a checkpoint from another number of GPUs."""

from __future__ import annotations

import errno
import signal
import threading

import torch

from engine.recipe import train
from engine.report.events import EventLog, read_events
from engine.training.rng import capture, restore
from engine.training.stop import StopFlag
from tests.helpers.jobs import tiny_job


def test_a_checkpoint_request_sent_while_the_trainer_starts_waits_instead_of_killing_it(keep_signal_handlers):
    # The daemon starts trainers with SIGUSR1 blocked (the mask survives exec); one sent during the imports stays
    # pending and becomes a save request once the trainer's handler is in place.
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    try:
        signal.pthread_kill(threading.get_ident(), signal.SIGUSR1)  # still alive: blocked, pending
        assert signal.SIGUSR1 in signal.sigpending()
        flag = StopFlag()
        flag.install()
        assert flag.take_save_request() and not flag.requested
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old - {signal.SIGUSR1})


def test_a_stop_asked_during_a_step_checkpoints_before_any_step_end_work(tmp_path, micro_model, monkeypatch):
    from engine.families.causal_lm import CausalLM

    stop = StopFlag()
    calls = {"loss": 0, "step_end": []}
    real_loss = CausalLM.loss

    def loss(self, model, batch, generator):
        calls["loss"] += 1
        if calls["loss"] == 3:
            stop.request("SIGTERM")  # arrives while step 3 computes
        return real_loss(self, model, batch, generator)

    monkeypatch.setattr(CausalLM, "loss", loss)
    monkeypatch.setattr(CausalLM, "on_step_end", lambda self, model, step, *a: calls["step_end"].append(step))
    wd = tmp_path / "w"
    assert train(tiny_job(micro_model, tmp_path), wd, progress="none", stop=stop) == 75
    assert calls["step_end"] == [1, 2]  # sample rendering of step 3 would only delay the stop checkpoint
    assert [e["step"] for e in read_events(wd) if e["event"] == "stopped"] == [3]


def test_disk_full_outside_the_checkpoint_writer_is_exit_74_with_one_line(tmp_path, micro_model, monkeypatch, capsys):
    from engine.families.causal_lm import CausalLM

    def full(self, *a):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "w" / "cache" / "x.safetensors"))

    monkeypatch.setattr(CausalLM, "prepare", full)
    assert train(tiny_job(micro_model, tmp_path), tmp_path / "w", progress="none") == 74
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("lorad:")]
    assert len(lines) == 1 and "disk full" in lines[0] and "x.safetensors" in lines[0]
    assert read_events(tmp_path / "w")[-1]["event"] == "disk_error"


def test_a_torn_last_event_line_does_not_swallow_the_next_runs_first_event(tmp_path):
    (tmp_path / "events.jsonl").write_text('{"event": "step", "step": 1}\n{"event": "st')  # power cut mid-line
    log = EventLog(tmp_path / "events.jsonl", to_stdout=False)
    log.info("start")
    log.close()
    assert [e["event"] for e in read_events(tmp_path)] == ["step", "start"]


def test_a_checkpoint_from_another_number_of_gpus_restores_what_matches_and_says_so():
    meta, tensors = capture(torch.Generator())
    assert restore(meta, tensors) is None  # same machine: nothing to say
    tensors["cuda_0"] = torch.zeros(16, dtype=torch.uint8)  # written on a GPU machine, resumed without one
    warning = restore(meta, tensors)
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n == 1:
        assert warning is None
    else:
        assert f"has the CUDA random state of 1 GPU(s), this run sees {n}" in warning
