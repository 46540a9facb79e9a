"""A checkpoint's export is written from the snapshot's host copies, through a weightless twin of the model: what
the live weights do after the snapshot (the loop trains on while the writer writes) never reaches it, and the
export leaves the live model as it was."""

from __future__ import annotations

import torch

from engine.checkpoint.exports import CheckpointExports
from engine.checkpoint.state import snapshot
from engine.families import get_family
from engine.training.adapters import trainable
from tests.helpers.jobs import tiny_job


def test_the_export_is_the_snapshots_weights_not_the_live_ones(micro_model, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    cfg = tiny_job(micro_model, tmp_path)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(micro_model),
                           LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    params = trainable(model)
    with torch.no_grad():
        for p in params.values():
            p.normal_(generator=torch.Generator().manual_seed(1))
    model.save_pretrained(tmp_path / "at-the-snapshot")
    optimizer = torch.optim.AdamW(list(params.values()))
    snap = CheckpointExports(get_family("causal_lm"), model, cfg, 10).attach(
        snapshot(3, params, optimizer, torch.Generator(), {"step": 3}), optimizer, params)
    with torch.no_grad():  # training goes on before the writer gets to it
        for p in params.values():
            p.add_(1.0)
    live = {n: p.detach().clone() for n, p in params.items()}

    names = snap.export(tmp_path / "export")

    assert "adapter_model.safetensors" in names and "README.md" in names
    assert (tmp_path / "export" / "adapter_model.safetensors").read_bytes() == \
        (tmp_path / "at-the-snapshot" / "adapter_model.safetensors").read_bytes()
    # the live model is untouched: the same parameter objects, the same values, on the same device
    after = trainable(model)
    assert all(after[n] is params[n] and torch.equal(after[n], live[n]) for n in params)
    assert "[More Information Needed]" not in (tmp_path / "export" / "README.md").read_text()  # our card
