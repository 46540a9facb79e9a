"""The image families' shared half: data, cache, buckets, flow matching, LoRA, samples — one `ImageFamily`.

A model family that trains a diffusers flow-matching transformer on cached
latents (flux2, qwen_image) is an `ImageFamily` holding a small per-model
`ImageModel`. The family part (this module) is the same for every model:

- prepare: scan the image folder, assign aspect-ratio buckets, and make the
  latent + text-embedding cache complete (engine/storage/cache.py) with the model's
  own encoders, which are freed before the transformer loads;
- the dataset: one bucket per batch (engine.data.images.BucketOrder), text
  embeddings padded to the longest in the batch with a mask (Qwen-Image's
  captions keep their own length; FLUX.2 pads every caption to a fixed
  length, so its mask is all ones);
- the loss: rectified flow, as in engine/families/image/flux/family.py's docstring —
  x_σ = (1 − σ)·x0 + σ·ε, target ε − x0, a plain MSE on the packed tokens —
  with every random draw (flip, caption dropout, noise, σ) from the
  checkpointed generator, in that order; data.masks and the regularisation
  images' loss weights weight it (masked_loss.py: the latent-grid mask packed
  by the model's own `pack`), train.dop adds its preservation term (dop.py),
  and the validation loss is the same objective on held-out images with
  draws of their own (engine/training/heldout.py);
- σ sampling (train.timestep_sampling): `sigmoid` (logit-normal), `linear`
  (uniform), or `shift`: uniform t moved by the exponential time shift of the
  model's own scheduler, σ = e^μ / (e^μ + 1/t − 1), with μ the
  resolution-dependent value the model's pipeline computes at inference
  (ImageModel.shift_mu); train.timestep_bias reweights any of the three;
- LoRA (peft through diffusers' `add_adapter`), fp8 base, block swapping and
  gradient checkpointing; samples on their own RNG (engine/families/image/sample.py).

The data half (scan, buckets, the cached dataset, the cache's encoders) is
engine/families/image/dataset.py; the σ and data draws and the LoRA transformer,
engine/families/image/flow_lora.py; this module puts them together as ImageFamily.

The model part (ImageModel) is what differs: which pipeline encodes images and
prompts, how latents are packed into tokens with their position ids, the
default LoRA targets and the export key maps.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from engine.builtin.models import resolve_model_path
from engine.config.job import JobConfig
from engine.families.image.dataset import ImageData, ImageDataset, PipelineEncoder, scan_images
from engine.families.image.dop import with_preservation
from engine.families.image.edit import check_edit_items, check_edit_model, controls
from engine.families.image.flow_lora import (
    flip_and_drop,
    load_lora_transformer,
    sample_sigmas,
    scheduler_settings,
)
from engine.families.image.masked_loss import batch_flow_loss
from engine.families.image.model import ImageModel
from engine.report.quiet import quiet_libraries
from engine.training.dtypes import torch_dtype


class ImageFamily(ImageData):
    """The Family protocol (engine/families/base.py) for a diffusers flow-matching image model."""

    dataset_class = ImageDataset

    def __init__(self, model: ImageModel):
        self.model = model
        self.renderer = None
        self.sched: dict[str, Any] = {}
        self.cfg: JobConfig | None = None

    # ---------------------------------------------------------------- data
    def prepare(self, cfg: JobConfig, workdir: Path, log, bar=None) -> None:
        """Scan the image folder and make the latent/text cache complete (encoders are freed afterwards)."""
        from engine.families.image.cache import fill_cache

        quiet_libraries(diffusers=True)  # diffusers' loading bars have only an API switch
        self.cfg = cfg
        path = resolve_model_path(cfg.model.path, workdir)
        pipeline = check_edit_model(cfg, path)
        self.records, self.items, self.n_train = scan_images(cfg, log, workdir)
        check_edit_items(pipeline, self.items)
        enc = PipelineEncoder(self.model, path, cfg)
        self.cache, self.plan, self.report = fill_cache(
            cfg, self.items, workdir, path, log, bar=bar, max_len=self.model.text_max_len(path, cfg.model.revision),
            open_image_encoder=enc.image_encoder, open_text_encoder=enc.text_encoder,
            text_sees_controls=getattr(self.model, "text_sees_controls", False))

    # ---------------------------------------------------------------- model
    def load_model(self, cfg: JobConfig, workdir: Path, device: torch.device, log) -> torch.nn.Module:
        self.cfg = cfg
        path = resolve_model_path(cfg.model.path, workdir)
        self.sched = scheduler_settings(path, cfg.model.revision)
        return load_lora_transformer(self.model.transformer_class(), path, cfg, device, log,
                                     fp8_skip=self.model.fp8_skip, default_targets=self.model.default_targets)

    def loss(self, model: torch.nn.Module, batch: dict[str, Any], generator: torch.Generator,
             evaluate: bool = False) -> torch.Tensor:
        """evaluate: the validation loss — the plain objective on the sample as it is (no flip, no caption
        dropout, no preservation term), with only the noise and σ drawn."""
        cfg = self.cfg
        # Every random draw comes from `generator` (checkpointed), in a fixed order: flip, dropout, noise, σ.
        conds = ("prompt_embeds", "prompt_mask")
        x0, flip, text = flip_and_drop(batch, cfg, generator, conds, draw=not evaluate)
        device = x0.device
        b, _c, h, w = x0.shape
        noise = torch.randn(x0.shape, generator=generator).to(device)
        shift = math.exp(self.model.shift_mu(self.sched, (h // 2) * (w // 2))) \
            if cfg.train.timestep_sampling == "shift" else 1.0
        sigma = sample_sigmas(cfg.train.timestep_sampling, b, shift, generator, cfg.train.timestep_bias).to(device)
        x0, noise = x0.float(), noise.float()
        s = sigma[:, None, None, None]
        x_t = (1 - s) * x0 + s * noise

        # An edit pair's control latents (data.control_path), mirrored with the target: the model appends them.
        edit = {"controls": ctl} if (ctl := controls(batch, flip)) else {}

        def predict(embeds: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            # Under DDP (several processes) the forward goes through the wrapper, the config is the inner model's.
            return self.model.predict(model, getattr(model, "module", model), x_t, sigma, embeds, mask, cfg, **edit)

        pred = predict(text["prompt_embeds"], text["prompt_mask"])
        # data.masks are on the latent grid: the model's own pack lays them out like its tokens.
        loss = batch_flow_loss(pred, self.model.pack(noise - x0), batch, flip, self.model.pack, x0.shape)
        if evaluate:
            return loss
        return with_preservation(loss, cfg, model, predict, batch, conds)

    # ---------------------------------------------------------------- samples and export
    def on_step_end(self, model: torch.nn.Module, step: int, cfg: JobConfig, workdir: Path, log) -> None:
        from engine.families.image.sample import SampleRenderer, sample_due

        if not sample_due(cfg, step):
            return
        if self.renderer is None:
            path = resolve_model_path(cfg.model.path, workdir)
            self.renderer = SampleRenderer(
                cfg, path, self.cache, self.plan, Path(workdir),
                # A model whose pipeline is not a DiffusionPipeline (FLUX.3's modular one) brings its own.
                pipeline=lambda t: getattr(self.model, "sample_pipeline", sample_pipeline)(path, cfg, t),
                prompt_kwargs=lambda emb, neg, dev, dt: self.model.sample_kwargs(emb, neg, dev, dt, cfg))
        self.renderer.render(model, step, log)

    def export(self, model: torch.nn.Module, cfg: JobConfig, out_dir: Path, meta: dict[str, Any]) -> list[str]:
        return self.model.export(model, cfg, Path(out_dir), self.export_meta(cfg, meta))


def sample_pipeline(model_path: str, cfg: JobConfig, transformer):
    """The model's own pipeline with the training transformer and no text encoder (prompts come from the cache)."""
    from diffusers import DiffusionPipeline

    from engine.families.image.dataset import pipeline_components

    # Only the components: model_index.json's settings (Krea 2's text_encoder_select_layers) keep their values.
    components = pipeline_components(DiffusionPipeline.load_config(model_path, revision=cfg.model.revision))
    text_parts = {k: None for k in components if k.startswith(("text_encoder", "tokenizer", "processor"))}
    pipe = DiffusionPipeline.from_pretrained(model_path, revision=cfg.model.revision, transformer=transformer,
                                             dtype=torch_dtype(cfg.model.dtype), **text_parts)
    pipe.vae.to(transformer.device)
    return pipe


