"""Edit LoRAs (data.control_path): the control latents of a batch, and how FLUX.1 Kontext feeds them to its transformer.

The pairs are found and checked by engine/config/controls.py; each control is cached at its target's bucket
(engine/families/image/cache.py) and collated as `control_J` (+ `control_J_flip`) per reference slot J
(engine/families/image/dataset.py). A control is mirrored exactly when its target is: `controls` reads the flip
the loss already drew for the target (engine/families/image/flow_lora.py), so no draw is added and a job without
controls keeps its random stream.

The control tokens enter the transformer after the target's, through the pipeline's own helpers, and the
prediction is cut back to the target's tokens before the loss: the loss is on the target tokens only. FLUX.1
Kontext takes one control (FluxKontextPipeline.prepare_latents' image branch: position ids (1, row, col)); FLUX.2
takes one reference per slot (Flux2Pipeline's reference conditioning: time coordinate 10, 20, ... per reference).
"""

from __future__ import annotations

import torch

from engine.config.job import JobConfig


def controls(batch: dict, flip: torch.Tensor | None) -> list[torch.Tensor]:
    """The batch's control latents [B, C, h, w], one per slot, mirrored where `flip` drew for the target."""
    out, j = [], 0
    while f"control_{j}" in batch:
        c = batch[f"control_{j}"]
        if flip is not None:
            c = torch.where(flip[:, None, None, None], batch[f"control_{j}_flip"], c)
        out.append(c)
        j += 1
    return out


def check_edit_model(cfg: JobConfig, model_path: str) -> str | None:
    """The trainer's own check (a hub id is checked only here): with data.control_path, the base's pipeline class
    must be an edit pipeline of the family. Returns that class (None without controls)."""
    if cfg.data.control_path is None:
        return None
    from diffusers import DiffusionPipeline

    from engine.config.controls import check_edit_base

    pipeline = DiffusionPipeline.load_config(model_path, revision=cfg.model.revision).get("_class_name")
    check_edit_base(cfg.model.family, pipeline, cfg.model.path, len(cfg.data.control_paths()))
    return pipeline


def check_edit_items(pipeline: str | None, items: list) -> None:
    """The trainer's own check of each pair's bucket against what the pipeline takes as a reference image."""
    from engine.config.controls import check_bucket

    for it in items:
        if it.controls:
            check_bucket(pipeline, it.record.path, it.bucket, it.resolution)


def kontext_pipeline(latent_channels: int):
    """A FluxKontextPipeline with no components, for its latent helpers: they read only the VAE's scale factor and
    latent channel count, which a real pipeline takes from its VAE config (8x, and the transformer's in_channels/4)."""
    from diffusers import FluxKontextPipeline

    pipe = FluxKontextPipeline(*[None] * 7)
    pipe.latent_channels = latent_channels
    return pipe


def kontext_inputs(packed: torch.Tensor, control: torch.Tensor, h: int, w: int, dtype: torch.dtype):
    """(hidden_states, img_ids) of FLUX.1 Kontext for the packed noisy target tokens and one control latent
    [B, C, h', w']: the control packed and given position ids with first axis 1 by the pipeline's prepare_latents
    (its image branch), appended after the target's tokens and ids as its denoising loop does."""
    b, c = control.shape[:2]
    pipe = kontext_pipeline(c)
    scale = pipe.vae_scale_factor
    latents, image_latents, latent_ids, image_ids = pipe.prepare_latents(
        control, b, c, h * scale, w * scale, dtype, packed.device, latents=packed)
    return torch.cat([latents, image_latents], dim=1), torch.cat([latent_ids, image_ids], dim=0)


def flux2_reference_inputs(packed: torch.Tensor, latent_ids: torch.Tensor, refs: list[torch.Tensor], dtype):
    """(hidden_states, img_ids) of FLUX.2 for the packed noisy target tokens [B, N, C] with their ids [B, N, 4] and
    the reference latents [B, C, h', w'] (one per slot): as Flux2Pipeline.prepare_image_latents lays them out —
    each reference packed by its _pack_latents, all after one another, with _prepare_image_ids' coordinates
    (time 10, 20, ... per reference) — appended after the target's as its denoising loop does."""
    from diffusers import Flux2Pipeline

    b = packed.shape[0]
    ids = Flux2Pipeline._prepare_image_ids([r[:1] for r in refs]).repeat(b, 1, 1).to(packed.device)
    tokens = torch.cat([Flux2Pipeline._pack_latents(r.to(dtype)) for r in refs], dim=1)
    return torch.cat([packed, tokens], dim=1), torch.cat([latent_ids, ids], dim=1)
