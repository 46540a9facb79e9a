"""FLUX.1 (dev or schnell) LoRA: diffusers FluxTransformer2DModel trained by flow matching on cached latents.

The objective is rectified flow. For a clean latent x0, noise ε ~ N(0, I) and
a noise level σ in [0, 1] the model sees the straight-line interpolation

    x_σ = (1 − σ) · x0 + σ · ε

and is trained to predict the velocity along that line, v = dx_σ/dσ = ε − x0,
with a plain mean squared error. The transformer's timestep input is σ itself
(the Flux pipeline passes t/1000 with t = 1000σ).

Where σ is drawn matters more than anything else in the recipe
(train.timestep_sampling):

- `sigmoid` — logit-normal: σ = sigmoid(u), u ~ N(0, 1). Most samples in
  the middle of the noise range, where detail and composition are learned;
  the default, as in SD3/FLUX training and most Flux LoRA trainers.
- `linear` — uniform: σ ~ U(0, 1). Every noise level equally often.
- `shift` — uniform t, then moved toward high noise by the same
  resolution-dependent shift FLUX's scheduler applies at inference:
  σ = e^μ·t / (e^μ·t + 1 − t), with μ linear in the number of image tokens
  (diffusers' `calculate_shift` with the model's scheduler settings: μ = 0.5
  at 256 tokens, 1.15 at 4096). Large images spend more steps at high noise,
  matching how they are sampled.

Flux sees latents as a sequence: the 16-channel (VAE) latent is cut into 2×2
patches and packed to [B, h/2·w/2, 64] (`FluxPipeline._pack_latents`), and
every image token gets a position id (0, row, col)
(`FluxPipeline._prepare_latent_image_ids`), text tokens (0, 0, 0). Both are
public static helpers of the diffusers pipeline and used as is, so training
sees exactly what inference does. FLUX.1-dev also embeds a guidance value
(train.guidance); schnell has no guidance embedding and ignores it.

FLUX.1 Kontext (a base whose model_index.json names FluxKontextPipeline) trains
edit LoRAs on pairs (data.control_path): the control's latent, packed and with
position ids (1, row, col) by FluxKontextPipeline.prepare_latents, follows the
noisy target's tokens, and the loss reads the target's tokens only
(engine/families/image/edit.py).
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path
from typing import Any

import torch

from engine.builtin.models import resolve_model_path
from engine.config.job import JobConfig
from engine.data.image_sets import extra_batch
from engine.families.image.dataset import CachedImages, ImageData, scan_images
from engine.families.image.dop import with_preservation
from engine.families.image.edit import check_edit_items, check_edit_model, controls, kontext_inputs
from engine.families.image.flow_lora import add_lora, flip_and_drop, load_lora_transformer
from engine.families.image.flow_lora import sample_sigmas as sample_shifted
from engine.families.image.flux_encode import fill_cache
from engine.families.image.masked_loss import batch_flow_loss
from engine.report.quiet import quiet_libraries

# The modules diffusers' Flux LoRA trainer targets: attention q/k/v/out of both streams (incl. the added text
# projections), both feed-forwards, and the single blocks' q/k/v, proj_mlp and proj_out. Matched against the
# full module path so the top-level proj_out (the final projection) and the embedders are not caught.
DEFAULT_TARGETS = (
    r"^(transformer_blocks\.\d+\.(attn\.(to_q|to_k|to_v|to_out\.0|add_q_proj|add_k_proj|add_v_proj|to_add_out)"
    r"|ff\.net\.(0\.proj|2)|ff_context\.net\.(0\.proj|2))"
    r"|single_transformer_blocks\.\d+\.(attn\.(to_q|to_k|to_v)|proj_mlp|proj_out))$"
)

# Kept in the model dtype under fp8: the embedders and the final layers (top level only — the single blocks'
# proj_out is a large matmul and is converted). They are small, run once per step and set the scale of the rest.
FP8_SKIP = r"^(x_embedder|context_embedder|time_text_embed|norm_out|proj_out)(\.|$)"

SCHEDULER_DEFAULTS = {"base_image_seq_len": 256, "max_image_seq_len": 4096, "base_shift": 0.5, "max_shift": 1.15}


def sample_sigmas(kind: str, batch: int, image_seq_len: int, sched: dict[str, float],
                  generator: torch.Generator, bias=None) -> torch.Tensor:
    """Noise levels σ in [0, 1] for one batch (see the module docstring for the three kinds).

    `bias` (train.timestep_bias) reweights the density (engine/families/image/timestep_bias.py); balanced leaves it alone.
    """
    shift = _shift_exp(image_seq_len, sched) if kind == "shift" else 1.0
    return sample_shifted(kind, batch, shift, generator, bias)


def _shift_exp(image_seq_len: int, sched: dict[str, float]) -> float:
    """e^μ of FLUX's resolution-dependent shift (diffusers' calculate_shift with the scheduler's settings)."""
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    return math.exp(calculate_shift(image_seq_len, sched["base_image_seq_len"], sched["max_image_seq_len"],
                                    sched["base_shift"], sched["max_shift"]))


