"""How the frozen base is stored and multiplied: `model.base_precision`.

    auto  fp8 on GPUs with FP8 tensor cores (sm_89+: Ada, Hopper, Blackwell), bf16 elsewhere
    bf16  the base in the model dtype, plain matmuls
    fp8   e4m3 weights + per-channel scales (engine/frozen_base/fp8.py); FP8 tensor-core matmuls where the
          GPU has them, a dequantising bf16 matmul elsewhere (same memory, bf16 speed)
    int8  bitsandbytes LLM.int8() Linear8bitLt (loaded through transformers' BitsAndBytesConfig)
    nf4   QLoRA: bitsandbytes 4-bit NF4 with double quantisation (the existing QLoRA path)

int8 and nf4 are applied while loading (the family passes `quantization_config(...)`
to from_pretrained); fp8 is applied after loading and before peft wraps the
model (`apply_base_precision`), so peft's LoRA Linear wraps the FP8 layer.
The chosen precision and the reason are logged as one `base_precision` event.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from engine.frozen_base.blockswap import swapped_blocks
from engine.frozen_base.fp8 import (
    FP8_MIN_ROWS,
    FP8Linear,
    fp8_tensor_cores,
    scaled_mm_rowwise_supported,
    shape_fits,
)
from engine.frozen_base.fp8_quant import triton_kernels_usable

# Never converted: the token embedding / output head (precision-sensitive, and not matmuls LoRA
# targets in our recipes), and for diffusion transformers the input/output projections and the
# timestep/text embedders, which are tiny, run once per step and set the scale of everything after.
# The diffusion names are anchored at the top level: Flux's single blocks have their own (large) proj_out.
DEFAULT_SKIP = (r"(^|\.)(lm_head|embed_tokens|wte|wpe|embed_out)(\.|$)"
                r"|^(proj_out|norm_out|x_embedder|context_embedder|time_text_embed)(\.|$)")


@dataclass
class PrecisionReport:
    precision: str
    reason: str
    compute: str = "n/a"  # fp8 only: scaled_mm / dequant
    rowwise: bool | None = None
    converted: int = 0
    fallback_layers: list[str] = field(default_factory=list)  # fp8 layers whose shapes need dequant compute
    skipped: list[str] = field(default_factory=list)
    quantisation: str = "n/a"  # fp8 only: "triton" (fused kernels) or "torch" (the reference)

    def event(self) -> dict:
        ev = {"precision": self.precision, "reason": self.reason, "compute": self.compute, "rowwise": self.rowwise,
              "converted_layers": self.converted, "shape_fallback_layers": len(self.fallback_layers),
              "skipped_layers": self.skipped[:8]}
        if self.precision == "fp8":  # how activations are quantised, and below how many rows they are not
            ev.update(quantisation=self.quantisation, weight_only_below_rows=FP8_MIN_ROWS)
        return ev


def resolve(choice: str, device: torch.device) -> tuple[str, str]:
    """The precision to use for `choice` on `device`, and why, in words."""
    device = torch.device(device)
    if device.type == "cuda":
        cap = torch.cuda.get_device_capability(device)
        where = f"{torch.cuda.get_device_name(device)} (sm_{cap[0]}{cap[1]})"
    else:
        where = f"{device.type} (no FP8 tensor cores)"
    if choice != "auto":
        if choice == "fp8" and not fp8_tensor_cores(device):
            return "fp8", f"requested; {where}: FP8 storage with a dequantising matmul"
        return choice, "requested"
    if fp8_tensor_cores(device):
        return "fp8", f"auto: {where} has FP8 tensor cores"
    if device.type == "cuda":
        return "bf16", f"auto: {where} has no FP8 tensor cores (needs sm_89+)"
    return "bf16", f"auto: {where}"


def quantization_config(precision: str, compute_dtype: torch.dtype, library: str = "transformers"):
    """The BitsAndBytesConfig (transformers' or diffusers') for the load-time precisions (nf4, int8); else None."""
    if precision not in ("nf4", "int8"):
        return None
    if library == "diffusers":
        from diffusers import BitsAndBytesConfig
    else:
        from transformers import BitsAndBytesConfig

    if precision == "int8":
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=compute_dtype)


def convert_linears_to_fp8(model: nn.Module, skip: str = DEFAULT_SKIP, only: str | None = None,
                           compute: str = "auto", compute_dtype: torch.dtype | None = None,
                           transposed_copy: bool = False, report: PrecisionReport | None = None,
                           device: torch.device | None = None, keep_on_host: set[int] = frozenset(),
                           host: torch.device = torch.device("cpu")) -> PrecisionReport:
    """Replace every frozen nn.Linear (except `skip`; only those matching `only`, if given) by an FP8Linear, in place.

    Runs before peft wraps the model: peft then wraps our layers like any Linear.
    Layers are converted one at a time, so the extra memory is one layer's copy. With `device`, each layer
    is moved there just before it is quantised: a model loaded on the host streams onto the GPU as FP8,
    so a 12B transformer whose bf16 weights (24 GB) would not fit on a 24 GB card never has them there.
    A linear whose weight is in `keep_on_host` (ids; the blocks block swapping will stream) is quantised on
    the device too, and its FP8 weight goes straight back to `host`: only one layer is ever on the GPU.
    """
    report = report or PrecisionReport("fp8", "")
    skip_re = re.compile(skip) if skip else None
    only_re = re.compile(only) if only else None
    targets = []
    for name, mod in model.named_modules():
        if type(mod) is not nn.Linear:  # exact type: leaves LoRA/bnb/already-converted layers alone
            continue
        if (skip_re and skip_re.search(name)) or (only_re and not only_re.search(name)):
            report.skipped.append(name)
            continue
        targets.append(name)
    for name in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        linear = getattr(parent, child)
        swapped = id(linear.weight) in keep_on_host
        if device is not None:
            linear = linear.to(device)
        layer = FP8Linear.from_linear(linear, compute_dtype=compute_dtype, compute=compute,
                                      transposed_copy=transposed_copy)
        if swapped:
            park_weights(layer, host)
        setattr(parent, child, layer)
        report.converted += 1
        # A shape fallback: FP8 tensor cores would run here (forced, or auto on an sm_89+ device) but the dims don't fit.
        if not shape_fits(layer.in_features, layer.out_features) and (
                compute == "scaled_mm" or (compute == "auto" and fp8_tensor_cores(layer.weight_scale.device))):
            report.fallback_layers.append(name)
        report.compute = layer.compute if report.compute in ("n/a", layer.compute) else "mixed"
        report.rowwise = layer.rowwise
    return report


def park_weights(layer: FP8Linear, host: torch.device) -> None:
    """Move the layer's weight (and bias) to `host`; its scale buffer stays where the layer computes."""
    params = {id(p) for p in layer.parameters()}
    layer._apply(lambda t: t.to(host) if id(t) in params else t, recurse=False)


