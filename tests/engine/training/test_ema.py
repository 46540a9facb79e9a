"""train.ema: the exported adapter is the exponential moving average of the raw weights the run produced,
kept in checkpoints without pickles and resumed exactly; samples see it; the raw weights can be exported too."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from engine.checkpoint.store import CheckpointStore
from engine.errors import JobInvalid
from engine.recipe import train
from engine.report.events import read_events
from engine.training.ema import AdapterEMA
from engine.training.stop import StopFlag
from tests.helpers.jobs import adapter_bytes, tiny_job

EMA = {"decay": 0.7, "every_steps": 2, "start_step": 1}
STEPS = 7  # averaging steps: 3 (the start), 5, 7


def _record_raw_weights(monkeypatch, log: dict[int, dict[str, torch.Tensor]], stop_at: int | None = None):
    """Log the raw adapter after every optimizer step (the family's step-end hook sees the model as trained)."""
    from engine.families.causal_lm import CausalLM

    stop = StopFlag()

    def on_step_end(self, model, step, cfg, workdir, logger):
        log[step] = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        if step == stop_at:
            stop.request("test")

    monkeypatch.setattr(CausalLM, "on_step_end", on_step_end)
    return stop


def _peft_key(name: str) -> str:
    return name.replace(".default", "")


def test_the_exported_adapter_is_the_ema_of_the_logged_raw_weights(micro_model, tmp_path, monkeypatch):
    cfg = tiny_job(micro_model, tmp_path, train={"steps": STEPS, "optimizer": "adamw", "ema": {**EMA, "export_raw": True}})
    raw: dict[int, dict[str, torch.Tensor]] = {}
    _record_raw_weights(monkeypatch, raw)
    wd = tmp_path / "w"
    assert train(cfg, wd, progress="none") == 0
    assert sorted(raw) == list(range(1, STEPS + 1))
    # the reference, in float64: starts from the weights of the first averaging step, then decays
    ref = {n: t.double() for n, t in raw[3].items()}
    for step in (5, 7):
        ref = {n: EMA["decay"] * ref[n] + (1 - EMA["decay"]) * raw[step][n].double() for n in ref}
    out = load_file(str(wd / "output" / "adapter_model.safetensors"))
    out_raw = load_file(str(wd / "output" / "raw" / "adapter_model.safetensors"))
    assert len(out) == len(ref) > 0
    for n, want in ref.items():
        got = out[_peft_key(n)]
        torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-6)
        assert torch.equal(out_raw[_peft_key(n)], raw[STEPS][n])  # the raw weights, exactly
        assert not torch.allclose(got, raw[STEPS][n], atol=1e-6)  # and the average really differs from them
    # the EMA is in the checkpoint as its own file
    loaded, _ = CheckpointStore(wd / "checkpoints", cfg.identity_hash(), 3).load_latest()
    assert sorted(loaded.extra) == ["ema"] and loaded.extra["ema"].keys() == raw[STEPS].keys()


def test_an_ema_job_stopped_and_resumed_exports_the_same_bits(micro_model, tmp_path, monkeypatch):
    cfg = tiny_job(micro_model, tmp_path, train={"steps": STEPS, "optimizer": "adamw", "ema": EMA},
                   checkpoint={"every_steps": 2})
    ref = tmp_path / "ref"
    assert train(cfg, ref, progress="none") == 0
    wd = tmp_path / "stopped"
    stop = _record_raw_weights(monkeypatch, {}, stop_at=4)  # between averaging steps 3 and 5
    assert train(cfg, wd, progress="none", stop=stop) == 75
    monkeypatch.undo()
    assert train(cfg, wd, progress="none") == 0
    assert [e["from_step"] for e in read_events(wd) if e["event"] == "resumed"] == [4]
    a, b = adapter_bytes(ref), adapter_bytes(wd)
    assert a and [k for k in a if a[k] != b[k]] == []


def test_samples_see_the_average_and_training_continues_on_the_raw_weights():
    params = {"w": torch.nn.Parameter(torch.zeros(3))}
    ema = AdapterEMA(params, decay=0.5, every_steps=1, start_step=0)
    with ema.swapped_in():  # nothing averaged yet: the raw weights
        assert torch.equal(params["w"], torch.zeros(3))
    ema.update(1)
    with torch.no_grad():
        params["w"].add_(1.0)
    ema.update(2)
    with ema.swapped_in():
        assert torch.equal(params["w"], torch.full((3,), 0.5))
    assert torch.equal(params["w"], torch.ones(3))


@pytest.mark.parametrize("ema,words", [
    ({"decay": 1.0}, ["train.ema.decay", "less than 1"]),
    ({"every_steps": 0}, ["train.ema.every_steps"]),
    ({"decay": 0.9, "beta": 1}, ["train.ema.beta", "unknown key"]),
])
def test_ema_keys_are_validated(micro_model, tmp_path, ema, words):
    with pytest.raises(JobInvalid) as e:
        tiny_job(micro_model, tmp_path, train={"ema": ema})
    for w in words:
        assert w in str(e.value)


def test_ema_with_schedule_free_is_refused(micro_model, tmp_path):
    with pytest.raises(JobInvalid, match=r"train\.ema: adamw_schedulefree already averages"):
        tiny_job(micro_model, tmp_path, train={"ema": {}, "optimizer": "adamw_schedulefree", "schedule": "constant"})


def test_export_raw_may_change_between_attempts_but_the_average_may_not(micro_model, tmp_path):
    a = tiny_job(micro_model, tmp_path, train={"ema": {"decay": 0.9}})
    assert a.identity_hash() == tiny_job(micro_model, tmp_path, train={"ema": {"decay": 0.9, "export_raw": True}}).identity_hash()
    assert a.identity_hash() != tiny_job(micro_model, tmp_path, train={"ema": {"decay": 0.99}}).identity_hash()
    assert a.identity_hash() != tiny_job(micro_model, tmp_path).identity_hash()
