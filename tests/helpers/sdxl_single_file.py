"""A diffusers SDXL directory written as one original-layout (SGM/ldm) checkpoint file, what SDXL fine-tunes ship as,
so that tests can train from a single file offline. The key rules, the inverse of diffusers' single-file converters
(diffusers/loaders/single_file_utils.py: convert_ldm_unet_checkpoint, convert_ldm_vae_checkpoint,
convert_ldm_clip_checkpoint, convert_open_clip_checkpoint):

    model.diffusion_model.<SGM UNet name>            the UNet (engine/families/image/sdxl/export.py's sgm_name, with
                                                     the resnets' norm1 -> in_layers.0, norm2 -> out_layers.0 and
                                                     conv_norm_out -> out.0)
    first_stage_model.<ldm VAE name>                 encoder.down.i.block.j, .downsample.conv, mid.block_1/2,
                                                     mid.attn_1.norm/q/k/v/proj_out (1x1 convs), decoder.up.(n-1-i)...,
                                                     nin_shortcut, norm_out
    conditioner.embedders.0.transformer.<name>       CLIP ViT-L as transformers names it, under text_model.
    conditioner.embedders.1.model.<open_clip name>   bigG: transformer.resblocks.i.{ln_1, ln_2, attn.in_proj_weight
                                                     (q, k, v stacked), attn.out_proj, mlp.c_fc, mlp.c_proj},
                                                     token_embedding, positional_embedding, ln_final,
                                                     text_projection (transposed)
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from engine.families.image.sdxl.export import sgm_name

_NORMS = {"norm1": "in_layers.0", "norm2": "out_layers.0"}
_VAE_RES = {"conv_shortcut": "nin_shortcut"}
_VAE_ATTN = {"group_norm": "norm", "to_q": "q", "to_k": "k", "to_v": "v", "to_out.0": "proj_out"}


def _weights(model_dir: Path, sub: str) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted((model_dir / sub).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def unet_key(name: str, config: dict) -> str:
    module, leaf = name.rsplit(".", 1)
    if module == "conv_norm_out":
        return f"out.0.{leaf}"
    if m := re.fullmatch(r"(.*resnets\.\d+)\.(norm1|norm2)", module):
        block = sgm_name(f"{m[1]}.conv1", config).removesuffix(".in_layers.2")
        return f"{block}.{_NORMS[m[2]]}.{leaf}"
    return f"{sgm_name(module, config)}.{leaf}"


def vae_key(name: str, levels: int) -> str:
    side, rest = name.split(".", 1)
    rest = re.sub(r"^conv_norm_out\.", "norm_out.", rest)
    if m := re.fullmatch(r"(down|up)_blocks\.(\d+)\.resnets\.(\d+)\.(\w+)\.(\w+)", rest):
        i = int(m[2]) if m[1] == "down" else levels - 1 - int(m[2])
        rest = f"{m[1]}.{i}.block.{m[3]}.{_VAE_RES.get(m[4], m[4])}.{m[5]}"
    elif m := re.fullmatch(r"down_blocks\.(\d+)\.downsamplers\.0\.conv\.(\w+)", rest):
        rest = f"down.{m[1]}.downsample.conv.{m[2]}"
    elif m := re.fullmatch(r"up_blocks\.(\d+)\.upsamplers\.0\.conv\.(\w+)", rest):
        rest = f"up.{levels - 1 - int(m[1])}.upsample.conv.{m[2]}"
    elif m := re.fullmatch(r"mid_block\.resnets\.(\d)\.(.+)", rest):
        rest = f"mid.block_{int(m[1]) + 1}.{m[2]}"
    elif m := re.fullmatch(r"mid_block\.attentions\.0\.(.+)\.(\w+)", rest):
        rest = f"mid.attn_1.{_VAE_ATTN[m[1]]}.{m[2]}"
    return f"{side}.{rest}"


def open_clip(te2: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """bigG's transformers weights under open_clip's names."""
    sd = {k.removeprefix("text_model."): v for k, v in te2.items()}
    out = {"token_embedding.weight": sd.pop("embeddings.token_embedding.weight"),
           "positional_embedding": sd.pop("embeddings.position_embedding.weight"),
           "ln_final.weight": sd.pop("final_layer_norm.weight"), "ln_final.bias": sd.pop("final_layer_norm.bias"),
           "text_projection": sd.pop("text_projection.weight").T.contiguous()}
    layers = {int(k.split(".")[2]) for k in sd if k.startswith("encoder.layers.")}
    for i in layers:
        p = f"encoder.layers.{i}."
        r = f"transformer.resblocks.{i}."
        for kind in ("weight", "bias"):
            out[r + f"attn.in_proj_{kind}"] = torch.cat([sd.pop(p + f"self_attn.{x}_proj.{kind}") for x in "qkv"])
            for src, dst in (("self_attn.out_proj", "attn.out_proj"), ("layer_norm1", "ln_1"), ("layer_norm2", "ln_2"),
                             ("mlp.fc1", "mlp.c_fc"), ("mlp.fc2", "mlp.c_proj")):
                out[r + f"{dst}.{kind}"] = sd.pop(p + f"{src}.{kind}")
    assert not sd, f"bigG weights with no open_clip name: {sorted(sd)}"
    return out


def write_single_file(model_dir: Path, dest: Path) -> Path:
    """The SDXL diffusers directory `model_dir` as one original-layout .safetensors checkpoint at `dest`."""
    import json

    model_dir = Path(model_dir)
    config = json.loads((model_dir / "unet" / "config.json").read_text())
    levels = len(json.loads((model_dir / "vae" / "config.json").read_text())["down_block_types"])
    sd = {f"model.diffusion_model.{unet_key(k, config)}": v for k, v in _weights(model_dir, "unet").items()}
    for k, v in _weights(model_dir, "vae").items():
        if re.search(r"attentions\.0\.(to_[qkv]|to_out\.0)\.weight$", k):
            v = v[:, :, None, None]  # the original's attention projections are 1x1 convolutions
        sd[f"first_stage_model.{vae_key(k, levels)}"] = v
    te1 = _weights(model_dir, "text_encoder")
    sd.update({f"conditioner.embedders.0.transformer.text_model.{k.removeprefix('text_model.')}": v
               for k, v in te1.items()})
    sd.update({f"conditioner.embedders.1.model.{k}": v for k, v in open_clip(_weights(model_dir, "text_encoder_2")).items()})
    save_file({k: v.contiguous() for k, v in sd.items()}, str(dest))
    return Path(dest)
