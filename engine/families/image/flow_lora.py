"""The image families' training half: the flow-matching draws (σ, flip, caption dropout) from the checkpointed
generator, the model's own scheduler settings, and the frozen transformer with its LoRA."""

from __future__ import annotations

import json
from typing import Any

import torch

from engine.config.job import JobConfig
from engine.errors import JobInvalid
from engine.frozen_base.blockswap import place_model
from engine.frozen_base.placing import placing
from engine.frozen_base.precision import apply_base_precision, quantization_config
from engine.frozen_base.precision import resolve as resolve_precision
from engine.training.adapters import adapter_layers, check_base_precision, peft_config, set_adapter_dtype
from engine.training.dtypes import torch_dtype


def sample_sigmas(kind: str, batch: int, shift: float, generator: torch.Generator, bias=None) -> torch.Tensor:
    """Noise levels σ in [0, 1] for one batch (module docstring: sigmoid, linear, or shift by `shift` = e^μ, the
    model's own resolution-dependent factor; unused by the other two kinds).

    `bias` (train.timestep_bias) reweights the density (engine/families/image/timestep_bias.py); balanced leaves it alone.
    """
    if bias is not None and bias.strategy != "balanced":
        from engine.families.image.timestep_bias import sample_biased

        return sample_biased(kind, batch, shift if kind == "shift" else 1.0, bias.strategy, bias.multiplier,
                             bias.begin, bias.end, generator)
    if kind == "sigmoid":
        return torch.sigmoid(torch.randn(batch, generator=generator))
    t = torch.rand(batch, generator=generator)
    if kind == "linear":
        return t
    return shift * t / (shift * t + (1 - t))


def flip_and_drop(batch: dict[str, Any], cfg: JobConfig, generator: torch.Generator, conds: tuple[str, ...],
                  draw: bool = True):
    """(latents, flip, conditions) of a batch with the two data draws, in this order, from `generator`:
    data.flip per sample (the mirrored latents where drawn; flip is None without data.flip), then caption
    dropout per sample (each condition NAME replaced by the batch's `empty_NAME` where drawn). draw=False (a
    validation loss): neither, the sample as it is."""
    x0 = batch["latents"]
    b, device = x0.shape[0], x0.device
    flip = None
    if "latents_flip" in batch and draw:
        flip = (torch.rand(b, generator=generator) < 0.5).to(device)
        x0 = torch.where(flip.view(b, *[1] * (x0.dim() - 1)), batch["latents_flip"], x0)  # video latents: 5-D
    out = {k: _flipped(batch, k, flip) for k in conds}
    if cfg.data.caption_dropout > 0 and draw:
        drop = (torch.rand(b, generator=generator) < cfg.data.caption_dropout).to(device)
        out = {k: torch.where(drop.view(b, *[1] * (v.dim() - 1)), _flipped(batch, f"empty_{k}", flip).expand_as(v),
                              v) for k, v in out.items()}
    return x0, flip, out


def _flipped(batch: dict[str, Any], key: str, flip: torch.Tensor | None) -> torch.Tensor:
    """batch[key], or where the sample was mirrored its KEY_flip: an edit pair's instruction encoded with its
    mirrored control (Qwen-Image-Edit). Other batches have no KEY_flip."""
    v = batch[key]
    if flip is None or f"{key}_flip" not in batch:
        return v
    return torch.where(flip.view(-1, *[1] * (v.dim() - 1)), batch[f"{key}_flip"], v)


def add_lora(transformer: torch.nn.Module, cfg: JobConfig, default_targets: str) -> torch.nn.Module:
    """Freeze the transformer and add the peft adapter of lora.type (named "default") with diffusers' add_adapter."""
    transformer.requires_grad_(False)
    lcfg = peft_config(cfg.lora, cfg.lora.targets if cfg.lora.targets is not None else default_targets)
    try:
        transformer.add_adapter(lcfg)
    except ValueError as e:
        raise JobInvalid(f"lora.targets: {e}".splitlines()[0]) from None
    return transformer


def load_lora_transformer(model_cls: type, path: str, cfg: JobConfig, device: torch.device, log, *, fp8_skip: str,
                          default_targets: str, subfolder: str = "transformer") -> torch.nn.Module:
    """A diffusers transformer from `path`, frozen in its base precision, with LoRA, placed for block swapping.

    base_precision nf4/int8: bitsandbytes quantises while loading (diffusers' BitsAndBytesConfig; CUDA only).
    fp8: the frozen linears become FP8 layers before peft wraps them (engine/frozen_base/precision.py), each quantised on
    the device as it moves there, so the bf16 transformer is never on the GPU whole. After LoRA, the model is
    placed: the swapped blocks' frozen weights stay in host memory (engine/frozen_base/blockswap.py) and their adapters
    (created next to them) move to the device.
    """
    dtype = torch_dtype(cfg.model.dtype)
    precision, _ = resolve_precision(cfg.model.effective_base_precision, device)
    check_base_precision(cfg.lora, precision)
    qconf = quantization_config(precision, dtype, library="diffusers")
    kwargs = {"quantization_config": qconf} if qconf is not None else {}
    try:
        transformer = model_cls.from_pretrained(path, subfolder=subfolder, revision=cfg.model.revision,
                                                dtype=dtype, **kwargs)
    except RuntimeError as e:
        if qconf is None or "GPU" not in str(e):
            raise
        raise JobInvalid(f"model.base_precision: {precision} needs a CUDA GPU (bitsandbytes); "
                         "use fp8 or bf16 on this machine") from None
    if getattr(cfg.model, "assistant_lora", None) is not None:  # into the base as read, before fp8 and LoRA
        from engine.families.image.assistant import merge_assistant

        merge_assistant(transformer, path, cfg, log)
    if qconf is not None:
        from peft import prepare_model_for_kbit_training

        transformer = prepare_model_for_kbit_training(transformer, use_gradient_checkpointing=False)
    swap = cfg.train.blocks_to_swap
    with placing(transformer, swap):  # an out-of-memory here: the daemon swaps more blocks and loads again
        apply_base_precision(transformer, cfg.model.effective_base_precision, device, log, compute_dtype=dtype,
                             skip=fp8_skip, blocks_to_swap=swap)
        if cfg.train.gradient_checkpointing:
            transformer.enable_gradient_checkpointing()
        add_lora(transformer, cfg, default_targets)
        set_adapter_dtype(transformer, cfg.lora.dtype)  # fp32 by default over any base (engine/training/adapters.py)
        if qconf is None:
            place_model(transformer, device, swap)
    n = sum(p.numel() for p in transformer.parameters() if p.requires_grad)
    log.info("lora", trainable_params=n, modules=len(adapter_layers(transformer)), type=cfg.lora.type)
    return transformer


def scheduler_settings(path: str, revision: str | None) -> dict[str, Any]:
    """The model's own scheduler config (its shift settings drive timestep_sampling: shift)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    try:
        return dict(FlowMatchEulerDiscreteScheduler.load_config(path, subfolder="scheduler", revision=revision))
    except (OSError, ValueError, json.JSONDecodeError):
        return {}  # a transformer-only directory: the pipeline's defaults
