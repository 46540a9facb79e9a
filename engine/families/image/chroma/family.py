"""Chroma LoRA (Chroma1-HD and its flash variants): diffusers `ChromaTransformer2DModel`, trained by flow matching
(engine/families/image/base.py).

Chroma is derived from FLUX.1-schnell (19 double + 38 single blocks, 3072 wide; 8.9 B parameters) with T5 as
its only text encoder, no CLIP pooled vector and no guidance embedding: a small MLP (`distilled_guidance_layer`)
turns the timestep into every block's modulation, replacing FLUX.1's per-block modulation linears. What is
Chroma's own, all through diffusers' `ChromaPipeline`:

- Latents: FLUX.1's VAE (16 channels), the posterior mean shifted and scaled by the VAE config
  (flux_encode.vae_latent, shared with FLUX.1) — the inverse of what the pipeline decodes.
- Tokens: `_pack_latents` cuts 2×2 patches into [B, h/2·w/2, 64]; image position ids from
  `_prepare_latent_image_ids` (0, row, col), text ids zeros, as `encode_prompt` makes them.
- Text: the pipeline's `encode_prompt` — T5 run with the tokenizer's mask, and a mask that keeps the caption's
  tokens and the first padding token (Chroma's rule). The cache keeps exactly those tokens; a batch pads them to
  its longest with a mask, and the transformer gets that mask through the pipeline's `_prepare_attention_mask` —
  as booleans: diffusers 0.42.1 hands the transformer a 0/1 float mask, which SDPA adds to the logits instead of
  masking (diffusers issues #12116 and #13619). Where no caption of the batch is padded (always at batch 1) it
  runs with no mask at all, as ComfyUI does with its unpadded tokens. diffusers' Chroma drops the mask in the
  single blocks under gradient checkpointing, so validation refuses that with train.batch_size > 1.
- Timesteps: σ is the transformer's timestep (the pipeline passes t/1000); `shift` uses the pipeline's
  `calculate_shift` with the model's scheduler settings. train.guidance is not read (no guidance embedding).
- LoRA targets (DEFAULT_TARGETS): FLUX.1's, by the same module names — attention q/k/v/out of both streams and
  both feed-forwards in the double blocks, q/k/v, proj_mlp and proj_out in the single blocks. Chroma has no
  modulation linears to target, and the approximator is left alone.

Export: FLUX.1's two layouts (engine/families/image/flux_export.py), which both loaders map for Chroma too.
ChromaPipeline is a `FluxLoraLoaderMixin`, and ComfyUI's Chroma model subclasses its Flux model
(comfy/model_base.py), so comfy/lora.py's model_lora_keys_unet applies its Flux branch to it:

- `pytorch_lora_weights.safetensors`: `transformer.<module path>.lora_A.weight` / `.lora_B.weight` and
  `transformer.<module path>.alpha` = lora.alpha. The alpha keys are written, not folded: diffusers' Flux loader
  reads them as network alphas (scale alpha / r), and ComfyUI maps `transformer.<diffusers path>` to its weight
  (or that module's rows of a fused qkv/linear1, by comfy.utils.flux_to_diffusers) and reads `<key>.alpha` beside
  it — alpha / r in both.
- `chroma_lora_comfyui.safetensors`: kohya's `lora_unet_<BFL name>.lora_down.weight` / `.lora_up.weight` /
  `.alpha`, which ComfyUI maps by its generic rule to `diffusion_model.<BFL name>.weight` of its Chroma model.
  The BFL names are FLUX.1's table (q, k, v fused into rank-3r LoRAs with alpha 3·alpha, exact; the single
  blocks' q, k, v, proj_mlp into linear1 at 4r) less the modulation and embedder linears Chroma has not got.
  diffusers' kohya Flux converter reads it too (`load_lora_weights`), splitting linear1 at FLUX.1's 3072 width,
  which Chroma has (tiny test models have not).
- Every lora.type as for FLUX.1, by the same code: DoRA in the diffusers file, LoKr and LoHa in the ComfyUI file
  under `lycoris_<diffusers module path with underscores>`, which ComfyUI's Flux branch maps for Chroma too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from engine.config.job import JobConfig
from engine.families.image.flux import DEFAULT_TARGETS
from engine.families.image.model import pipeline_shift_mu

# Kept in the model dtype under fp8: the embedders, the approximator (it makes every modulation) and the final
# layers — small, run once per step, and they set the scale of everything else.
FP8_SKIP = r"^(x_embedder|context_embedder|time_text_embed|distilled_guidance_layer|norm_out|proj_out)(\.|$)"
COMFYUI_FILE = "chroma_lora_comfyui.safetensors"


class ChromaModel:
    """The Chroma half of an ImageFamily (see the module docstring)."""

    name = "chroma"
    default_targets = DEFAULT_TARGETS
    fp8_skip = FP8_SKIP

    def transformer_class(self) -> type:
        from diffusers import ChromaTransformer2DModel

        return ChromaTransformer2DModel

    def text_max_len(self, model_path: str, revision: str | None) -> int:
        from engine.families.image.flux_encode import t5_length

        return t5_length(model_path, revision, subfolder="tokenizer")

    def encode_latents(self, pipe, pixels: torch.Tensor) -> torch.Tensor:
        from engine.families.image.flux_encode import vae_latent

        return vae_latent(pipe.vae, pixels)

    def encode_text(self, pipe, text: str, max_len: int, device: torch.device) -> torch.Tensor:
        embeds, _ids, mask, *_ = pipe.encode_prompt(text, device=device, do_classifier_free_guidance=False,
                                                    max_sequence_length=max_len)
        return embeds[0][mask[0].bool()]  # the tokens Chroma attends to: the caption's and one padding token

    def shift_mu(self, sched: dict[str, Any], image_seq_len: int) -> float:
        from diffusers.pipelines.chroma.pipeline_chroma import calculate_shift

        return pipeline_shift_mu(calculate_shift, sched, image_seq_len)

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        from diffusers import ChromaPipeline

        b, c, h, w = x.shape
        return ChromaPipeline._pack_latents(x, b, c, h, w)

    def predict(self, model, inner, x_t, sigma, embeds, mask, cfg: JobConfig) -> torch.Tensor:
        from diffusers import ChromaPipeline

        dtype, device = inner.dtype, x_t.device
        b, _c, h, w = x_t.shape
        # The batch's text is padded to its longest caption (or the empty one); cut it to the longest in use.
        mask = mask.to(device, torch.bool)
        length = int(mask.sum(1).max())
        embeds, mask = embeds[:, :length].to(device, dtype), mask[:, :length]
        attention_mask = None
        if not bool(mask.all()):
            # A plain function of its arguments (self is unused); boolean in, boolean out.
            attention_mask = ChromaPipeline._prepare_attention_mask(None, b, (h // 2) * (w // 2), dtype, mask)
        return model(
            hidden_states=self.pack(x_t.to(dtype)),
            encoder_hidden_states=embeds,
            timestep=sigma.to(dtype),
            img_ids=ChromaPipeline._prepare_latent_image_ids(b, h // 2, w // 2, device, dtype),
            txt_ids=torch.zeros(length, 3, device=device, dtype=dtype),
            attention_mask=attention_mask,
            return_dict=False,
        )[0]

    def sample_kwargs(self, emb, negative, device, dtype, cfg: JobConfig) -> dict[str, Any]:
        # sample.guidance is Chroma's true CFG scale against the prompt's negative (the empty caption by default;
        # the pipeline skips the negative pass at 1 or below). Every cached token is attended to: all-true masks.
        pos, neg = emb["prompt_embeds"][None].to(device, dtype), negative["prompt_embeds"][None].to(device, dtype)
        return {"prompt_embeds": pos, "prompt_attention_mask": torch.ones(pos.shape[:2], dtype=torch.bool,
                                                                            device=device),
                "negative_prompt_embeds": neg, "negative_prompt_attention_mask": torch.ones(
                    neg.shape[:2], dtype=torch.bool, device=device)}

    def export(self, model, cfg: JobConfig, out_dir: Path, meta: dict[str, Any]) -> list[str]:
        from engine.families.image.flux_export import export

        return export(model, cfg, Path(out_dir), meta, comfyui_file=COMFYUI_FILE, base_version="chroma")


def Chroma():  # noqa: N802 - reads as the family's class at get_family's call site
    from engine.families.image.base import ImageFamily

    return ImageFamily(ChromaModel())
