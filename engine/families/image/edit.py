"""Edit LoRAs (data.control_path): the control latents of a batch, and how FLUX.1 Kontext feeds them to its transformer.

The pairs are found and checked by engine/config/controls.py; each control is cached at its target's bucket
(engine/families/image/cache.py) and collated as `control_J` (+ `control_J_flip`) per reference slot J
(engine/families/image/dataset.py). A control is mirrored exactly when its target is: `controls` reads the flip
the loss already drew for the target (engine/families/image/flow_lora.py), so no draw is added and a job without
controls keeps its random stream.

The control tokens enter the transformer after the target's, through the pipeline's own helpers, and the
prediction is cut back to the target's tokens before the loss: the loss is on the target tokens only. FLUX.1
Kontext takes one control (FluxKontextPipeline.prepare_latents' image branch: position ids (1, row, col)); FLUX.2
takes one reference per slot (Flux2Pipeline's reference conditioning: time coordinate 10, 20, ... per reference);
Qwen-Image-Edit (and Edit-Plus, one per slot) their own img_shapes, and the instruction's embedding is encoded
with the control image(s) (the cache's text entries of an edit pair: engine/families/image/cache.py).
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


def qwen_edit_inputs(packed: torch.Tensor, controls: list[torch.Tensor], h: int, w: int, dtype):
    """(hidden_states, img_shapes) of Qwen-Image-Edit for the packed noisy target tokens and the control latents
    [B, C, h', w'] (one per slot): each packed by QwenImageEditPlusPipeline.prepare_latents' image branch (for one
    control the same as QwenImageEditPipeline's) after the target's, and img_shapes as its __call__ builds them."""
    from diffusers import QwenImageEditPlusPipeline

    b, c = controls[0].shape[:2]
    pipe = QwenImageEditPlusPipeline(*[None] * 6)
    pipe.latent_channels = c  # what a real pipeline reads from its VAE config (z_dim)
    scale = pipe.vae_scale_factor
    latents, image_latents = pipe.prepare_latents([x[:, :, None].to(dtype) for x in controls], b, c, h * scale,
                                                  w * scale, dtype, packed.device, None, latents=packed)
    shapes = [[(1, h // 2, w // 2), *[(1, x.shape[-2] // 2, x.shape[-1] // 2) for x in controls]]] * b
    return torch.cat([latents, image_latents], dim=1), shapes


def qwen_prompt_images(pipe, images: list):
    """The control images as the edit pipeline's vision-language encoder sees them: resized as its __call__ does
    (Edit: to about 1 MP; Edit-Plus: each to about 384², CONDITION_IMAGE_SIZE), one image or a list as its
    encode_prompt takes them."""
    from diffusers import QwenImageEditPlusPipeline
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit as edit
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as plus

    if isinstance(pipe, QwenImageEditPlusPipeline):
        # (Edit-Plus' calculate_dimensions returns (width, height); Edit's adds a third value.)
        sized = [plus.calculate_dimensions(plus.CONDITION_IMAGE_SIZE, im.width / im.height)[:2] for im in images]
        return [pipe.image_processor.resize(im, hh, ww) for im, (ww, hh) in zip(images, sized, strict=True)]
    ww, hh = edit.calculate_dimensions(1024 * 1024, images[0].width / images[0].height)[:2]
    return pipe.image_processor.resize(images[0], hh, ww)


def control_images(item, flip: bool) -> list:
    """An item's control images as the vision-language encoder reads them: each at its own size, upright, RGB,
    mirrored with its target (data.flip)."""
    from PIL import Image, ImageOps

    out = []
    for c in item.controls:
        with Image.open(c.path) as im:
            im = ImageOps.exif_transpose(im).convert("RGB")
        out.append(im.transpose(Image.Transpose.FLIP_LEFT_RIGHT) if flip else im)
    return out
