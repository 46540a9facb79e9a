"""FLUX.1's LoRA files that diffusers and ComfyUI load with the scale they were trained at.

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

import functools
import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from engine.families.image import export as image_export
from engine.families.image.export import (
    DIFFUSERS_FILE,
    comfyui_state_dict,
    cpu_f32,
    lora_modules,
    lycoris_state_dict,
    metadata,
)

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
# FLUX.1's diffusers module -> (BFL name, fused parts); flux2.py has FLUX.2's.
bfl_target = functools.partial(image_export.bfl_target, block_rules=_BLOCK_RULES, top_rules=_TOP_RULES)
def dora_magnitudes(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Diffusers module path -> DoRA magnitude [out] for every DoRA layer (none for plain LoRA)."""
    return {name: cpu_f32(mod.lora_magnitude_vector["default"].weight) for name, mod in model.named_modules()
            if "default" in getattr(mod, "lora_magnitude_vector", {})}


def lycoris_key(name: str) -> str:
    """ComfyUI's Flux key for a LyCORIS layer (module docstring); a module ComfyUI has no BFL weight for is an
    error here, not a silently ignored key."""
    bfl_target(name)
    return "lycoris_" + name.replace(".", "_")


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


def export(model: torch.nn.Module, cfg, out_dir: Path, meta: dict[str, Any], comfyui_file: str = COMFYUI_FILE,
           base_version: str = "flux1") -> list[str]:
    """Write the formats in cfg.output.formats into out_dir; return the file names.

    Chroma (engine/families/image/chroma/family.py) writes the same two layouts under its own ComfyUI file name and
    kohya base-model version: its modules are a subset of FLUX.1's, by the same names in diffusers and ComfyUI."""
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
                 "ss_base_model_version": base_version, "ss_output_name": cfg.name}
        if lycoris:
            kohya["ss_network_args"] = json.dumps({"algo": cfg.lora.type})
        sd = lycoris_state_dict(model, lycoris_key) if lycoris else comfyui_state_dict(model, mods, cfg.lora.rank, cfg.lora.alpha,
                                                                          bfl_target, _SWAP_HALVES)
        save_file(sd, str(out_dir / comfyui_file), metadata={**md, **kohya})
        names.append(comfyui_file)
    return names
