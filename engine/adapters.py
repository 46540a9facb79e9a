"""The trainable adapter's weights: their dtype (`lora.dtype`) and the compute around them.

Why fp32 by default: with a bf16 base the adapters used to be bf16 too, with no fp32 copy. bf16 keeps 8
bits of mantissa, so an update smaller than about 1/256 of a weight is rounded away: at a small (or late,
decayed) learning rate the LoRA A matrices, which start at kaiming scale, stop changing entirely
(tests/test_adapter_dtype.py shows it). kohya sd-scripts and ai-toolkit keep LoRA weights in fp32 for
this reason; so does lorad unless `lora.dtype: bfloat16` asks for the old behaviour.

Compute stays in the model dtype: when the adapter dtype is wider than the base's, the loss runs under
torch.autocast to the base dtype, so the adapter matmuls run in bf16 (autocast casts the fp32 weights on the
fly) and only the weights and their updates are fp32. Without it peft would cast each adapter's input to
fp32 and keep that copy for the backward pass — activation memory a large model cannot spare.
"""

from __future__ import annotations

import contextlib

import torch

from engine.dtypes import torch_dtype


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
