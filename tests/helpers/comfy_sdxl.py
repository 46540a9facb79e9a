"""ComfyUI's SDXL LoRA key rules, restated from its sources to check lorad's kohya files against them:
comfy/utils.py's unet_to_diffusers and comfy/lora.py's model_lora_keys_unet (the UNet), and comfy/lora.py's
model_lora_keys_clip (the two text encoders)."""

from __future__ import annotations

RESNET = {"in_layers.2": "conv1", "emb_layers.1": "time_emb_proj", "out_layers.3": "conv2",
          "skip_connection": "conv_shortcut"}
ATTN = ["proj_in", "proj_out"]
BLOCK = [f"attn{i}.{p}" for i in (1, 2) for p in ("to_q", "to_k", "to_v", "to_out.0")] + ["ff.net.0.proj", "ff.net.2"]
BASIC = {"input_blocks.0.0": "conv_in", "out.2": "conv_out", "time_embed.0": "time_embedding.linear_1",
         "time_embed.2": "time_embedding.linear_2", "label_emb.0.0": "add_embedding.linear_1",
         "label_emb.0.2": "add_embedding.linear_2"}


def comfy_unet_config(config: dict) -> dict:
    """ComfyUI's unet_config of a diffusers UNet (what comfy/model_detection.py reads from the SGM weights):
    res blocks per level, transformer depth per input res block, per output block listed from the last output
    block to the first, and the middle's."""
    levels = len(config["down_block_types"])
    per = config["transformer_layers_per_block"]
    per = list(per) if isinstance(per, (list, tuple)) else [per] * levels
    n = config["layers_per_block"]
    depth = [per[x] if config["down_block_types"][x].startswith("CrossAttn") else 0 for x in range(levels)]
    out_depth = [d for d in reversed(depth) for _ in range(n + 1)]  # output blocks in order: deepest level first
    return {"num_res_blocks": [n] * levels, "transformer_depth": [d for d in depth for _ in range(n)],
            "transformer_depth_output": list(reversed(out_depth)), "transformer_depth_middle": per[-1]}


def comfy_unet_to_diffusers(uc: dict) -> dict[str, str]:
    """diffusers module -> SGM module, by comfy/utils.py's unet_to_diffusers (weights' '.weight' dropped)."""
    out: dict[str, str] = {}
    nrb, depth, depth_out = uc["num_res_blocks"], list(uc["transformer_depth"]), list(uc["transformer_depth_output"])
    for x in range(len(nrb)):
        n = 1 + (nrb[x] + 1) * x
        for i in range(nrb[x]):
            out.update({f"down_blocks.{x}.resnets.{i}.{d}": f"input_blocks.{n}.0.{s}" for s, d in RESNET.items()})
            t = depth.pop(0)
            if t > 0:
                out.update({f"down_blocks.{x}.attentions.{i}.{b}": f"input_blocks.{n}.1.{b}" for b in ATTN})
                out.update({f"down_blocks.{x}.attentions.{i}.transformer_blocks.{k}.{b}":
                            f"input_blocks.{n}.1.transformer_blocks.{k}.{b}" for k in range(t) for b in BLOCK})
            n += 1
        out[f"down_blocks.{x}.downsamplers.0.conv"] = f"input_blocks.{n}.0.op"
    out.update({f"mid_block.attentions.0.{b}": f"middle_block.1.{b}" for b in ATTN})
    out.update({f"mid_block.attentions.0.transformer_blocks.{k}.{b}": f"middle_block.1.transformer_blocks.{k}.{b}"
                for k in range(uc["transformer_depth_middle"]) for b in BLOCK})
    for i, n in enumerate([0, 2]):
        out.update({f"mid_block.resnets.{i}.{d}": f"middle_block.{n}.{s}" for s, d in RESNET.items()})
    rev = list(reversed(nrb))
    for x in range(len(rev)):
        n, count = (rev[x] + 1) * x, rev[x] + 1
        for i in range(count):
            out.update({f"up_blocks.{x}.resnets.{i}.{d}": f"output_blocks.{n}.0.{s}" for s, d in RESNET.items()})
            c = 1
            t = depth_out.pop()
            if t > 0:
                c += 1
                out.update({f"up_blocks.{x}.attentions.{i}.{b}": f"output_blocks.{n}.1.{b}" for b in ATTN})
                out.update({f"up_blocks.{x}.attentions.{i}.transformer_blocks.{k}.{b}":
                            f"output_blocks.{n}.1.transformer_blocks.{k}.{b}" for k in range(t) for b in BLOCK})
            if i == count - 1:
                out[f"up_blocks.{x}.upsamplers.0.conv"] = f"output_blocks.{n}.{c}.conv"
            n += 1
    out.update({d: s for s, d in BASIC.items()})
    return out


def comfy_key_map(config: dict) -> dict[str, str]:
    """comfy/lora.py's model_lora_keys_unet: lora_unet_<SGM name with _> (and <diffusers name with _>) ->
    the model weight diffusion_model.<SGM name>.weight."""
    keys = {}
    for diff, sgm in comfy_unet_to_diffusers(comfy_unet_config(config)).items():
        keys["lora_unet_" + sgm.replace(".", "_")] = f"diffusion_model.{sgm}.weight"
        keys["lora_unet_" + diff.replace(".", "_")] = f"diffusion_model.{sgm}.weight"
    return keys


LORA_CLIP_MAP = {"mlp.fc1": "mlp_fc1", "mlp.fc2": "mlp_fc2", "self_attn.k_proj": "self_attn_k_proj",
                 "self_attn.q_proj": "self_attn_q_proj", "self_attn.v_proj": "self_attn_v_proj",
                 "self_attn.out_proj": "self_attn_out_proj"}


def comfy_clip_key_map(sdk: set[str]) -> dict[str, str]:
    """comfy/lora.py's model_lora_keys_clip for SDXL's two encoders (sdk: ComfyUI's CLIP weights, clip_l.transformer.
    and clip_g.transformer. before the transformers names): lora_te1_ keys to CLIP-L's layers, then lora_te2_ keys to
    bigG's once CLIP-L is present."""
    keys, clip_l_present = {}, False
    for b in range(32):
        for c, k_c in LORA_CLIP_MAP.items():
            k = f"clip_l.transformer.text_model.encoder.layers.{b}.{c}.weight"
            if k in sdk:
                keys[f"lora_te1_text_model_encoder_layers_{b}_{k_c}"] = k
                clip_l_present = True
            k = f"clip_g.transformer.text_model.encoder.layers.{b}.{c}.weight"
            if k in sdk and clip_l_present:
                keys[f"lora_te2_text_model_encoder_layers_{b}_{k_c}"] = k
    return keys
