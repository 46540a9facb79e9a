"""Qwen-Image LoRA: diffusers `QwenImageTransformer2DModel`, trained by flow matching (engine/families/image/base.py).

What is Qwen-Image's own, all through diffusers' `QwenImagePipeline`:

- Latents: the video-style VAE (`AutoencoderKLQwenImage`, 16 channels, one
  frame) encodes [1, 3, 1, H, W]; the posterior mode is normalised with the
  VAE config's per-channel `latents_mean` / `latents_std`, as
  `QwenImageImg2ImgPipeline._encode_vae_image` does (that helper samples the
  posterior; the cache keeps the mode, as the Flux cache keeps the mean —
  flow matching adds its own noise).
- Tokens: `_pack_latents` cuts 2×2 patches into [B, h/2·w/2, 64]; positions
  come from `img_shapes` [(1, h/2, w/2)] per sample (the transformer builds
  its 3-D RoPE from them).
- Text: the pipeline's `encode_prompt` — Qwen2.5-VL's last hidden state of
  the caption inside the pipeline's chat template (its 34 template tokens
  dropped). Captions keep their own length: a batch is padded to its longest
  with `encoder_hidden_states_mask`, as the pipeline does for a prompt list.
- Edit bases (Qwen-Image-Edit, Edit-Plus; data.control_path): the
  instruction is encoded with the control image(s) by the edit pipeline's own
  `encode_prompt` (its vision-language template), and the control latents
  follow the target's tokens with their own `img_shapes`, packed by
  Edit-Plus' `prepare_latents` (Edit's, for one control)
  (engine/families/image/edit.py).
- Timesteps: `shift` uses the pipeline's `calculate_shift` with the model's
  scheduler settings (base/max_shift over base/max_image_seq_len) and the
  scheduler's exponential time shift.
- LoRA targets (DEFAULT_TARGETS): attention q/k/v/out of both streams and
  both MLPs of every block — the names ComfyUI's Qwen-Image model and
  diffusers' loader share.
- Export: the diffusers file (engine/families/image/export.py) and
  `qwen_image_lora_comfyui.safetensors`:

      diffusion_model.<module path>.lora_A.weight   [r, in]
      diffusion_model.<module path>.lora_B.weight   [out, r]
      diffusion_model.<module path>.alpha           lora.alpha; scale alpha / r

  ComfyUI's Qwen-Image model keeps diffusers' module names, and its loader
  (comfy/lora.py, model_lora_keys_unet) maps the generic
  `diffusion_model.<path>` to the weight `diffusion_model.<path>.weight`,
  reading `lora_A`/`lora_B` ("diffusers" style) and `<key>.alpha`. diffusers'
  Qwen-Image loader reads the same file (it strips `diffusion_model.` and
  folds alpha / r into the weights).

  LoKr and LoHa (lora.type) write this file only, as LyCORIS tensors under
  the same keys: `diffusion_model.<module path>.lokr_w1 | lokr_w1_a | … |
  hada_w1_a | … | alpha`, which ComfyUI's LoKr and LoHa loaders read beside
  every key its LoRA loader maps (the scale rules: flux_export.py). DoRA
  writes the diffusers file only (peft's `lora_magnitude_vector` keys, which
  diffusers loads as DoRA).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from engine.config.job import JobConfig
from engine.families.image.export import diffusion_model_comfyui_file, output_files
from engine.families.image.model import pipeline_shift_mu, qwen_vae_latent

DEFAULT_TARGETS = (
    r"^transformer_blocks\.\d+\.(attn\.(to_q|to_k|to_v|to_out\.0|add_q_proj|add_k_proj|add_v_proj|to_add_out)"
    r"|img_mlp\.net\.(0\.proj|2)|txt_mlp\.net\.(0\.proj|2))$"
)
# Kept in the model dtype under fp8: the input/output projections and the timestep embedding.
FP8_SKIP = r"^(img_in|txt_in|txt_norm|time_text_embed|norm_out|proj_out)(\.|$)"
COMFYUI_FILE = "qwen_image_lora_comfyui.safetensors"


class QwenImageModel:
    """The Qwen-Image half of an ImageFamily (see the module docstring)."""

    name = "qwen_image"
    text_sees_controls = True  # the edit pipelines encode the instruction with the control image(s)
    # Padded text tokens are masked out of the joint attention (encoder_hidden_states_mask builds the mask, and the
    # text RoPE positions of real tokens do not move), so text may be padded to a few lengths while compiling.
    text_masked = True
    default_targets = DEFAULT_TARGETS
    fp8_skip = FP8_SKIP

    def transformer_class(self) -> type:
        from diffusers import QwenImageTransformer2DModel

        return QwenImageTransformer2DModel

    def text_max_len(self, model_path: str, revision: str | None) -> int:
        return 1024  # the pipeline's tokenizer_max_length; captions are not padded to it

    def encode_latents(self, pipe, pixels: torch.Tensor) -> torch.Tensor:
        return qwen_vae_latent(pipe, pixels)

    def encode_text(self, pipe, text: str, max_len: int, device: torch.device, images=None) -> torch.Tensor:
        """images: an edit pair's control images (PIL), which the edit pipelines' vision-language encoder reads with
        the instruction (engine/families/image/edit.py qwen_prompt_images)."""
        if images:
            from engine.families.image.edit import qwen_prompt_images

            embeds, _mask = pipe.encode_prompt(text, image=qwen_prompt_images(pipe, images), device=device,
                                               max_sequence_length=max_len)
            return embeds[0]
        embeds, _mask = pipe.encode_prompt(text, device=device, max_sequence_length=max_len)
        return embeds[0]

    def shift_mu(self, sched: dict[str, Any], image_seq_len: int) -> float:
        from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift

        return pipeline_shift_mu(calculate_shift, sched, image_seq_len)

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        from diffusers import QwenImagePipeline

        b, c, h, w = x.shape
        return QwenImagePipeline._pack_latents(x, b, c, h, w)

    def predict(self, model, inner, x_t, sigma, embeds, mask, cfg: JobConfig, controls=()) -> torch.Tensor:
        """controls: an edit pair's control latents (Qwen-Image-Edit), appended after the target's tokens with
        their own img_shapes; the prediction is the target's tokens only."""
        dtype, device = inner.dtype, x_t.device
        b, _c, h, w = x_t.shape
        hidden, shapes = self.pack(x_t.to(dtype)), [[(1, h // 2, w // 2)]] * b
        if controls:
            from engine.families.image.edit import qwen_edit_inputs

            hidden, shapes = qwen_edit_inputs(hidden, [c.to(device) for c in controls], h, w, dtype)
        return model(
            hidden_states=hidden,
            encoder_hidden_states=embeds.to(device, dtype),
            encoder_hidden_states_mask=mask.to(device),
            timestep=sigma.to(dtype),
            img_shapes=shapes,
            return_dict=False,
        )[0][:, : (h // 2) * (w // 2)]

    def sample_kwargs(self, emb, negative, device, dtype, cfg: JobConfig) -> dict[str, Any]:
        # sample.guidance is Qwen-Image's true CFG scale, against the negative prompt (the empty caption by default).
        return {"prompt_embeds": emb["prompt_embeds"][None].to(device, dtype),
                "negative_prompt_embeds": negative["prompt_embeds"][None].to(device, dtype),
                "true_cfg_scale": cfg.sample.guidance}

    def export(self, model, cfg: JobConfig, out_dir: Path, meta: dict[str, Any]) -> list[str]:
        return output_files(model, cfg, out_dir, meta, lambda md: diffusion_model_comfyui_file(
            model, cfg, out_dir, md, COMFYUI_FILE, "qwen_image"))


def QwenImage():  # noqa: N802 - reads as the family's class at get_family's call site
    from engine.families.image.base import ImageFamily

    return ImageFamily(QwenImageModel())
