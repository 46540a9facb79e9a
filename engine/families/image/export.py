"""The diffusers LoRA file of the FLUX.2 and Qwen-Image families, and the metadata every image export carries.

`pytorch_lora_weights.safetensors` (output.formats: diffusers) is the layout
the pipelines' `save_lora_weights` writes and `load_lora_weights` reads:

    transformer.<module path>.lora_A.weight   [r, in]
    transformer.<module path>.lora_B.weight   [out, r]
    metadata "lora_adapter_metadata"          JSON of the peft LoraConfig, keys prefixed "transformer."

Unlike FLUX.1's loader, the FLUX.2 and Qwen-Image loaders pass no network
alphas: `.alpha` tensors would be refused (FLUX.2) or folded into the weights
with rounding (Qwen-Image). The scale alpha / r travels in the adapter
metadata instead, where diffusers rebuilds the exact LoraConfig (r,
lora_alpha, target modules; dropout written as 0, a training-only setting
that would otherwise stay active in the loaded pipeline) — so the loaded
adapter computes bit for bit what the trained one did in eval mode. The file is written here rather than through
`save_lora_weights` only so that lorad's own metadata (base model, steps,
trigger, dataset hash) sits beside diffusers' key.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

DIFFUSERS_FILE = "pytorch_lora_weights.safetensors"


def metadata(cfg, meta: dict[str, Any]) -> dict[str, str]:
    """lorad's safetensors metadata for an exported adapter (all values strings, as safetensors requires)."""
    return {
        "format": "pt",
        "lorad_version": str(meta.get("lorad_version", "")),
        "base_model": str(meta.get("base_model", cfg.model.path)),
        "rank": str(cfg.lora.rank),
        "alpha": str(cfg.lora.alpha),
        "steps": str(meta.get("steps", "")),
        "trigger": str(meta.get("trigger", "")),
        "dataset_hash": str(meta.get("dataset_hash", "")),
        "lorad_config_hash": str(meta.get("config_hash", "")),
        "lorad_targets": (json.dumps(cfg.lora.targets) if cfg.lora.targets is not None
                          else f"{cfg.model.family}-default"),
        "lorad_adapter_type": cfg.lora.type,
    }


def save(sd: dict[str, torch.Tensor], path: Path, md: dict[str, str]) -> str:
    """Write one safetensors file (tensors on the CPU, contiguous); return its name."""
    save_file({k: v.detach().to("cpu").contiguous() for k, v in sd.items()}, str(path), metadata=md)
    return Path(path).name


def diffusers_lora_file(transformer: torch.nn.Module, out_dir: Path, md: dict[str, str]) -> str:
    """pytorch_lora_weights.safetensors with the adapter's LoraConfig in diffusers' metadata key (see docstring)."""
    from diffusers.loaders.lora_base import LORA_ADAPTER_METADATA_KEY
    from peft.utils import get_peft_model_state_dict

    sd = {f"transformer.{k}": v for k, v in get_peft_model_state_dict(transformer, adapter_name="default").items()}
    conf = transformer.peft_config["default"].to_dict()
    # Dropout is a training setting. diffusers builds the loaded adapter's dropout modules in training mode and
    # pipelines never call eval(), so a trained lora.dropout would randomly drop activations at inference.
    conf["lora_dropout"] = 0.0
    conf = {f"transformer.{k}": sorted(v) if isinstance(v, set) else v for k, v in conf.items()}
    md = {**md, LORA_ADAPTER_METADATA_KEY: json.dumps(conf, indent=2, sort_keys=True)}
    return save(sd, Path(out_dir) / DIFFUSERS_FILE, md)