def apply_lora(transformer: torch.nn.Module, cfg: JobConfig) -> torch.nn.Module:
    """Freeze the transformer and add the peft adapter of lora.type (named "default") to the Flux targets."""
    return add_lora(transformer, cfg, DEFAULT_TARGETS)


class FluxDataset(CachedImages):
    """FLUX.1 batches: T5 embeddings (all one length) and CLIP pooled embeddings, plus masks and DOP prompts."""

    def collate(self, indices: list[int]) -> dict[str, Any]:
        lat, batch = self.latents(indices)
        txt = [self.cache.load(self.plan.item_text[i]) for i in indices]
        batch.update({
            "prompt_embeds": torch.stack([t["prompt_embeds"] for t in txt]),
            "pooled": torch.stack([t["pooled"] for t in txt]),
            "empty_prompt_embeds": self.empty["prompt_embeds"][None],
            "empty_pooled": self.empty["pooled"][None],
        })
        batch.update(extra_batch(self.items, self.cache, self.plan, indices, lat, self.texts))
        return batch

    @staticmethod
    def texts(entries: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Cached text entries as a batch (T5 embeddings are all one length)."""
        return {"prompt_embeds": torch.stack([t["prompt_embeds"] for t in entries]),
                "pooled": torch.stack([t["pooled"] for t in entries])}


class Flux(ImageData):
    dataset_class = FluxDataset

    def __init__(self):
        self.cfg: JobConfig | None = None
        self.sched = dict(SCHEDULER_DEFAULTS)
        self.renderer = None

    # ---------------------------------------------------------------- data
    def prepare(self, cfg: JobConfig, workdir: Path, log, bar=None) -> None:
        """Scan the image folder and make the latent/text cache complete (encoders are freed afterwards)."""
        # The first thing a Flux job (or `lorad cache`) does: diffusers' loading bars have only an API switch.
        quiet_libraries(diffusers=True)
        self.cfg = cfg
        path = resolve_model_path(cfg.model.path, workdir)
        pipeline = check_edit_model(cfg, path)
        self.records, self.items, self.n_train = scan_images(cfg, log, workdir)
        check_edit_items(pipeline, self.items)
        self.cache, self.plan, self.report = fill_cache(cfg, self.items, workdir, path, log, bar=bar)

    # ---------------------------------------------------------------- model
    def load_model(self, cfg: JobConfig, workdir: Path, device: torch.device, log) -> torch.nn.Module:
        from diffusers import FluxTransformer2DModel

        self.cfg = cfg
        path = resolve_model_path(cfg.model.path, workdir)
        self.sched = _scheduler_settings(path, cfg.model.revision)
        return load_lora_transformer(FluxTransformer2DModel, path, cfg, device, log, fp8_skip=FP8_SKIP,
                                     default_targets=DEFAULT_TARGETS)

    def loss(self, model: torch.nn.Module, batch: dict[str, Any], generator: torch.Generator,
             evaluate: bool = False) -> torch.Tensor:
        """evaluate: the validation loss — the plain objective on the sample as it is (no flip, no caption
        dropout, no preservation term), with only the noise and σ drawn."""
        from diffusers import FluxPipeline

        cfg = self.cfg
        inner = getattr(model, "module", model)  # under DDP (several processes) the forward goes through the wrapper
        # Every random draw comes from `generator` (checkpointed), in a fixed order: flip, dropout, noise, σ.
        x0, flip, text = flip_and_drop(batch, cfg, generator, ("prompt_embeds", "pooled"), draw=not evaluate)
        embeds, pooled = text["prompt_embeds"], text["pooled"]
        device, dtype = x0.device, inner.dtype
        b, c, h, w = x0.shape
        noise = torch.randn(x0.shape, generator=generator).to(device)
        seq_len = (h // 2) * (w // 2)
        sigma = sample_sigmas(cfg.train.timestep_sampling, b, seq_len, self.sched, generator,
                              cfg.train.timestep_bias).to(device)
        x0, noise = x0.float(), noise.float()
        s = sigma[:, None, None, None]
        x_t = (1 - s) * x0 + s * noise
        target = noise - x0

        packed = FluxPipeline._pack_latents(x_t.to(dtype), b, c, h, w)
        img_ids = FluxPipeline._prepare_latent_image_ids(b, h // 2, w // 2, device, dtype)
        hidden = packed
        if ctl := controls(batch, flip):  # FLUX.1 Kontext: the control's tokens and ids after the target's
            hidden, img_ids = kontext_inputs(packed, ctl[0].to(device), h, w, dtype)
        txt_ids = torch.zeros(embeds.shape[1], 3, device=device, dtype=dtype)
        guidance = None
        if inner.config.guidance_embeds:
            guidance = torch.full((b,), cfg.train.guidance, device=device, dtype=torch.float32)

        def predict(embeds: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
            return model(
                hidden_states=hidden,
                timestep=sigma.to(dtype),
                guidance=guidance,
                pooled_projections=pooled.to(dtype),
                encoder_hidden_states=embeds.to(dtype),
                txt_ids=txt_ids,
                img_ids=img_ids,
                return_dict=False,
            )[0][:, : packed.shape[1]]  # the target's tokens: an edit model's loss leaves the control's out

        pred = predict(embeds, pooled)
        pack = functools.partial(FluxPipeline._pack_latents, batch_size=b, num_channels_latents=c, height=h, width=w)
        loss = batch_flow_loss(pred, pack(target), batch, flip, pack, x0.shape)
        if evaluate:
            return loss
        return with_preservation(loss, cfg, model, predict, batch, ("prompt_embeds", "pooled"))

    # ---------------------------------------------------------------- samples and export
    def on_step_end(self, model: torch.nn.Module, step: int, cfg: JobConfig, workdir: Path, log) -> None:
        from engine.families.image.sample import sample_due

        if not sample_due(cfg, step):
            return
        if self.renderer is None:
            from engine.families.image.sample import SampleRenderer

            self.renderer = SampleRenderer(cfg, resolve_model_path(cfg.model.path, workdir), self.cache, self.plan,
                                           Path(workdir))
        self.renderer.render(model, step, log)

    def export(self, model: torch.nn.Module, cfg: JobConfig, out_dir: Path, meta: dict[str, Any]) -> list[str]:
        from engine.families.image.flux_export import export

        return export(model, cfg, Path(out_dir), self.export_meta(cfg, meta))


def _scheduler_settings(path: str, revision: str | None) -> dict[str, float]:
    """The shift settings of the model's own scheduler (for timestep_sampling: shift)."""
    out = dict(SCHEDULER_DEFAULTS)
    try:
        from diffusers import FlowMatchEulerDiscreteScheduler

        conf = FlowMatchEulerDiscreteScheduler.load_config(path, subfolder="scheduler", revision=revision)
        out.update({k: conf[k] for k in SCHEDULER_DEFAULTS if conf.get(k) is not None})
    except (OSError, ValueError, json.JSONDecodeError):
        pass  # a transformer-only directory: FLUX.1's published settings
    return out
