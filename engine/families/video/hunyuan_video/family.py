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
- Export: the diffusers file (engine/families/image/export.py) and `hunyuan_video15_lora_comfyui.safetensors`:

      diffusion_model.<diffusers module path>.lora_A.weight / .lora_B.weight / .alpha   (scale alpha / r)

  the generic layout ComfyUI's loader maps to `diffusion_model.<path>.weight` for a model that keeps diffusers'
  module names, and that diffusers' own loader reads back (it strips `diffusion_model.`). ComfyUI's native
  HunyuanVideo 1.5 model uses the original checkpoint's names; no converter for those exists in diffusers to
  check a renaming against, so this file is for loaders that take diffusers' names (ComfyUI's diffusers-format
  loading included) until one does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from engine.config.job import JobConfig
from engine.families.image.export import diffusion_model_comfyui_file, output_files
from engine.families.image.flow_lora import load_lora_transformer, sample_sigmas

DEFAULT_TARGETS = (r"^transformer_blocks\.\d+\.(attn\.(to_q|to_k|to_v|to_out\.0|add_q_proj|add_k_proj|add_v_proj"
                   r"|to_add_out)|ff\.net\.(0\.proj|2)|ff_context\.net\.(0\.proj|2))$")
FP8_SKIP = r"^(x_embedder|image_embedder|context_embedder|context_embedder_2|time_embed|norm_out|proj_out)(\.|$)"
COMFYUI_FILE = "hunyuan_video15_lora_comfyui.safetensors"
GLYPH_LEN = 256  # the pipeline's tokenizer_2_max_length


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
        return load_lora_transformer(self.transformer_class(), path, cfg, device, log, fp8_skip=FP8_SKIP,
                                     default_targets=DEFAULT_TARGETS)

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
        return output_files(model, cfg, out_dir, meta, lambda md: diffusion_model_comfyui_file(
            model, cfg, out_dir, md, COMFYUI_FILE, "hunyuan_video15"))


def HunyuanVideo():  # noqa: N802 - reads as the family's class at get_family's call site
    from engine.families.video.base import VideoFamily

    return VideoFamily(HunyuanVideo15Model())