def apply_base_precision(model: nn.Module, choice: str, device: torch.device, log=None,
                         compute_dtype: torch.dtype = torch.bfloat16, skip: str = DEFAULT_SKIP,
                         fp8_compute: str | None = None, blocks_to_swap: int = 0) -> PrecisionReport:
    """Apply `model.base_precision` to a loaded (not yet peft-wrapped) model for `device`; log the choice.

    The model may still be on the host: FP8 layers are created on `device` one by one (those of the last
    `blocks_to_swap` blocks return to the host at once), and the caller then places the rest of the model
    with engine.frozen_base.blockswap.place_model.

    For fp8 this converts the frozen linears in place; for bf16, nf4 and int8 the
    work was done at load time and this only records it. `fp8_compute` (default:
    $LORAD_FP8_COMPUTE or "auto") forces scaled_mm or dequant, for tests and
    for comparing the two paths on one GPU.
    """
    fp8_compute = fp8_compute or os.environ.get("LORAD_FP8_COMPUTE", "auto")
    precision, reason = resolve(choice, device)
    report = PrecisionReport(precision, reason)
    if precision == "fp8":
        convert_linears_to_fp8(model, skip=skip, compute=fp8_compute, compute_dtype=compute_dtype, report=report,
                               device=device, keep_on_host=swapped_linear_weights(model, blocks_to_swap))
        if report.compute == "n/a":
            report.rowwise = scaled_mm_rowwise_supported(device)
        report.quantisation = "triton" if triton_kernels_usable(device) else "torch"
        if fp8_compute != "auto":
            report.reason += f"; fp8 compute forced to {fp8_compute}"
    if log is not None:
        log.info("base_precision", **report.event())
    return report


def swapped_linear_weights(model: nn.Module, blocks_to_swap: int) -> set[int]:
    """ids of the linear weights inside the blocks block swapping will stream (not yet frozen at load time)."""
    return {id(m.weight) for b in swapped_blocks(model, blocks_to_swap) for m in b.modules() if type(m) is nn.Linear}


def fp8_layers(model: nn.Module) -> list[FP8Linear]:
    return [m for m in model.modules() if isinstance(m, FP8Linear)]
