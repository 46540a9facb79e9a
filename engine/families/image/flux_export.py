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

LoKr and LoHa (lora.type) go into the ComfyUI file only (diffusers' load_lora_weights reads LoRA and
DoRA; validation refuses the other combinations). They cannot be fused like LoRA (a Kronecker or Hadamard
product of parts is not a product of stacked parts), and need not be: ComfyUI's Flux key map
(comfy/lora.py model_lora_keys_unet over comfy/utils.py flux_to_diffusers) also reads LyCORIS keys named
after the diffusers modules and applies each to its slice of the fused BFL weight itself:

    lycoris_<diffusers module path with dots as underscores>.<tensor>  ->  diffusion_model.<BFL weight>
                                                                           (rows of q, k, v or mlp for the
                                                                           fused linears; norm_out's halves
                                                                           swapped by ComfyUI)

with the tensor names of ComfyUI's LoKr and LoHa loaders (comfy/weight_adapter/lokr.py, loha.py):

    LoKr  lokr_w1 | lokr_w1_a + lokr_w1_b,  lokr_w2 | lokr_w2_a + lokr_w2_b,  alpha
          ComfyUI adds (alpha / dim) · kron(w1, w2), dim = the rank of w2's factors if w2 is factored, else of
          w1's; with neither factored it ignores alpha and adds kron(w1, w2)
    LoHa  hada_w1_a, hada_w1_b, hada_w2_a, hada_w2_b, alpha
          ComfyUI adds (alpha / hada_w1_b.shape[0]) · (w1a·w1b) ⊙ (w2a·w2b)

peft scales both by alpha / r; we write alpha' = (alpha / r) · dim so ComfyUI applies the same scale, and for
an unfactored LoKr we fold the scale into lokr_w1 (the product is bilinear).

Both files carry safetensors metadata: base model, rank, alpha, steps,
trigger, dataset hash, lorad version, adapter type (and kohya's ss_* names in the ComfyUI
file).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from engine.families.image.export import metadata

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


def bfl_target(module: str, block_rules: dict | None = None, top_rules: dict | None = None
               ) -> tuple[str, tuple[str, ...] | None]:
    """(BFL module name, the diffusers sub-paths fused into it in row order, or None) for a diffusers module.

    The rules are FLUX.1's unless given (engine/families/image/flux2.py passes FLUX.2's).
    """
    block_rules, top_rules = block_rules or _BLOCK_RULES, top_rules or _TOP_RULES
    m = _BLOCK.match(module)
    if m:
        kind, i, rest = m.groups()
        rule = block_rules[kind].get(rest)
        if rule is not None:
            name, parts = rule
            return name.format(i=i), parts
    elif module in top_rules:
        return top_rules[module], None
    raise ValueError(f"no ComfyUI/BFL name for module {module!r}")


def _cpu(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", torch.float32).contiguous()


def lora_modules(model: torch.nn.Module) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.nn.Module]]:
    """Diffusers module path -> (A [r, in], B [out, r], the base linear) for every LoRA layer, on the CPU."""
    out = {}
    for name, mod in model.named_modules():
        if hasattr(mod, "lora_A") and "default" in getattr(mod, "lora_A", {}):
            out[name] = (_cpu(mod.lora_A["default"].weight), _cpu(mod.lora_B["default"].weight), mod.get_base_layer())
    return out


