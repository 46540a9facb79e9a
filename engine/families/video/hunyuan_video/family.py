"""HunyuanVideo 1.5 LoRA: diffusers `HunyuanVideo15Transformer3DModel`, trained by flow matching on cached clip
windows (engine/families/video/base.py), through diffusers' `HunyuanVideo15Pipeline` and its components.

What is HunyuanVideo 1.5's own:

- Latents: `AutoencoderKLHunyuanVideo15` (16x spatial, 4x temporal) encodes [1, 3, F, H, W]; the posterior mode is
  multiplied by the VAE's `scaling_factor`, as `HunyuanVideo15ImageToVideoPipeline._get_image_latents` does (and
  the pipelines divide by before decoding).
- Input: text-to-video, as `HunyuanVideo15Pipeline.__call__` builds it: the noisy latents, then a zero condition
  latent and a zero mask channel (`prepare_cond_latents_and_mask`), and zero image embeddings (the transformer
  drops them for t2v). The transformer takes t = σ · 1000, the scheduler's timesteps. Image-to-video needs the
  SigLIP image encoder's embeddings and a conditioning latent; it is left out.
- Text: two encoders, through the pipeline's own helpers: Qwen2.5-VL's hidden states of the caption inside the
  pipeline's chat template (`_get_mllm_prompt_embeds`: its first 108 template tokens cropped, up to 1000 caption
  tokens) and ByT5's of any quoted text in the caption (`_get_byt5_prompt_embeds`, the glyph branch; none: no
  tokens). Each is cached at its real length and padded per batch with its mask (`encoder_attention_mask`,
  `encoder_attention_mask_2`), which the transformer reads.
- LoRA targets: the double-stream blocks' attention (image and text q/k/v/out) and both MLPs.
- Export: the diffusers file (engine/families/image/export.py) and `hunyuan_video15_lora_comfyui.safetensors` in
  the names of ComfyUI's HunyuanVideo model (comfy/ldm/hunyuan_video/model.py: `double_blocks` of comfy/ldm/flux/
  layers.py's DoubleStreamBlock, whose image and text attention each hold one fused `qkv` linear):

      diffusion_model.double_blocks.N.img_attn.qkv   ← transformer_blocks.N.attn.to_q + to_k + to_v (fused)
      diffusion_model.double_blocks.N.img_attn.proj  ← transformer_blocks.N.attn.to_out.0
      diffusion_model.double_blocks.N.txt_attn.qkv   ← transformer_blocks.N.attn.add_q_proj + add_k_proj + add_v_proj
      diffusion_model.double_blocks.N.txt_attn.proj  ← transformer_blocks.N.attn.to_add_out
      diffusion_model.double_blocks.N.img_mlp.0 | .2 ← transformer_blocks.N.ff.net.0.proj | ff.net.2
      diffusion_model.double_blocks.N.txt_mlp.0 | .2 ← transformer_blocks.N.ff_context.net.0.proj | ff_context.net.2
      each with .lora_A.weight [r, in], .lora_B.weight [out, r] and .alpha (lora.alpha)

  How ComfyUI reads it (comfy/lora.py): `model_lora_keys_unet` maps `diffusion_model.<name>` to the model weight
  `diffusion_model.<name>.weight` for every weight the model has (its generic rule, no per-model table), and
  `load_lora` takes `<key>.lora_B.weight` as the up and `<key>.lora_A.weight` as the down, with the update
  (alpha / rows of the down) · up @ down. A fused qkv gets the three parts' downs stacked ([3r, in]) and their ups
  block-diagonal ([3·out, 3r], q's rows first, as the fused weight holds them), with .alpha = 3 · lora.alpha, so
  that its update is exactly the three trained updates one above the other (a part not trained contributes zero
  rows). FLUX.2's ComfyUI file fuses the same way (engine/families/image/export.py: comfyui_state_dict). A module
  outside these rules has no name in ComfyUI's model and is refused before training (lora.targets).
  diffusers 0.42's HunyuanVideo15Pipeline has no load_lora_weights; its transformer's load_lora_adapter reads the
  diffusers file. The fused q/k/v layout of ComfyUI's HunyuanVideo 1.5 model itself is as the issue (41) reports
  it and as third-party converters write it; this tree holds no ComfyUI to load the file into (unverified there).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from engine.config.job import JobConfig
from engine.errors import JobInvalid
from engine.families.image.export import bfl_target, comfyui_state_dict, lora_modules, output_files, save
from engine.families.image.flow_lora import load_lora_transformer, sample_sigmas

DEFAULT_TARGETS = (r"^transformer_blocks\.\d+\.(attn\.(to_q|to_k|to_v|to_out\.0|add_q_proj|add_k_proj|add_v_proj"
                   r"|to_add_out)|ff\.net\.(0\.proj|2)|ff_context\.net\.(0\.proj|2))$")
FP8_SKIP = r"^(x_embedder|image_embedder|context_embedder|context_embedder_2|time_embed|norm_out|proj_out)(\.|$)"
COMFYUI_FILE = "hunyuan_video15_lora_comfyui.safetensors"
GLYPH_LEN = 256  # the pipeline's tokenizer_2_max_length

_QKV = ("attn.to_q", "attn.to_k", "attn.to_v")
_TXT_QKV = ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj")
# The key rules of the module docstring: diffusers sub-path of transformer_blocks.N -> (ComfyUI name, fused parts).
COMFY_RULES = {"transformer_blocks": {
    **{p: ("double_blocks.{i}.img_attn.qkv", _QKV) for p in _QKV},
    **{p: ("double_blocks.{i}.txt_attn.qkv", _TXT_QKV) for p in _TXT_QKV},
    "attn.to_out.0": ("double_blocks.{i}.img_attn.proj", None),
    "attn.to_add_out": ("double_blocks.{i}.txt_attn.proj", None),
    "ff.net.0.proj": ("double_blocks.{i}.img_mlp.0", None),
    "ff.net.2": ("double_blocks.{i}.img_mlp.2", None),
    "ff_context.net.0.proj": ("double_blocks.{i}.txt_mlp.0", None),
    "ff_context.net.2": ("double_blocks.{i}.txt_mlp.2", None),
}, "single_transformer_blocks": {}}


def comfyui_name(module: str) -> tuple[str, tuple[str, ...] | None]:
    """(ComfyUI module name, the diffusers sub-paths fused into it in row order, or None) of a diffusers module."""
    return bfl_target(module, COMFY_RULES, {})


def comfyui_file(model: torch.nn.Module, cfg: JobConfig, out_dir: Path, md: dict[str, str]) -> str:
    sd = comfyui_state_dict(model, lora_modules(model), cfg.lora.rank, cfg.lora.alpha, target=comfyui_name,
                            swap_halves=set(), key=lambda name: f"diffusion_model.{name}",
                            suffixes=("lora_A.weight", "lora_B.weight"))
    kohya = {"ss_network_dim": str(cfg.lora.rank), "ss_network_alpha": str(cfg.lora.alpha),
             "ss_base_model_version": "hunyuan_video15"}
    return save(sd, Path(out_dir) / COMFYUI_FILE, {**md, **kohya})


class HunyuanVideo15Model:
    """The HunyuanVideo 1.5 half of a VideoFamily (see the module docstring)."""

    name = "hunyuan_video"
    default_targets = DEFAULT_TARGETS
    fp8_skip = FP8_SKIP

    def transformer_class(self) -> type:
        from diffusers import HunyuanVideo15Transformer3DModel

        return HunyuanVideo15Transformer3DModel

    def text_max_len(self, model_path: str, revision: str | None) -> int:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model_path, subfolder="tokenizer", revision=revision)
        # The pipeline pads to 1000 + its 108 template tokens; a tokenizer with a lower limit (the tiny one) caps it.
        return int(min(1000, (getattr(tok, "model_max_length", 1108) or 1108) - 108))

    def encode_latents(self, pipe, pixels: torch.Tensor) -> torch.Tensor:
        from diffusers.pipelines.hunyuan_video1_5.pipeline_hunyuan_video1_5_image2video import (
            retrieve_latents,
        )

        return (retrieve_latents(pipe.vae.encode(pixels), sample_mode="argmax") * pipe.vae.config.scaling_factor)[0]

    def encode_text(self, pipe, text: str, max_len: int, device: torch.device) -> dict[str, torch.Tensor]:
        embeds, mask = pipe._get_mllm_prompt_embeds(
            pipe.text_encoder, pipe.tokenizer, text, device, tokenizer_max_length=max_len,
            system_message=pipe.system_message, crop_start=pipe.prompt_template_encode_start_idx)
        glyph, glyph_mask = pipe._get_byt5_prompt_embeds(pipe.tokenizer_2, pipe.text_encoder_2, text, device,
                                                         tokenizer_max_length=GLYPH_LEN)
        return {"prompt_embeds": embeds[0][mask[0].bool()], "prompt_embeds_2": glyph[0][glyph_mask[0].bool()]}

    def load_pipeline(self, model_path: str, revision: str | None, dtype: torch.dtype, keep: tuple[str, ...]):
        """The pipeline with only the `keep` components (the cache's encoders: dataset.PipelineEncoder). Its
        __init__ reads the VAE's config, so a text-only pipeline gets a weightless VAE (meta tensors)."""
        from accelerate import init_empty_weights
        from diffusers import AutoencoderKLHunyuanVideo15, DiffusionPipeline

        from engine.families.image.dataset import pipeline_components

        names = pipeline_components(DiffusionPipeline.load_config(model_path, revision=revision))
        drop: dict[str, Any] = {k: None for k in names if not k.startswith(("scheduler", "guider", *keep))}
        if "vae" in drop:
            with init_empty_weights():
                drop["vae"] = AutoencoderKLHunyuanVideo15.from_config(
                    AutoencoderKLHunyuanVideo15.load_config(model_path, subfolder="vae", revision=revision))
        return DiffusionPipeline.from_pretrained(model_path, revision=revision, dtype=dtype, **drop)

    # ---------------------------------------------------------------- the transformer
    def load(self, path: str, cfg: JobConfig, device: torch.device, log) -> torch.nn.Module:
        model = load_lora_transformer(self.transformer_class(), path, cfg, device, log, fp8_skip=FP8_SKIP,
                                      default_targets=DEFAULT_TARGETS)
        if "comfyui" in cfg.output.formats:  # refused now, not when the finished LoRA is exported
            for name, mod in model.named_modules():
                if "default" in getattr(mod, "lora_A", {}):  # a LoRA layer, as export.lora_modules finds them
                    try:
                        comfyui_name(name)
                    except ValueError:
                        raise JobInvalid(f"lora.targets: {name} has no name in "
                                         "ComfyUI's HunyuanVideo 1.5 model (its file takes the attention and MLP "
                                         "linears of the double blocks); leave it out or write output.formats: "
                                         "[diffusers]") from None
        return model

    def sigmas(self, cfg: JobConfig, sched: dict[str, Any], batch: int, generator: torch.Generator) -> torch.Tensor:
        shift = float(sched.get("shift", 1.0)) if cfg.train.timestep_sampling == "shift" else 1.0
        return sample_sigmas(cfg.train.timestep_sampling, batch, shift, generator, cfg.train.timestep_bias)

    def condition(self, x_t: torch.Tensor, x0: torch.Tensor, cfg: JobConfig):
        return x_t, None

    def predict(self, model, x_t: torch.Tensor, sigma: torch.Tensor, text: dict[str, torch.Tensor],
                cfg: JobConfig) -> torch.Tensor:
        inner = getattr(model, "module", model)
        dtype, device = inner.dtype, x_t.device
        b, _c, f, h, w = x_t.shape
        zeros = x_t.new_zeros(b, inner.config.in_channels - x_t.shape[1], f, h, w)  # t2v: no condition, no mask
        image = x_t.new_zeros(b, 729, inner.config.image_embed_dim)  # the pipeline's vision_num_semantic_tokens
        return model(hidden_states=torch.cat([x_t, zeros], dim=1).to(dtype), timestep=(sigma * 1000.0).to(dtype),
                     encoder_hidden_states=text["prompt_embeds"].to(device, dtype),
                     encoder_attention_mask=text["prompt_mask"].to(device),
                     encoder_hidden_states_2=text["prompt_embeds_2"].to(device, dtype),
                     encoder_attention_mask_2=text["prompt_mask_2"].to(device), image_embeds=image.to(dtype),
                     return_dict=False)[0]

    # ---------------------------------------------------------------- samples and export
    def sample_pipeline(self, model_path: str, cfg: JobConfig, model):
        from diffusers import ClassifierFreeGuidance, HunyuanVideo15Pipeline

        from engine.training.dtypes import torch_dtype

        pipe = HunyuanVideo15Pipeline.from_pretrained(
            model_path, revision=cfg.model.revision, text_encoder=None, tokenizer=None, text_encoder_2=None,
            tokenizer_2=None, transformer=model, dtype=torch_dtype(cfg.model.dtype),
            guider=ClassifierFreeGuidance(guidance_scale=cfg.sample.guidance))
        pipe.vae.to(model.device)
        return pipe

    def sample_kwargs(self, emb, negative, device, dtype, cfg: JobConfig) -> dict[str, Any]:
        out = {}
        for prefix, e in (("", emb), ("negative_", negative)):
            for name in ("prompt_embeds", "prompt_embeds_2"):
                t = e[name] if e[name].shape[0] else e[name].new_zeros(1, e[name].shape[1])
                out[prefix + name] = t[None].to(device, dtype)
                mask = name.replace("prompt_embeds", "prompt_embeds_mask")
                out[prefix + mask] = torch.full((1, t.shape[0]), int(e[name].shape[0] > 0), device=device)
        return out

    def export(self, model, cfg: JobConfig, out_dir: Path, meta: dict[str, Any]) -> list[str]:
        return output_files(model, cfg, out_dir, meta, lambda md: comfyui_file(model, cfg, out_dir, md))


def HunyuanVideo():  # noqa: N802 - reads as the family's class at get_family's call site
    from engine.families.video.base import VideoFamily

    return VideoFamily(HunyuanVideo15Model())
