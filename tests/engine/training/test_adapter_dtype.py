"""lora.dtype: adapter weights are fp32 by default over a bf16 (or fp8) base, so small updates are kept;
bf16 adapters, still available, lose them."""

from __future__ import annotations

import pytest
import torch

from engine.errors import JobInvalid
from engine.families.causal_lm import CausalLM
from engine.training.adapters import compute_autocast
from engine.training.optim import build_optimizer
from tests.helpers.fakes import RecLog
from tests.helpers.jobs import tiny_job

STEPS = 6
SMALL_LR = 1e-5  # far below 1/256 of a kaiming-initialised A entry: under bf16's resolution


def _train_a_few_steps(micro_model, tmp_path, adapter_dtype: str):
    """STEPS AdamW steps at SMALL_LR on a bf16 base; returns the adapter weights before and after."""
    cfg = tiny_job(micro_model, tmp_path, model={"dtype": "bfloat16"}, lora={"dtype": adapter_dtype, "dropout": 0.0},
                   train={"optimizer": "adamw", "lr": SMALL_LR, "schedule": "constant", "warmup_steps": 0,
                          "weight_decay": 0.0})
    family = CausalLM()
    torch.manual_seed(0)
    model = family.load_model(cfg, tmp_path, torch.device("cpu"), RecLog())
    data = family.build_dataset(cfg, tmp_path, RecLog())
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert {p.dtype for p in params.values()} == {getattr(torch, adapter_dtype)}
    before = {n: p.detach().clone() for n, p in params.items()}
    opt = build_optimizer(list(params.values()), cfg.train)
    for step in range(STEPS):
        with compute_autocast(cfg.model.dtype, cfg.lora.dtype, torch.device("cpu")):
            loss = family.loss(model, data.collate([2 * step, 2 * step + 1]), torch.Generator())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return before, {n: p.detach().clone() for n, p in params.items()}


def _changed(before, after, which: str) -> float:
    """Fraction of the entries of every `which` (lora_A / lora_B) matrix that moved at all."""
    keys = [k for k in before if which in k]
    moved = sum(int((before[k] != after[k]).sum()) for k in keys)
    return moved / sum(before[k].numel() for k in keys)


def test_bf16_adapters_stall_at_a_small_lr_while_fp32_adapters_keep_learning(micro_model, tmp_path):
    b16_before, b16_after = _train_a_few_steps(micro_model, tmp_path, "bfloat16")
    f32_before, f32_after = _train_a_few_steps(micro_model, tmp_path, "float32")
    # bf16: an update to A is smaller than half a unit in the last place of the weight it is added to, unless
    # that weight is within ~256 updates of zero: all but a few percent of A never change. That half of the
    # adapter has stopped learning.
    assert _changed(b16_before, b16_after, "lora_A") < 0.05
    # fp32: the same updates land, in A and in B
    assert _changed(f32_before, f32_after, "lora_A") > 0.99
    assert _changed(f32_before, f32_after, "lora_B") > 0.99


def test_adapters_are_fp32_by_default_over_a_bf16_or_fp8_base_and_bf16_on_request(micro_model, tmp_path):
    for base in ("bf16", "fp8"):
        for asked, expect in ((None, torch.float32), ("bfloat16", torch.bfloat16)):
            lora = {"dtype": asked} if asked else {}
            cfg = tiny_job(micro_model, tmp_path, model={"dtype": "bfloat16", "base_precision": base}, lora=lora)
            model = CausalLM().load_model(cfg, tmp_path, torch.device("cpu"), RecLog())
            trainable = [p for p in model.parameters() if p.requires_grad]
            frozen = {p.dtype for p in model.parameters() if not p.requires_grad and p.is_floating_point()}
            assert trainable and {p.dtype for p in trainable} == {expect}, (base, asked)
            assert torch.bfloat16 in frozen  # the base keeps its own dtype


def test_compute_runs_in_the_base_dtype_under_autocast_only_when_the_adapters_are_wider():
    cpu = torch.device("cpu")
    w = torch.nn.Linear(8, 8)  # fp32 weights, as fp32 adapters are
    x = torch.randn(2, 8)
    with compute_autocast("bfloat16", "float32", cpu):
        assert w(x).dtype == torch.bfloat16
    for model_dtype, adapter_dtype in (("float32", "float32"), ("bfloat16", "bfloat16"), ("float32", "bfloat16")):
        with compute_autocast(model_dtype, adapter_dtype, cpu):
            assert w(x).dtype == torch.float32


def test_lora_dtype_is_validated(micro_model, tmp_path):
    with pytest.raises(JobInvalid, match=r"lora\.dtype: must be 'float32' or 'bfloat16'"):
        tiny_job(micro_model, tmp_path, lora={"dtype": "float16"})
