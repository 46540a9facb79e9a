"""How the Flux (FLUX.1) family encodes what it caches (engine/families/image/cache.py plans and fills the cache).

    cache/latent-KEY-SHA.safetensors   latent [C, h, w] (+ latent_flip with data.flip), scaled and shifted
    cache/text-KEY-SHA.safetensors     prompt_embeds [L, D] (T5), pooled [D'] (CLIP)

Latents are the VAE posterior mean, `(mean - shift_factor) * scaling_factor`,
as the Flux pipeline expects them; sampling the posterior would add noise
that flow matching adds anyway. Texts go through the pipeline's own
`encode_prompt`, so cached embeddings are exactly what inference computes. A
text's key includes the T5 length.
"""

from __future__ import annotations

from pathlib import Path

import torch

from engine.config.job import JobConfig
from engine.data.images import Item
from engine.families.image.cache import Plan
from engine.families.image.cache import fill_cache as fill_image_cache
from engine.storage import cache as store
from engine.storage.fsio import FileLayer
from engine.training.dtypes import pick_device, torch_dtype


def t5_length(model_path: str, revision: str | None, subfolder: str = "tokenizer_2") -> int:
    """T5 tokens per caption: what the pipeline uses (512 for dev), capped by the tokenizer's own limit.

    FLUX.1 keeps T5's tokenizer in tokenizer_2 (CLIP's is tokenizer); Chroma, T5 only, in tokenizer."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path, subfolder=subfolder, revision=revision)
    limit = getattr(tok, "model_max_length", 512) or 512
    return int(min(512, limit))


def open_vae(model_path: str, revision: str | None, dtype: torch.dtype):
    """The VAE encoder as a function of pixels: the posterior mean, shifted and scaled."""
    from diffusers import AutoencoderKL

    device = pick_device()
    vae = AutoencoderKL.from_pretrained(model_path, subfolder="vae", revision=revision, dtype=dtype).to(device).eval()
    return lambda x: vae_latent(vae, x.to(device, vae.dtype))


def vae_latent(vae, pixels: torch.Tensor) -> torch.Tensor:
    """[1, 3, H, W] in [-1, 1] → the FLUX.1 VAE's posterior mean, shifted and scaled, [C, h, w] (Chroma's too)."""
    shift, scale = vae.config.shift_factor or 0.0, vae.config.scaling_factor
    return ((vae.encode(pixels).latent_dist.mean - shift) * scale)[0]


def open_text_encoders(model_path: str, revision: str | None, dtype: torch.dtype, max_len: int):
    """CLIP and T5 through FluxPipeline.encode_prompt, as a function of one text."""
    from diffusers import FluxPipeline

    device = pick_device()
    pipe = FluxPipeline.from_pretrained(model_path, transformer=None, vae=None, revision=revision, dtype=dtype)
    pipe.text_encoder.to(device)
    pipe.text_encoder_2.to(device)

    def encode(text: str) -> dict[str, torch.Tensor]:
        embeds, pooled, _ids = pipe.encode_prompt(text, prompt_2=None, device=device, max_sequence_length=max_len)
        return {"prompt_embeds": embeds[0], "pooled": pooled[0]}

    return encode


def fill_cache(cfg: JobConfig, items: list[Item], workdir: Path, model_path: str, log, bar=None,
               fs: FileLayer | None = None) -> tuple[store.Cache, Plan, store.CacheReport]:
    """Make every latent and text embedding the job needs present and valid; encode only what is not."""
    max_len = t5_length(model_path, cfg.model.revision)
    rev, dtype = cfg.model.revision, torch_dtype(cfg.model.dtype)
    return fill_image_cache(cfg, items, workdir, model_path, log, max_len=max_len, bar=bar, fs=fs,
                            open_image_encoder=lambda: open_vae(model_path, rev, dtype),
                            open_text_encoder=lambda: open_text_encoders(model_path, rev, dtype, max_len))