def dora_magnitudes(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Diffusers module path -> DoRA magnitude [out] for every DoRA layer (none for plain LoRA)."""
    return {name: _cpu(mod.lora_magnitude_vector["default"].weight) for name, mod in model.named_modules()
            if "default" in getattr(mod, "lora_magnitude_vector", {})}


def _factor(layer, name: str) -> torch.Tensor | None:
    params = getattr(layer, name)
    return _cpu(params["default"]) if "default" in params else None


def lycoris_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """LoKr/LoHa layers as LyCORIS keys over diffusers module names, scaled for ComfyUI (module docstring)."""
    from engine.training.adapters import adapter_layers

    sd: dict[str, torch.Tensor] = {}
    for name, layer in adapter_layers(model).items():
        bfl_target(name)  # a module ComfyUI has no BFL weight for is an error here, not a silently ignored key
        key = "lycoris_" + name.replace(".", "_")
        scale = float(layer.scaling["default"])
        if hasattr(layer, "hada_w1_a"):
            parts = {p: _factor(layer, p) for p in ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b")}
            dim = parts["hada_w1_b"].shape[0]
        else:
            parts = {p: t for p in ("lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b")
                     if (t := _factor(layer, p)) is not None}
            dim = next((parts[p].shape[0] for p in ("lokr_w2_b", "lokr_w1_b") if p in parts), None)
            if dim is None:  # neither factor is low-rank: ComfyUI ignores alpha, so the scale goes into w1
                parts["lokr_w1"] = parts["lokr_w1"] * scale
        sd.update({f"{key}.{p}": t for p, t in parts.items()})
        if dim is not None:
            sd[f"{key}.alpha"] = torch.tensor(scale * dim)
    return sd


def diffusers_state_dict(mods, alpha: float, magnitudes: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """diffusers' peft layout; a DoRA magnitude is peft's `lora_magnitude_vector` key, which diffusers reads as
    use_dora."""
    sd = {}
    for name, (a, b, _base) in mods.items():
        sd[f"transformer.{name}.lora_A.weight"] = a
        sd[f"transformer.{name}.lora_B.weight"] = b
        sd[f"transformer.{name}.alpha"] = torch.tensor(float(alpha))
    for name, m in (magnitudes or {}).items():
        sd[f"transformer.{name}.lora_magnitude_vector"] = m
    return sd


def _out_features(model: torch.nn.Module, path: str) -> int:
    mod = model.get_submodule(path)
    return (mod.get_base_layer() if hasattr(mod, "get_base_layer") else mod).out_features


def comfyui_state_dict(model: torch.nn.Module, mods, rank: int, alpha: float, target=bfl_target,
                       swap_halves: set[str] = _SWAP_HALVES) -> dict[str, torch.Tensor]:
    """kohya/ComfyUI keys over BFL names; fused linears get stacked downs and block-diagonal ups (see docstring).

    `target` maps a diffusers module to its BFL name and fused parts (FLUX.1's by default; FLUX.2 passes its own),
    `swap_halves` names the BFL linears whose output halves are in the other order.
    """
    groups: dict[str, tuple[str, tuple[str, ...] | None]] = {}
    for name in mods:
        bfl, parts = target(name)
        prefix = name
        if parts is not None:
            prefix = name[: -len(next(p for p in parts if name.endswith("." + p)))]
        groups[bfl] = (prefix, parts)
    sd: dict[str, torch.Tensor] = {}
    for bfl, (prefix, parts) in sorted(groups.items()):
        key = "lora_unet_" + bfl.replace(".", "_")
        if parts is None:
            a, b, _ = mods[prefix]
            up = b
            if bfl in swap_halves:
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
    md = metadata(cfg, meta)
    names = []
    lycoris = cfg.lora.type in ("lokr", "loha")
    if "diffusers" in cfg.output.formats:  # lora or dora (validation refuses the rest)
        save_file(diffusers_state_dict(mods, cfg.lora.alpha, dora_magnitudes(model)), str(out_dir / DIFFUSERS_FILE),
                  metadata=md)
        names.append(DIFFUSERS_FILE)
    if "comfyui" in cfg.output.formats:  # lora, lokr or loha
        kohya = {"ss_network_module": "lycoris.kohya" if lycoris else "networks.lora_flux",
                 "ss_network_dim": str(cfg.lora.rank), "ss_network_alpha": str(cfg.lora.alpha),
                 "ss_base_model_version": "flux1", "ss_output_name": cfg.name}
        if lycoris:
            kohya["ss_network_args"] = json.dumps({"algo": cfg.lora.type})
        sd = lycoris_state_dict(model) if lycoris else comfyui_state_dict(model, mods, cfg.lora.rank, cfg.lora.alpha)
        save_file(sd, str(out_dir / COMFYUI_FILE), metadata={**md, **kohya})
        names.append(COMFYUI_FILE)
    return names
