"""SDXL's two LoRA files: diffusers' (`StableDiffusionXLPipeline.load_lora_weights`) and kohya's (ComfyUI, A1111,
Forge), with the rules that name the kohya keys.

`pytorch_lora_weights.safetensors` (output.formats: diffusers) — the layout `StableDiffusionXLPipeline
.save_lora_weights` writes and `load_lora_weights` reads (peft names under the `unet.` prefix):

    unet.<diffusers module path>.lora_A.weight   [r, in] (a conv's [r, in, kh, kw])
    unet.<diffusers module path>.lora_B.weight   [out, r] (a conv's [out, r, 1, 1])  × alpha / r (folded)
    metadata "lora_adapter_metadata"             the peft LoraConfig with lora_alpha = r, keys prefixed "unet."

The scale is folded into lora_B and the metadata says lora_alpha = r (as for the flow-matching families:
engine/families/image/export.py), so every reader applies the trained update (alpha / r)·B·A.

`sdxl_lora_comfyui.safetensors` (output.formats: comfyui) — kohya sd-scripts' SDXL names, which ComfyUI, A1111 and
Forge load: the module's name in the original (SGM) UNet, dots as underscores, after `lora_unet_`:

    lora_unet_<sgm path with _>.lora_down.weight   = A   [r, in] (a conv's [r, in, kh, kw])
    lora_unet_<sgm path with _>.lora_up.weight     = B   [out, r] (a conv's [out, r, 1, 1])
    lora_unet_<sgm path with _>.alpha              = lora.alpha; the update is (alpha / r)·up·down

ComfyUI's loader (comfy/lora.py, model_lora_keys_unet) maps `lora_unet_<k with . as _>` to the model weight
`diffusion_model.<k>.weight` for every weight k of its UNet, whose names are the SGM ones; and (through
comfy/utils.py's unet_to_diffusers) `lora_unet_<diffusers path with _>` to the same weight. load_lora reads
`<key>.lora_up.weight` / `.lora_down.weight` and `<key>.alpha` (scale alpha / rank; 1 without). kohya's own
SDXL networks and A1111/Forge use the SGM form, so that is the one written.

unet_to_diffusers, as ComfyUI writes it, from the UNet's config (num_res_blocks[x] = L per level x,
transformer_depth per input res block, transformer_depth_output per output block listed from the last output
block to the first and taken from the end, transformer_depth_middle):

    down_blocks.x.resnets.i.<r>          input_blocks.n.0.<R(r)>          n = 1 + (L + 1)·x + i
    down_blocks.x.attentions.i.<rest>    input_blocks.n.1.<rest>          (where that res block has transformers)
    down_blocks.x.downsamplers.0.conv    input_blocks.(L + 1)·(x + 1).0.op
    mid_block.resnets.0 | 1 .<r>         middle_block.0 | 2 .<R(r)>
    mid_block.attentions.0.<rest>        middle_block.1.<rest>
    up_blocks.x.resnets.i.<r>            output_blocks.n.0.<R(r)>         n = (L + 1)·x + i, i ≤ L
    up_blocks.x.attentions.i.<rest>      output_blocks.n.1.<rest>         (where that output block has transformers)
    up_blocks.x.upsamplers.0.conv        output_blocks.(L + 1)·x + L .c.conv   c = 2 with transformers, else 1
    conv_in | conv_out                   input_blocks.0.0 | out.2
    time_embedding.linear_1 | linear_2   time_embed.0 | time_embed.2
    add_embedding.linear_1 | linear_2    label_emb.0.0 | label_emb.0.2

    R: conv1 → in_layers.2, time_emb_proj → emb_layers.1, conv2 → out_layers.3, conv_shortcut → skip_connection
    <rest>: proj_in, proj_out, transformer_blocks.t.{attn1,attn2}.{to_q,to_k,to_v,to_out.0}, ff.net.0.proj,
    ff.net.2 — the same names on both sides.

The LoRA targets (lora.targets, default: attention) may include the resnets' convs and the samplers (LoCon):
every module in the table maps.

The text encoders (lora.text_encoder; text.py) add their LoRA to both files. In the diffusers file under the
pipeline's component names, which load_lora_weights strips before loading each encoder's adapter (lora_base.py's
_load_lora_into_text_encoder), with their own peft configs in the metadata under the same prefixes:

    text_encoder.text_model.encoder.layers.N.<m>.lora_A.weight / .lora_B.weight     CLIP ViT-L
    text_encoder_2.text_model.encoder.layers.N.<m>.lora_A.weight / .lora_B.weight   OpenCLIP bigG
    <m>: self_attn.q_proj | k_proj | v_proj | out_proj, mlp.fc1 | fc2

In kohya's file under kohya's SDXL text-encoder prefixes, the transformers module path with dots as underscores:

    lora_te1_text_model_encoder_layers_N_<m with _>.lora_down.weight / .lora_up.weight / .alpha   (CLIP ViT-L)
    lora_te2_text_model_encoder_layers_N_<m with _>.lora_down.weight / .lora_up.weight / .alpha   (bigG)

ComfyUI's model_lora_keys_clip (comfy/lora.py) maps, for layer b and each c of LORA_CLIP_MAP {mlp.fc1: mlp_fc1,
mlp.fc2: mlp_fc2, self_attn.k_proj: self_attn_k_proj, q_proj, v_proj, out_proj likewise}, when its model holds
clip_l.transformer.text_model.encoder.layers.b.c.weight: `lora_te1_text_model_encoder_layers_b_<LORA_CLIP_MAP[c]>`
to that weight (the SDXL base's CLIP-L), and then, with clip_l present, `lora_te2_text_model_encoder_layers_b_...`
to clip_g.transformer.text_model.encoder.layers.b.c.weight. bigG's text_projection has no LoRA key there, so it
is not a target.

lora.type (every type is written where its loader applies it as trained; rules.py refuses the other file):

- lora: the layouts above, both files;
- dora: the diffusers file only, with each module's `lora_magnitude_vector` (peft's DoRA, which load_lora_weights
  rebuilds from the metadata's use_dora); ComfyUI applies a DoRA magnitude by its own weight-norm convention;
- lokr / loha: kohya's file only, under the same kohya keys, LyCORIS tensors (`<key>.lokr_w1`, `.lokr_w2`,
  `.lokr_w2_a/_b`, ... or `<key>.hada_w1_a`, `.hada_w1_b`, `.hada_w2_a`, `.hada_w2_b`, and `<key>.alpha`), which
  ComfyUI's load_lora reads for every key its maps name (scales: engine/families/image/export.py's
  lycoris_state_dict); diffusers reads neither type.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

from engine.families.image.export import DIFFUSERS_FILE, cpu_f32, lycoris_state_dict, metadata, save
from engine.families.image.sdxl.text import file_path, parts

KOHYA_FILE = "sdxl_lora_comfyui.safetensors"
TE_PREFIX = {"text_encoder": "lora_te1_", "text_encoder_2": "lora_te2_"}  # kohya's SDXL text-encoder keys
_RESNET = {"conv1": "in_layers.2", "time_emb_proj": "emb_layers.1", "conv2": "out_layers.3",
           "conv_shortcut": "skip_connection"}
_TOP = {"conv_in": "input_blocks.0.0", "conv_out": "out.2", "time_embedding.linear_1": "time_embed.0",
        "time_embedding.linear_2": "time_embed.2", "add_embedding.linear_1": "label_emb.0.0",
        "add_embedding.linear_2": "label_emb.0.2"}


def sgm_name(module: str, config: dict[str, Any]) -> str:
    """The original SDXL (SGM) UNet's name of a diffusers UNet2DConditionModel module, by the table above.

    config: the UNet's config (layers_per_block: L, an int or one per level; up_block_types)."""
    per = config["layers_per_block"]
    levels = len(config["down_block_types"])
    layers = list(per) if isinstance(per, (list, tuple)) else [per] * levels
    if module in _TOP:
        return _TOP[module]
    if m := re.fullmatch(r"down_blocks\.(\d+)\.(resnets|attentions)\.(\d+)\.(.+)", module):
        x, kind, i, rest = int(m[1]), m[2], int(m[3]), m[4]
        n = 1 + sum(layers[j] + 1 for j in range(x)) + i
        return f"input_blocks.{n}.0.{_resnet(rest)}" if kind == "resnets" else f"input_blocks.{n}.1.{rest}"
    if m := re.fullmatch(r"down_blocks\.(\d+)\.downsamplers\.0\.conv", module):
        return f"input_blocks.{sum(layers[j] + 1 for j in range(int(m[1]) + 1))}.0.op"
    if m := re.fullmatch(r"mid_block\.resnets\.([01])\.(.+)", module):
        return f"middle_block.{2 * int(m[1])}.{_resnet(m[2])}"
    if m := re.fullmatch(r"mid_block\.attentions\.0\.(.+)", module):
        return f"middle_block.1.{m[1]}"
    up_layers = list(reversed(layers))
    if m := re.fullmatch(r"up_blocks\.(\d+)\.(resnets|attentions)\.(\d+)\.(.+)", module):
        x, kind, i, rest = int(m[1]), m[2], int(m[3]), m[4]
        n = sum(up_layers[j] + 1 for j in range(x)) + i
        return f"output_blocks.{n}.0.{_resnet(rest)}" if kind == "resnets" else f"output_blocks.{n}.1.{rest}"
    if m := re.fullmatch(r"up_blocks\.(\d+)\.upsamplers\.0\.conv", module):
        x = int(m[1])
        n = sum(up_layers[j] + 1 for j in range(x)) + up_layers[x]
        attn = config["up_block_types"][x].startswith("CrossAttn")
        return f"output_blocks.{n}.{2 if attn else 1}.conv"
    raise ValueError(f"no SDXL (SGM) name for UNet module {module!r}")


