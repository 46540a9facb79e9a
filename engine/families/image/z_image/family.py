"""Z-Image (Turbo and Base) LoRA: diffusers `ZImageTransformer2DModel`, trained by flow matching (engine/families/image/base.py).

What is Z-Image's own, all through diffusers' `ZImagePipeline` (and its img2img
sibling's `retrieve_latents`):

- Latents: FLUX.1's VAE (`AutoencoderKL`, 16 channels); the posterior mode is
  normalised as `ZImageImg2ImgPipeline.prepare_latents` does,
  (z − shift_factor) · scaling_factor (that pipeline samples the posterior;
  the cache keeps the mode, as the other families do).
- Tokens and positions: none here. The transformer takes the latents as a
  list of [C, 1, h, w] tensors (the pipeline's `unsqueeze(2).unbind(0)`) and
  cuts the 2×2 patches, pads to its multiple of 32 and builds the 3-D RoPE
  ids (caption first, image after it) itself (`patchify_and_embed`), so the
  packed layout the loss compares is the latent's own [B, C, h, w].
- Text: the pipeline's `encode_prompt` — the second-to-last hidden state of
  Qwen3 (Qwen3-4B) over the caption in the chat template, padding dropped, so
  captions keep their own length; a batch is padded with a mask and each
  sample handed back to the transformer unpadded, as a list, as the pipeline
  does.
- Time and sign: the transformer is conditioned on 1 − σ (the pipeline's
  (1000 − t) / 1000) and predicts x0 − ε; the pipeline negates it into the
  scheduler's velocity ε − x0, and so does `predict`, so the loss is the
  shared rectified-flow MSE against ε − x0.
- Timesteps: `shift` uses the model's scheduler as the pipeline's
  `set_timesteps` does: Z-Image's scheduler has a static shift (3.0 for Turbo;
  σ = s·t / (1 + (s − 1)·t)), and `calculate_shift` over the scheduler's
  base/max settings when a directory turns dynamic shifting on.
- Turbo and Base: the same transformer class and the same training loss.
  Neither embeds a guidance value (train.guidance is not read). Turbo's
  distillation removes classifier-free guidance at inference: its samples
  want `sample.guidance: 0` (the pipeline then skips the negative pass) and
  ~8 steps; Base uses real CFG against the empty caption (the pipeline's
  pos + g · (pos − neg)) at ~30-50 steps. Training on Turbo directly slowly
  undoes its distillation over long runs (no de-distillation adapter here).
- LoRA targets (DEFAULT_TARGETS): attention to_q/to_k/to_v/to_out.0 and the
  SwiGLU feed-forward w1/w2/w3 of every block — the 30 main `layers` and the
  2 + 2 `noise_refiner` / `context_refiner` blocks. Both loaders below map
  every one of them.

Export (both formats keep diffusers' module paths; alpha / r is the scale):

`pytorch_lora_weights.safetensors` (diffusers; written by export.py's diffusers_lora_file, as for FLUX.2 and
Qwen-Image):

    transformer.<module path>.lora_A.weight   [r, in]
    transformer.<module path>.lora_B.weight   [out, r]   × alpha / r (folded)
    metadata "lora_adapter_metadata"          LoraConfig with lora_alpha = r

The scale is folded into lora_B and the adapter metadata says lora_alpha = r,
so every loader applies it at the trained strength: diffusers' Z-Image loader
(it reads the metadata: scale 1 on the folded weights), ComfyUI (which maps
`transformer.<path>` for Z-Image and applies scale 1 to a key with no
`.alpha`), and anything reading plain A/B. The update B'·A equals
(alpha / r)·B·A; for a power-of-two alpha / r the loaded layer's output is
bit-identical to the trained one's, otherwise equal up to one rounding.

`z_image_lora_comfyui.safetensors` (ComfyUI):

    diffusion_model.<module path>.lora_A.weight   [r, in]
    diffusion_model.<module path>.lora_B.weight   [out, r]
    diffusion_model.<module path>.alpha           lora.alpha; scale alpha / r

ComfyUI loads Z-Image as its Lumina2 (NextDiT) model, whose block names differ
from diffusers' (one fused `attention.qkv`, `attention.out`). Its LoRA loader
(comfy/lora.py, model_lora_keys_unet, the Lumina2 branch) maps the diffusers
names through comfy/utils.py's z_image_to_diffusers, under the prefixes
`diffusion_model.` and `transformer.` alike:

    <block>.attention.to_q | to_k | to_v     <block>.attention.qkv.weight rows [0, d) | [d, 2d) | [2d, 3d)
    <block>.attention.to_out.0               <block>.attention.out.weight
    <block>.feed_forward.w1 | w2 | w3        <block>.feed_forward.w1 | w2 | w3 .weight
        (<block>: layers.i, noise_refiner.i, context_refiner.i; d = the model width, 3840)

and reads `<key>.lora_A.weight` / `.lora_B.weight` with `<key>.alpha`
(scale alpha / rank). diffusers' Z-Image loader reads the same file: it strips
`diffusion_model.` and folds alpha / r into the weights.

LoKr and LoHa (lora.type) write the ComfyUI file only, as LyCORIS tensors
under the same keys (`diffusion_model.<module path>.lokr_w1 | … | hada_w1_a |
… | alpha`), which ComfyUI's LoKr and LoHa loaders read for every key that map
names, q, k and v each on its rows of the fused qkv (the scale rules:
flux_export.py). DoRA writes the diffusers file only.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from engine.config.job import JobConfig
from engine.families.image.export import diffusion_model_comfyui_file, output_files
from engine.families.image.model import pipeline_shift_mu, tokenizer_text_len

_BLOCK = r"(layers|noise_refiner|context_refiner)\.\d+\."
DEFAULT_TARGETS = rf"^{_BLOCK}(attention\.(to_q|to_k|to_v|to_out\.0)|feed_forward\.(w1|w2|w3))$"
# Kept in the model dtype under fp8: the patch and caption embedders, the timestep embedder and the final layer
# (small, once per step; diffusers also keeps t_embedder and cap_embedder out of its layerwise casting).
FP8_SKIP = r"^(all_x_embedder|all_final_layer|t_embedder|cap_embedder)(\.|$)"
COMFYUI_FILE = "z_image_lora_comfyui.safetensors"
MAX_TEXT_LEN = 512  # the pipeline's max_sequence_length


class ZImageModel:
    """The Z-Image half of an ImageFamily (see the module docstring)."""

    name = "z_image"
    default_targets = DEFAULT_TARGETS
    fp8_skip = FP8_SKIP

    def transformer_class(self) -> type:
        from diffusers import ZImageTransformer2DModel

        return ZImageTransformer2DModel

    def text_max_len(self, model_path: str, revision: str | None) -> int:
        """Tokens per caption: the pipeline's 512, capped by the tokenizer's own limit (the tiny one has 64)."""
        return tokenizer_text_len(model_path, revision, MAX_TEXT_LEN)

    def encode_latents(self, pipe, pixels: torch.Tensor) -> torch.Tensor:
        from diffusers.pipelines.z_image.pipeline_z_image_img2img import retrieve_latents

        vae = pipe.vae
        lat = retrieve_latents(vae.encode(pixels), sample_mode="argmax")
        return ((lat - vae.config.shift_factor) * vae.config.scaling_factor)[0]

    def encode_text(self, pipe, text: str, max_len: int, device: torch.device) -> torch.Tensor:
        embeds, _neg = pipe.encode_prompt(text, device=device, do_classifier_free_guidance=False,
                                          max_sequence_length=max_len)
        return embeds[0]

    def shift_mu(self, sched: dict[str, Any], image_seq_len: int) -> float:
        """μ = log of the shift the scheduler applies: its static `shift`, or calculate_shift when dynamic."""
        from diffusers.pipelines.z_image.pipeline_z_image import calculate_shift

        if not sched.get("use_dynamic_shifting", False):
            return math.log(sched.get("shift", 1.0))
        return pipeline_shift_mu(calculate_shift, sched, image_seq_len)

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        return x  # the transformer patchifies inside its forward

    def predict(self, model, inner, x_t, sigma, embeds, mask, cfg: JobConfig) -> torch.Tensor:
        dtype, device = inner.dtype, x_t.device
        latents = list(x_t.to(dtype).unsqueeze(2).unbind(0))  # [C, 1, h, w] each, as the pipeline passes them
        captions = [e[m.bool()].to(device, dtype) for e, m in zip(embeds.to(device), mask.to(device), strict=True)]
        out = model(latents, (1 - sigma).to(dtype), captions, return_dict=False)[0]
        return -torch.stack(out).squeeze(2)

    def sample_kwargs(self, emb, negative, device, dtype, cfg: JobConfig) -> dict[str, Any]:
        # sample.guidance is the pipeline's CFG scale against the negative prompt (the empty caption by default;
        # 0 for Turbo: no CFG pass).
        return {"prompt_embeds": [emb["prompt_embeds"].to(device, dtype)],
                "negative_prompt_embeds": [negative["prompt_embeds"].to(device, dtype)]}

    def export(self, model, cfg: JobConfig, out_dir: Path, meta: dict[str, Any]) -> list[str]:
        return output_files(model, cfg, out_dir, meta, lambda md: diffusion_model_comfyui_file(
            model, cfg, out_dir, md, COMFYUI_FILE, "z_image"))


def ZImage():  # noqa: N802 - reads as the family's class at get_family's call site
    from engine.families.image.base import ImageFamily

    return ImageFamily(ZImageModel())
