"""Flux LoRA files that diffusers and ComfyUI load with the scale they were trained at.

`pytorch_lora_weights.safetensors` (output.formats: diffusers) — diffusers' own
layout, what `FluxPipeline.load_lora_weights(dir)` reads:

    transformer.<module path>.lora_A.weight   [r, in]
    transformer.<module path>.lora_B.weight   [out, r]
    transformer.<module path>.alpha           scalar, lora.alpha

The forward is W·x + (alpha / r) · B·A·x. diffusers reads the `.alpha` tensors
as network alphas (lora_alpha = alpha), and ComfyUI, which ignores file
metadata, reads `<key>.alpha` beside `<key>.lora_A.weight` the same way, so
both apply alpha/r. No `lora_adapter_metadata` key is written, so the alphas
are the one source of the scale.

`flux_lora_comfyui.safetensors` (output.formats: comfyui) — kohya sd-scripts'
Flux naming over the original BFL module names, which ComfyUI maps by its
generic rule `lora_unet_<name with dots as underscores>` →
`diffusion_model.<name>.weight` (and which kohya, Forge and diffusers'
kohya converter read):

    lora_unet_<bfl name>.lora_down.weight   [r', in]
    lora_unet_<bfl name>.lora_up.weight     [out, r']
    lora_unet_<bfl name>.alpha              scalar; ComfyUI scales by alpha / r'

The mapping from diffusers modules to BFL modules (i = block index):

    transformer_blocks.i.attn.to_q | to_k | to_v          double_blocks.i.img_attn.qkv   (rows q, k, v)
    transformer_blocks.i.attn.to_out.0                    double_blocks.i.img_attn.proj
    transformer_blocks.i.attn.add_q_proj | add_k | add_v  double_blocks.i.txt_attn.qkv   (rows q, k, v)
    transformer_blocks.i.attn.to_add_out                  double_blocks.i.txt_attn.proj
    transformer_blocks.i.ff.net.0.proj | ff.net.2         double_blocks.i.img_mlp.0 | img_mlp.2
    transformer_blocks.i.ff_context.net.0.proj | .net.2   double_blocks.i.txt_mlp.0 | txt_mlp.2
    transformer_blocks.i.norm1.linear | norm1_context     double_blocks.i.img_mod.lin | txt_mod.lin
    single_transformer_blocks.i.attn.to_q|k|v, proj_mlp   single_blocks.i.linear1        (rows q, k, v, mlp)
    single_transformer_blocks.i.proj_out                  single_blocks.i.linear2
    single_transformer_blocks.i.norm.linear               single_blocks.i.modulation.lin
    x_embedder | context_embedder | proj_out              img_in | txt_in | final_layer.linear
    time_text_embed.timestep_embedder.linear_1 | _2       time_in.in_layer | out_layer
    time_text_embed.text_embedder.linear_1 | _2           vector_in.in_layer | out_layer
    time_text_embed.guidance_embedder.linear_1 | _2       guidance_in.in_layer | out_layer
    norm_out.linear                                       final_layer.adaLN_modulation.1 (output halves swapped:
                                                          diffusers emits scale, shift; BFL shift, scale)

BFL fuses q, k, v (and the single blocks' MLP input) into one linear. k of
its parts trained as separate rank-r LoRAs become one rank-k·r LoRA with the
A matrices stacked (down = [A_q; A_k; A_v]) and the B matrices on the block
diagonal of up (zeros elsewhere, zeros for a part that was not trained), and
alpha' = k · alpha, so alpha'/r' = alpha/r and the update of every row block
is exactly B_j·A_j scaled as trained.

Both files carry safetensors metadata: base model, rank, alpha, steps,
trigger, dataset hash, lorad version (and kohya's ss_* names in the ComfyUI
file).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

DIFFUSERS_FILE = "pytorch_lora_weights.safetensors"
COMFYUI_FILE = "flux_lora_comfyui.safetensors"

# Per block kind: diffusers sub-path -> (BFL name template, the sub-paths fused into that BFL linear in row order,
# or None for a one-to-one module).
_DOUBLE_QKV = ("attn.to_q", "attn.to_k", "attn.to_v")
_DOUBLE_TXT_QKV = ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj")
_SINGLE_LINEAR1 = ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp")
_BLOCK_RULES = {
    "transformer_blocks": {
        **{p: ("double_blocks.{i}.img_attn.qkv", _DOUBLE_QKV) for p in _DOUBLE_QKV},
        **{p: ("double_blocks.{i}.txt_attn.qkv", _DOUBLE_TXT_QKV) for p in _DOUBLE_TXT_QKV},
        "attn.to_out.0": ("double_blocks.{i}.img_attn.proj", None),
        "attn.to_add_out": ("double_blocks.{i}.txt_attn.proj", None),
        "ff.net.0.proj": ("double_blocks.{i}.img_mlp.0", None),
        "ff.net.2": ("double_blocks.{i}.img_mlp.2", None),
        "ff_context.net.0.proj": ("double_blocks.{i}.txt_mlp.0", None),
        "ff_context.net.2": ("double_blocks.{i}.txt_mlp.2", None),
        "norm1.linear": ("double_blocks.{i}.img_mod.lin", None),
        "norm1_context.linear": ("double_blocks.{i}.txt_mod.lin", None),
    },
    "single_transformer_blocks": {
        **{p: ("single_blocks.{i}.linear1", _SINGLE_LINEAR1) for p in _SINGLE_LINEAR1},
        "proj_out": ("single_blocks.{i}.linear2", None),
        "norm.linear": ("single_blocks.{i}.modulation.lin", None),
    },
}
_TOP_RULES = {
    "x_embedder": "img_in",
    "context_embedder": "txt_in",
    "proj_out": "final_layer.linear",
    "time_text_embed.timestep_embedder.linear_1": "time_in.in_layer",
    "time_text_embed.timestep_embedder.linear_2": "time_in.out_layer",
    "time_text_embed.text_embedder.linear_1": "vector_in.in_layer",
    "time_text_embed.text_embedder.linear_2": "vector_in.out_layer",
    "time_text_embed.guidance_embedder.linear_1": "guidance_in.in_layer",
    "time_text_embed.guidance_embedder.linear_2": "guidance_in.out_layer",
    "norm_out.linear": "final_layer.adaLN_modulation.1",
}
_SWAP_HALVES = {"final_layer.adaLN_modulation.1"}
_BLOCK = re.compile(r"^(transformer_blocks|single_transformer_blocks)\.(\d+)\.(.+)$")


def bfl_target(module: str) -> tuple[str, tuple[str, ...] | None]:
    """(BFL module name, the diffusers sub-paths fused into it in row order, or None) for a diffusers module."""
    m = _BLOCK.match(module)
    if m:
        kind, i, rest = m.groups()
        rule = _BLOCK_RULES[kind].get(rest)
        if rule is not None:
            name, parts = rule
            return name.format(i=i), parts
    elif module in _TOP_RULES:
        return _TOP_RULES[module], None
    raise ValueError(f"no ComfyUI/BFL name for Flux module {module!r}")


def lora_modules(model: torch.nn.Module) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.nn.Module]]:
    """Diffusers module path -> (A [r, in], B [out, r], the base linear) for every LoRA layer, on the CPU."""
    out = {}
    for name, mod in model.named_modules():
        if hasattr(mod, "lora_A") and "default" in getattr(mod, "lora_A", {}):
            a = mod.lora_A["default"].weight.detach().to("cpu", torch.float32).contiguous()
            b = mod.lora_B["default"].weight.detach().to("cpu", torch.float32).contiguous()
            out[name] = (a, b, mod.get_base_layer())
    return out


def _metadata(cfg, meta: dict[str, Any]) -> dict[str, str]:
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
        "lorad_targets": json.dumps(cfg.lora.targets) if cfg.lora.targets is not None else "flux-default",
    }


def diffusers_state_dict(mods, alpha: float) -> dict[str, torch.Tensor]:
    sd = {}
    for name, (a, b, _base) in mods.items():
        sd[f"transformer.{name}.lora_A.weight"] = a
        sd[f"transformer.{name}.lora_B.weight"] = b
        sd[f"transformer.{name}.alpha"] = torch.tensor(float(alpha))
    return sd


def _out_features(model: torch.nn.Module, path: str) -> int:
    mod = model.get_submodule(path)
    return (mod.get_base_layer() if hasattr(mod, "get_base_layer") else mod).out_features


def comfyui_state_dict(model: torch.nn.Module, mods, rank: int, alpha: float) -> dict[str, torch.Tensor]:
    """kohya/ComfyUI keys over BFL names; fused linears get stacked downs and block-diagonal ups (see docstring)."""
    groups: dict[str, tuple[str, tuple[str, ...] | None]] = {}
    for name in mods:
        target, parts = bfl_target(name)
        prefix = name
        if parts is not None:
            prefix = name[: -len(next(p for p in parts if name.endswith("." + p)))]
        groups[target] = (prefix, parts)
    sd: dict[str, torch.Tensor] = {}
    for target, (prefix, parts) in sorted(groups.items()):
        key = "lora_unet_" + target.replace(".", "_")
        if parts is None:
            a, b, _ = mods[prefix]
            up = b
            if target in _SWAP_HALVES:
                half = b.shape[0] // 2
                up = torch.cat([b[half:], b[:half]])
            down, k = a, 1
        else:
            present = [p for p in parts if prefix + p in mods]
            k = len(present)
            down = torch.cat([mods[prefix + p][0] for p in present])
            # Row offsets come from every part of the fused linear, trained or not.
            sizes = [_out_features(model, prefix + p) for p in parts]
            up = torch.zeros(sum(sizes), k * rank)
            row, col = 0, 0
            for p, size in zip(parts, sizes, strict=True):
                if prefix + p in mods:
                    up[row : row + size, col : col + rank] = mods[prefix + p][1]
                    col += rank
                row += size
        sd[f"{key}.lora_down.weight"] = down.contiguous()
        sd[f"{key}.lora_up.weight"] = up.contiguous()
        sd[f"{key}.alpha"] = torch.tensor(float(alpha) * k)
    return sd


def export(model: torch.nn.Module, cfg, out_dir: Path, meta: dict[str, Any]) -> list[str]:
    """Write the formats in cfg.output.formats into out_dir; return the file names."""
    mods = lora_modules(model)
    md = _metadata(cfg, meta)
    names = []
    if "diffusers" in cfg.output.formats:
        save_file(diffusers_state_dict(mods, cfg.lora.alpha), str(out_dir / DIFFUSERS_FILE), metadata=md)
        names.append(DIFFUSERS_FILE)
    if "comfyui" in cfg.output.formats:
        kohya = {"ss_network_module": "networks.lora_flux", "ss_network_dim": str(cfg.lora.rank),
                 "ss_network_alpha": str(cfg.lora.alpha), "ss_base_model_version": "flux1",
                 "ss_output_name": cfg.name}
        save_file(comfyui_state_dict(model, mods, cfg.lora.rank, cfg.lora.alpha), str(out_dir / COMFYUI_FILE),
                  metadata={**md, **kohya})
        names.append(COMFYUI_FILE)
    return names