def _resnet(rest: str) -> str:
    if rest not in _RESNET:
        raise ValueError(f"no SDXL (SGM) name for resnet module {rest!r}")
    return _RESNET[rest]


def kohya_key(module: str, config: dict[str, Any]) -> str:
    """lora_unet_<SGM name, dots as underscores>: the key kohya writes and ComfyUI, A1111 and Forge map."""
    return "lora_unet_" + sgm_name(module, config).replace(".", "_")


def lora_factors(unet: torch.nn.Module) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Diffusers module path -> (A, B) of every LoRA layer (linear or conv), on the CPU in float32."""
    return {name: (cpu_f32(mod.lora_A["default"].weight), cpu_f32(mod.lora_B["default"].weight))
            for name, mod in unet.named_modules()
            if hasattr(mod, "lora_A") and "default" in getattr(mod, "lora_A", {})}


def diffusers_file(model: torch.nn.Module, out_dir: Path, md: dict[str, str]) -> str:
    """pytorch_lora_weights.safetensors under `unet.` (and `text_encoder.`, `text_encoder_2.`) with alpha / r
    folded into lora_B (the docstring above)."""
    from diffusers.loaders.lora_base import LORA_ADAPTER_METADATA_KEY
    from peft.utils import get_peft_model_state_dict

    sd, confs = {}, {}
    for prefix, net in parts(model).items():
        conf = net.peft_config["default"].to_dict()
        scale = conf["lora_alpha"] / conf["r"]
        for k, v in get_peft_model_state_dict(net, adapter_name="default").items():
            if prefix != "unet":
                # transformers' load_adapter (which diffusers loads the encoders with) names DoRA's magnitude
                # <module>.lora_magnitude_vector.weight; peft's state dict leaves the .weight off
                k = file_path(k) + (".weight" if k.endswith(".lora_magnitude_vector") else "")
            sd[f"{prefix}.{k}"] = cpu_f32(v) * scale if k.endswith(".lora_B.weight") else cpu_f32(v)
        # Dropout is a training setting: the loaded adapter would drop activations at inference (pipelines never
        # eval()).
        conf.update(lora_alpha=conf["r"], lora_dropout=0.0)
        confs.update({f"{prefix}.{k}": sorted(v) if isinstance(v, set) else v for k, v in conf.items()})
    md = {**md, LORA_ADAPTER_METADATA_KEY: json.dumps(confs, indent=2, sort_keys=True), "lorad_alpha_folded": "true"}
    return save(sd, Path(out_dir) / DIFFUSERS_FILE, md)


def kohya_names(model: torch.nn.Module) -> list[tuple[torch.nn.Module, Any]]:
    """(network, its module path -> kohya key) for the UNet and, when they train, both text encoders."""
    config = dict(parts(model)["unet"].config)
    out = []
    for part, net in parts(model).items():
        if part == "unet":
            out.append((net, lambda name: kohya_key(name, config)))
        else:
            out.append((net, lambda name, p=TE_PREFIX[part]: p + file_path(name).replace(".", "_")))
    return out


def kohya_file(model: torch.nn.Module, cfg, out_dir: Path, md: dict[str, str]) -> str:
    """sdxl_lora_comfyui.safetensors: lora_down / lora_up / alpha (LyCORIS tensors for lokr / loha) under kohya's
    SGM and text-encoder names (the docstring above)."""
    sd = {}
    for net, key_of in kohya_names(model):
        if cfg.lora.type in ("lokr", "loha"):
            sd.update(lycoris_state_dict(net, key_of))
            continue
        for name, (a, b) in lora_factors(net).items():
            key = key_of(name)
            sd[f"{key}.lora_down.weight"], sd[f"{key}.lora_up.weight"] = a, b
            sd[f"{key}.alpha"] = torch.tensor(float(cfg.lora.alpha))
    kohya = {"ss_network_module": "networks.lora", "ss_network_dim": str(cfg.lora.rank),
             "ss_network_alpha": str(cfg.lora.alpha), "ss_base_model_version": "sdxl_base_v1-0",
             "ss_network_train_unet_only": str(not cfg.lora.text_encoder),
             "ss_v_parameterization": str(md.get("lorad_prediction") == "v")}
    if cfg.lora.type in ("lokr", "loha"):
        kohya.update(ss_network_module="lycoris.kohya", ss_network_args=json.dumps({"algo": cfg.lora.type}))
    return save(sd, Path(out_dir) / KOHYA_FILE, {**md, **kohya})


def export(model: torch.nn.Module, cfg, out_dir: Path, meta: dict[str, Any], prediction: str) -> list[str]:
    """The files output.formats names: diffusers' and kohya's (written for `comfyui`)."""
    md = {**metadata(cfg, meta), "lorad_prediction": prediction}
    names = []
    if "diffusers" in cfg.output.formats:
        names.append(diffusers_file(model, out_dir, md))
    if "comfyui" in cfg.output.formats:
        names.append(kohya_file(model, cfg, out_dir, md))
    return names
