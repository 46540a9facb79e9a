"""The output directory is a plain peft adapter that reproduces the trained model."""

from __future__ import annotations

import json

import torch

from engine.checkpoint.state import restore_checkpoint
from engine.checkpoint.store import CheckpointStore
from engine.config.job import load_job
from engine.families.causal_lm import CausalLM
from engine.training.adapters import trainable


class _Quiet:
    def info(self, *a, **k): ...
    def warning(self, *a, **k): ...


def test_peft_from_pretrained_reproduces_the_trained_logits(finished_tiny_job, micro_model):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    _, cfg, wd, _ = finished_tiny_job
    out = wd / "output"
    assert (out / "adapter_model.safetensors").is_file()
    adapter_cfg = json.loads((out / "adapter_config.json").read_text())
    assert adapter_cfg["r"] == 32 and sorted(adapter_cfg["target_modules"]) == ["q_proj", "v_proj"]

    ids = torch.randint(3, 250, (2, 24), generator=torch.Generator().manual_seed(5))

    # What a user does with the output: base model + peft, nothing from lorad.
    base = AutoModelForCausalLM.from_pretrained(micro_model, dtype=torch.float32)
    with torch.no_grad():
        base_logits = base(input_ids=ids).logits
    user = PeftModel.from_pretrained(base, out).eval()
    with torch.no_grad():
        got = user(input_ids=ids).logits

    # The trained model as training left it: the engine's own model with the final checkpoint restored.
    family = CausalLM()
    trained = family.load_model(cfg, wd, torch.device("cpu"), _Quiet())
    params = trainable(trained)
    # set_aside_invalid=False: the shared run is read-only here.
    loaded, _ = CheckpointStore(wd / "checkpoints", cfg.identity_hash(), keep=10).load_latest(set_aside_invalid=False)
    assert loaded.step == cfg.train.steps
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(loaded.adapter[n])
    trained.eval()
    with torch.no_grad():
        want = trained(input_ids=ids).logits

    assert not torch.allclose(want, base_logits, atol=1e-4), "training did not move the adapter"
    # Same modules, same weights, same kernels: the logits are identical, not merely close.
    assert torch.equal(got, want), (got - want).abs().max()


def test_restore_checkpoint_rejects_an_adapter_for_another_model(write_job, tmp_path):
    """A checkpoint whose LoRA parameter names do not match the model is refused, not half-loaded."""
    import pytest

    from engine.checkpoint.store import Loaded
    from engine.errors import JobInvalid

    cfg = load_job(write_job())
    model = CausalLM().load_model(cfg, tmp_path, torch.device("cpu"), _Quiet())
    params = trainable(model)
    wrong = Loaded(step=1, path=tmp_path / "step-00000001", adapter={"not.a.lora.weight": torch.zeros(1)},
                   optimizer_tensors={}, optimizer_tree={}, rng_tensors={}, state={})
    with pytest.raises(JobInvalid, match="does not match"):
        restore_checkpoint(wrong, params, None, None)


def test_the_exported_adapter_is_as_readable_as_any_file_the_user_writes(finished_tiny_job):
    import os
    import stat

    from engine.storage.fsio import normal_file_mode

    _, _, wd, _ = finished_tiny_job
    modes = {p.name: stat.S_IMODE(os.stat(p).st_mode) for p in (wd / "output").iterdir()}
    assert "adapter_model.safetensors" in modes
    assert set(modes.values()) == {normal_file_mode()}, modes  # not safetensors' own 0600
