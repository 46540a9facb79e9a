"""FLUX.2 (dev and klein) LoRA: diffusers `Flux2Transformer2DModel`, trained by flow matching (engine/families/image/base.py).

What is FLUX.2's own, all through diffusers' classes (`Flux2Pipeline` for dev,
`Flux2KleinPipeline` for klein — whichever the directory's model_index.json
names):

- Latents: the VAE (`AutoencoderKLFlux2`, 32 channels) posterior mode is cut
  into 2×2 patches (128 channels at 1/16 of the image size) and normalised
  with the VAE's batch-norm running statistics — the pipeline's own
  `_encode_vae_image`, so training sees exactly what inference decodes.
- Tokens: `_pack_latents` flattens [B, 128, h, w] to [B, h·w, 128]; every
  image token has a 4-D position id (t, row, col, l) from
  `_prepare_latent_ids`, every text token (0, 0, 0, i) from
  `_prepare_text_ids`.
- Text: the pipeline's `encode_prompt` — dev stacks hidden states 10, 20, 30
  of Mistral-Small-3 (3 × 5120 = 15360 wide), klein 9, 18, 27 of Qwen3 —
  padded to a fixed length (512), with no attention mask, as at inference.
- Timesteps: `shift` moves uniform t by the exponential time shift with the
  μ the pipeline computes (`compute_empirical_mu`, for the image's token
  count at its default 50 steps). dev embeds a guidance value
  (train.guidance); klein has no guidance embedding.
- LoRA targets (DEFAULT_TARGETS): attention q/k/v/out of both streams and
  both SwiGLU feed-forwards in the double blocks, and the single blocks'
  fused `to_qkv_mlp_proj` and `to_out` — the modules diffusers' FLUX.2 loader
  and its kohya/ComfyUI converter map.
- Export: engine/families/image/export.py (the diffusers file) and the ComfyUI map
  below.

ComfyUI (`flux2_lora_comfyui.safetensors`): ComfyUI's FLUX.2 model uses BFL's
module names, and its loader maps `lora_unet_<name with dots as
underscores>` to `diffusion_model.<name>.weight` (the generic rule of
comfy/lora.py's model_lora_keys_unet), reading `<key>.lora_down.weight`,
`<key>.lora_up.weight` and `<key>.alpha` (scale alpha / rank). BFL fuses q, k,
v into one linear, so those are exported as one LoRA of rank 3r with stacked
downs and a block-diagonal up, alpha 3·alpha (engine/families/image/flux_export.py explains
why that is exact). Names (i = block index):

    transformer_blocks.i.attn.to_q | to_k | to_v          double_blocks.i.img_attn.qkv   (rows q, k, v)
    transformer_blocks.i.attn.add_q_proj | add_k | add_v  double_blocks.i.txt_attn.qkv   (rows q, k, v)
    transformer_blocks.i.attn.to_out.0 | to_add_out       double_blocks.i.img_attn.proj | txt_attn.proj
    transformer_blocks.i.ff.linear_in | linear_out        double_blocks.i.img_mlp.0 | img_mlp.2
    transformer_blocks.i.ff_context.linear_in | _out      double_blocks.i.txt_mlp.0 | txt_mlp.2
    single_transformer_blocks.i.attn.to_qkv_mlp_proj      single_blocks.i.linear1
    single_transformer_blocks.i.attn.to_out               single_blocks.i.linear2
    x_embedder | context_embedder | proj_out              img_in | txt_in | final_layer.linear
    time_guidance_embed.timestep_embedder.linear_1 | _2   time_in.in_layer | out_layer  (guidance_: guidance_in)
    double_stream_modulation_img | _txt .linear           double_stream_modulation_img | _txt .lin
    single_stream_modulation.linear                       single_stream_modulation.lin
    norm_out.linear                                       final_layer.adaLN_modulation.1 (halves swapped)

diffusers' own `_convert_kohya_flux2_lora_to_diffusers` reads the same names,
so the ComfyUI file also loads with `load_lora_weights`.

DoRA (lora.type) writes the diffusers file (peft's `lora_magnitude_vector`
keys, loaded as DoRA). LoKr and LoHa are refused (engine/config/rules.py):
ComfyUI maps FLUX.2 keys only by the fused BFL names above, and a Kronecker or
Hadamard update of q, k, v apart is no LyCORIS update of the fused linear.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch

from engine.config.job import JobConfig
from engine.families.image.export import bfl_target as bfl_name
from engine.families.image.export import comfyui_state_dict, diffusers_lora_file, lora_modules, metadata, save

DEFAULT_TARGETS = (
    r"^(transformer_blocks\.\d+\.(attn\.(to_q|to_k|to_v|to_out\.0|add_q_proj|add_k_proj|add_v_proj|to_add_out)"
    r"|ff\.(linear_in|linear_out)|ff_context\.(linear_in|linear_out))"
    r"|single_transformer_blocks\.\d+\.attn\.(to_qkv_mlp_proj|to_out))$"
)
# Kept in the model dtype under fp8: the embedders, the shared modulations and the final layers (small, run once
# per step, and they set the scale of everything else).
FP8_SKIP = (r"^(x_embedder|context_embedder|time_guidance_embed|double_stream_modulation_img"
            r"|double_stream_modulation_txt|single_stream_modulation|norm_out|proj_out)(\.|$)")
COMFYUI_FILE = "flux2_lora_comfyui.safetensors"
INFERENCE_STEPS = 50  # the pipelines' default num_inference_steps, for the shift's μ

_QKV = ("attn.to_q", "attn.to_k", "attn.to_v")
_TXT_QKV = ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj")
_BLOCK_RULES = {
    "transformer_blocks": {
        **{p: ("double_blocks.{i}.img_attn.qkv", _QKV) for p in _QKV},
        **{p: ("double_blocks.{i}.txt_attn.qkv", _TXT_QKV) for p in _TXT_QKV},
        "attn.to_out.0": ("double_blocks.{i}.img_attn.proj", None),
        "attn.to_add_out": ("double_blocks.{i}.txt_attn.proj", None),
        "ff.linear_in": ("double_blocks.{i}.img_mlp.0", None),
        "ff.linear_out": ("double_blocks.{i}.img_mlp.2", None),
        "ff_context.linear_in": ("double_blocks.{i}.txt_mlp.0", None),
        "ff_context.linear_out": ("double_blocks.{i}.txt_mlp.2", None),
    },
    "single_transformer_blocks": {
        "attn.to_qkv_mlp_proj": ("single_blocks.{i}.linear1", None),
        "attn.to_out": ("single_blocks.{i}.linear2", None),
    },
}
_TOP_RULES = {
    "x_embedder": "img_in",
    "context_embedder": "txt_in",
    "proj_out": "final_layer.linear",
    "time_guidance_embed.timestep_embedder.linear_1": "time_in.in_layer",
    "time_guidance_embed.timestep_embedder.linear_2": "time_in.out_layer",
    "time_guidance_embed.guidance_embedder.linear_1": "guidance_in.in_layer",
    "time_guidance_embed.guidance_embedder.linear_2": "guidance_in.out_layer",
    "double_stream_modulation_img.linear": "double_stream_modulation_img.lin",
    "double_stream_modulation_txt.linear": "double_stream_modulation_txt.lin",
    "single_stream_modulation.linear": "single_stream_modulation.lin",
    "norm_out.linear": "final_layer.adaLN_modulation.1",
}
SWAP_HALVES = {"final_layer.adaLN_modulation.1"}
# (BFL name, fused parts) of a FLUX.2 module: export.py's mapping with FLUX.2's rules.
bfl_target = functools.partial(bfl_name, block_rules=_BLOCK_RULES, top_rules=_TOP_RULES)


class Flux2Model:
    """The FLUX.2 half of an ImageFamily (see the module docstring)."""

    name = "flux2"
    default_targets = DEFAULT_TARGETS
    fp8_skip = FP8_SKIP

    def transformer_class(self) -> type:
        from diffusers import Flux2Transformer2DModel

        return Flux2Transformer2DModel

    def text_max_len(self, model_path: str, revision: str | None) -> int:
        """Tokens per caption: the pipeline's 512, capped by the tokenizer's own limit (the tiny one has 48)."""
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model_path, subfolder="tokenizer", revision=revision)
        tok = getattr(tok, "tokenizer", tok)  # dev's PixtralProcessor wraps its tokenizer
        return int(min(512, getattr(tok, "model_max_length", 512) or 512))

    def encode_latents(self, pipe, pixels: torch.Tensor) -> torch.Tensor:
        return pipe._encode_vae_image(pixels, generator=None)[0]

    def encode_text(self, pipe, text: str, max_len: int, device: torch.device) -> torch.Tensor:
        embeds, _text_ids = pipe.encode_prompt(text, device=device, max_sequence_length=max_len)
        return embeds[0]

    def shift_mu(self, sched: dict[str, Any], image_seq_len: int) -> float:
        from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu

        return compute_empirical_mu(image_seq_len, INFERENCE_STEPS)

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        from diffusers import Flux2Pipeline

        return Flux2Pipeline._pack_latents(x)

    def predict(self, model, inner, x_t, sigma, embeds, mask, cfg: JobConfig, controls=()) -> torch.Tensor:
        """controls: reference latents (data.control_path), one per slot, after the target's tokens; the
        prediction is the target's tokens only."""
        from diffusers import Flux2Pipeline

        from engine.families.image.edit import flux2_reference_inputs

        dtype, device, b = inner.dtype, x_t.device, x_t.shape[0]
        hidden, ids = self.pack(x_t.to(dtype)), Flux2Pipeline._prepare_latent_ids(x_t).to(device)
        if controls:
            hidden, ids = flux2_reference_inputs(hidden, ids, [c.to(device) for c in controls], dtype)
        guidance = None
        if inner.config.guidance_embeds:
            guidance = torch.full((b,), cfg.train.guidance, device=device, dtype=torch.float32)
        # FLUX.2 attends over the padded caption without a mask, at inference as here.
        return model(
            hidden_states=hidden,
            encoder_hidden_states=embeds.to(dtype),
            timestep=sigma.to(dtype),
            img_ids=ids,
            txt_ids=Flux2Pipeline._prepare_text_ids(embeds).to(device),
            guidance=guidance,
            return_dict=False,
        )[0][:, : x_t.shape[-2] * x_t.shape[-1]]

    def sample_kwargs(self, emb, negative, device, dtype, cfg: JobConfig) -> dict[str, Any]:
        # sample.guidance is dev's guidance embedding, and klein's classifier-free guidance scale against the
        # negative prompt (the empty caption by default); the sampler passes only what the pipeline takes.
        return {"prompt_embeds": emb["prompt_embeds"][None].to(device, dtype),
                "negative_prompt_embeds": negative["prompt_embeds"][None].to(device, dtype)}

    def export(self, model, cfg: JobConfig, out_dir: Path, meta: dict[str, Any]) -> list[str]:
        mods = lora_modules(model)
        md = metadata(cfg, meta)
        names = []
        if "diffusers" in cfg.output.formats:
            names.append(diffusers_lora_file(model, out_dir, md))
        if "comfyui" in cfg.output.formats:
            kohya = {"ss_network_module": "networks.lora_flux", "ss_network_dim": str(cfg.lora.rank),
                     "ss_network_alpha": str(cfg.lora.alpha), "ss_base_model_version": "flux2",
                     "ss_output_name": cfg.name}
            sd = comfyui_state_dict(model, mods, cfg.lora.rank, cfg.lora.alpha, target=bfl_target,
                                    swap_halves=SWAP_HALVES)
            names.append(save(sd, out_dir / COMFYUI_FILE, {**md, **kohya}))
        return names


def Flux2():  # noqa: N802 - reads as the family's class at get_family's call site
    from engine.families.image.base import ImageFamily

    return ImageFamily(Flux2Model())
