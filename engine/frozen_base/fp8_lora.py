"""peft's LoRA over an FP8 base as one autograd function: the layer peft's custom-module dispatch builds.

peft wraps an FP8Linear like any nn.Linear (its `lora.Linear`): the base runs, then `lora_B(lora_A(dropout(x)))
* scaling` as four more kernels and three more autograd nodes, the input cast once more for the adapter.
`FP8LoraLinear` is that same peft layer (its `lora_A`/`lora_B`/`base_layer` names, its state dict, merging
and every export unchanged) whose forward, in the plain case, is one call of fp8.FrozenFP8Function:

    y = base(x) (bias inside the GEMM) + scaling · (x Aᵀ) Bᵀ     one addmm: scaling is its alpha

The input is cast to the compute dtype once and read by both the base (its quantisation, shared with the
layer's same-input siblings) and the adapter's down-projection. The backward computes the base's input
gradient, dA and dB from one dy, the scaling folded into the rank-sized operands.

The plain case: one active adapter, not merged, no dropout (lorad's default `lora.dropout: 0`), no variant
(DoRA and the rest), no adapter bias, no per-call adapter names. Anything else goes to peft's own forward.
`lorad_custom_modules()` is the mapping engine/training/adapters.py registers on the LoraConfig.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from peft.tuners.lora.layer import Linear as PeftLoraLinear

from engine.frozen_base.fp8 import FP8Linear, FrozenFP8Function, quantize_activation


def compute_dtype(x: torch.Tensor, layer: FP8Linear) -> torch.dtype:
    """What the layer computes in: autocast's dtype where it is on (as an nn.Linear would), else x's float dtype."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    if x.dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
        return x.dtype
    return layer.compute_dtype


def fp8_linear_with_lora(layer: FP8Linear, x: torch.Tensor, lora_A: torch.Tensor, lora_B: torch.Tensor,
                         scaling: float) -> torch.Tensor:
    """layer(x) + scaling · (x Aᵀ) Bᵀ through one autograd function."""
    lead = x.shape[:-1]
    x2d = x.reshape(-1, layer.in_features).to(compute_dtype(x, layer))
    path = layer.path_for(x2d.shape[0])
    x8, sx = quantize_activation(x2d, source=x) if path == "fp8" else (None, None)
    y = FrozenFP8Function.apply(x2d, lora_A, lora_B, layer, float(scaling), path, x8, sx)
    return y.reshape(*lead, layer.out_features)


class FP8LoraLinear(PeftLoraLinear):
    """peft's LoRA Linear over an FP8Linear, its plain forward fused (module docstring)."""

    def _fused_adapter(self, args, kwargs) -> str | None:
        if args or kwargs or self.disable_adapters or self.merged or len(self.active_adapters) != 1:
            return None
        name = self.active_adapters[0]
        if (name not in self.lora_A or name in self.lora_variant
                or not isinstance(self.lora_dropout[name], nn.Identity)
                or self.lora_A[name].bias is not None or self.lora_B[name].bias is not None):
            return None
        return name

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        name = self._fused_adapter(args, kwargs)
        if name is None:
            return super().forward(x, *args, **kwargs)
        return fp8_linear_with_lora(self.get_base_layer(), x, self.lora_A[name].weight, self.lora_B[name].weight,
                                    self.scaling[name])


def lorad_custom_modules() -> dict[type[nn.Module], type[nn.Module]]:
    """peft's custom-module mapping (LoraConfig._register_custom_module): FP8 bases get the fused layer."""
    return {FP8Linear: FP8LoraLinear}
