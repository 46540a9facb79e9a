"""The trainable adapter: its kind (`lora.type`, built by peft), its weights' dtype (`lora.dtype`), the compute.

`lora.type` picks the peft tuner, never a hand-written layer:

    lora   LoraConfig: W + (alpha/r)·B·A
    dora   LoraConfig(use_dora=True): LoRA's direction plus a trained per-output-row magnitude
    lokr   LoKrConfig: W + (alpha/r)·(w1 ⊗ w2), the Kronecker factors sized by `lora.factor` (peft's
           decompose_factor; -1 = as square as possible), w2 low-rank when r is small, w1 too with
           `lora.decompose_both`
    loha   LoHaConfig: W + (alpha/r)·(w1a·w1b) ⊙ (w2a·w2b), a Hadamard product of two rank-r products

Why fp32 by default: with a bf16 base the adapters used to be bf16 too, with no fp32 copy. bf16 keeps 8
bits of mantissa, so an update smaller than about 1/256 of a weight is rounded away: at a small (or late,
decayed) learning rate the LoRA A matrices, which start at kaiming scale, stop changing entirely
(tests/engine/training/test_adapter_dtype.py shows it). kohya sd-scripts and ai-toolkit keep LoRA weights in fp32 for
this reason; so does lorad unless `lora.dtype: bfloat16` asks for the old behaviour.

Compute stays in the model dtype: when the adapter dtype is wider than the base's, the loss runs under
torch.autocast to the base dtype, so the adapter matmuls run in bf16 (autocast casts the fp32 weights on the
fly) and only the weights and their updates are fp32. Without it peft would cast each adapter's input to
fp32 and keep that copy for the backward pass — activation memory a large model cannot spare.
"""

from __future__ import annotations

import contextlib
import os
import sys

import torch

from engine.training.dtypes import torch_dtype


def import_bitsandbytes() -> None:
    """Import bitsandbytes (peft imports it with itself) without torch.compile-ing its fallback kernels; called
    before a trainer's first peft import, after quiet_libraries() has quieted bitsandbytes' logger.

    At import, bitsandbytes wraps four pure-PyTorch fallback kernels (backends/default/ops.py) in torch.compile,
    which imports TorchInductor and functorch's partitioner: ~1 s of every trainer's and warm trainer's start on
    two cores, and lorad never calls them: on CUDA and the CPU bitsandbytes registers native kernels for those
    ops. TORCHDYNAMO_DISABLE, read when torch.compile is called, makes it hand them back uncompiled (the same
    math, the same fallback bitsandbytes takes when compiling fails); it is restored at once, so lorad's own
    train.compile is untouched (torch._dynamo.config reads TORCH_COMPILE_DISABLE, not this variable).
    """
    if "bitsandbytes" in sys.modules:
        return
    saved = os.environ.get("TORCHDYNAMO_DISABLE")
    os.environ["TORCHDYNAMO_DISABLE"] = "1"
    try:
        with contextlib.suppress(ImportError):
            import bitsandbytes  # noqa: F401
    finally:
        if saved is None:
            del os.environ["TORCHDYNAMO_DISABLE"]
        else:
            os.environ["TORCHDYNAMO_DISABLE"] = saved


def peft_config(lora, targets, task_type: str | None = None):
    """The peft config for `lora` (the job's lora section) on `targets`."""
    import_bitsandbytes()
    import peft

    common = dict(r=lora.rank, target_modules=targets, task_type=task_type)
    if lora.type in ("lora", "dora"):
        config = peft.LoraConfig(lora_alpha=lora.alpha, lora_dropout=lora.dropout, use_dora=lora.type == "dora",
                                 init_lora_weights=True, **common)
        if lora.type == "lora":  # an FP8 base and its LoRA as one autograd function, same names and exports
            from engine.frozen_base.fp8_lora import lorad_custom_modules

            config._register_custom_module(lorad_custom_modules())
        return config
    if lora.type == "lokr":
        return peft.LoKrConfig(alpha=lora.alpha, decompose_factor=lora.factor, decompose_both=lora.decompose_both,
                               **common)
    return peft.LoHaConfig(alpha=lora.alpha, **common)


def check_base_precision(lora, precision: str) -> None:
    """DoRA needs the base weight as a float tensor (peft takes its norm); an FP8 base has none to give."""
    if lora.type == "dora" and precision == "fp8":
        from engine.errors import JobInvalid

        raise JobInvalid("lora.type, model.base_precision: dora computes the norm of the base weights, which an "
                         "fp8 base does not hold as floats (auto picks fp8 on GPUs with FP8 tensor cores); "
                         "set model.base_precision: bf16 for dora")


def adapter_layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """Module path -> peft tuner layer (any lora.type) holding the "default" adapter."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    return {name: mod for name, mod in model.named_modules()
            if isinstance(mod, BaseTunerLayer) and "default" in getattr(mod, "scaling", {})}


def set_adapter_dtype(model: torch.nn.Module, dtype_name: str) -> None:
    """Store every trainable (adapter) parameter in `lora.dtype`; the frozen base keeps its own dtype."""
    dtype = torch_dtype(dtype_name)
    for p in model.parameters():
        if p.requires_grad and p.dtype != dtype:
            p.data = p.data.to(dtype)


def compute_autocast(model_dtype_name: str, adapter_dtype_name: str, device: torch.device):
    """A context for the forward and loss: autocast to the base dtype when the adapters are stored wider."""
    model_dtype, adapter_dtype = torch_dtype(model_dtype_name), torch_dtype(adapter_dtype_name)
    if model_dtype == adapter_dtype or model_dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=model_dtype)


def trainable(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """The adapter's parameters by name: what the optimizer steps and a checkpoint saves."""
    return {n: p for n, p in model.named_parameters() if p.requires_grad}
