"""ImageModel: what one image model (FLUX.2, Qwen-Image) contributes to an ImageFamily (engine/families/image/base.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import torch

from engine.config.job import JobConfig


def pipeline_shift_mu(calculate_shift, sched: dict[str, Any], image_seq_len: int) -> float:
    """μ from a pipeline's own `calculate_shift`, with the scheduler config's settings (the pipelines' defaults
    where the config has none)."""
    return calculate_shift(image_seq_len, sched.get("base_image_seq_len", 256), sched.get("max_image_seq_len", 4096),
                           sched.get("base_shift", 0.5), sched.get("max_shift", 1.15))


def tokenizer_text_len(model_path: str, revision: str | None, cap: int) -> int:
    """Tokens per caption: the pipeline's `cap`, or the tokenizer's own limit where it is lower (the tiny ones)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path, subfolder="tokenizer", revision=revision)
    return int(min(cap, getattr(tok, "model_max_length", cap) or cap))


def qwen_vae_latent(pipe, pixels: torch.Tensor) -> torch.Tensor:
    """[1, 3, H, W] → Qwen-Image's VAE latent (a one-frame video VAE; posterior mode), normalised by the VAE
    config's per-channel mean and std as the Qwen-Image pipelines do: [C, h, w]. Krea 2 uses the same VAE."""
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_img2img import retrieve_latents

    vae = pipe.vae
    lat = retrieve_latents(vae.encode(pixels[:, :, None]), sample_mode="argmax")  # [1, C, 1, h, w]
    mean = torch.tensor(vae.config.latents_mean, device=lat.device, dtype=lat.dtype).view(1, -1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std, device=lat.device, dtype=lat.dtype).view(1, -1, 1, 1, 1)
    return ((lat - mean) / std)[0, :, 0]


class ImageModel(Protocol):
    """What one image model contributes to an ImageFamily (engine/families/image/flux2/family.py, qwen_image.py).

    A model whose pipeline is not a DiffusionPipeline (FLUX.3's is modular only) also has
    `load_pipeline(model_path, revision, dtype, keep)` (the cache's encoders: dataset.PipelineEncoder) and
    `sample_pipeline(model_path, cfg, transformer)` (what the SampleRenderer drives); ImageFamily uses them
    where present.
    """

    name: str             # the model.family value
    default_targets: str  # LoRA targets: a regex over the transformer's module paths
    fp8_skip: str         # modules kept in the model dtype under base_precision: fp8

    def transformer_class(self) -> type: ...

    def text_max_len(self, model_path: str, revision: str | None) -> int: ...

    def encode_latents(self, pipe, pixels: torch.Tensor) -> torch.Tensor:
        """[1, 3, H, W] in [-1, 1] → the normalised latent the transformer trains on, [C, h, w]."""

    def encode_text(self, pipe, text: str, max_len: int, device: torch.device) -> torch.Tensor:
        """One caption → its prompt embedding [L, D] through the pipeline's own encode_prompt."""

    def shift_mu(self, sched: dict[str, Any], image_seq_len: int) -> float: ...

    def predict(self, model, inner, x_t: torch.Tensor, sigma: torch.Tensor, embeds: torch.Tensor,
                mask: torch.Tensor, cfg: JobConfig) -> torch.Tensor:
        """The packed velocity prediction of `model` (the transformer, or its DDP wrapper around `inner`) for noisy
        latents x_t [B, C, h, w]."""

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """[B, C, h, w] latents → the transformer's token layout (to compare targets with predictions, and to lay
        data.masks out like the tokens: any [B, C, h, w] tensor, not only latents)."""

    def sample_kwargs(self, emb: dict[str, torch.Tensor], negative: dict[str, torch.Tensor], device, dtype,
                      cfg: JobConfig) -> dict[str, Any]: ...

    def export(self, model, cfg: JobConfig, out_dir: Path, meta: dict[str, Any]) -> list[str]: ...
