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
- the loss: rectified flow, as in engine/families/image/flux.py's docstring —
  x_σ = (1 − σ)·x0 + σ·ε, target ε − x0, a plain MSE on the packed tokens —
  with every random draw (flip, caption dropout, noise, σ) from the
  checkpointed generator, in that order;
- σ sampling (train.timestep_sampling): `sigmoid` (logit-normal), `linear`
  (uniform), or `shift`: uniform t moved by the exponential time shift of the
  model's own scheduler, σ = e^μ / (e^μ + 1/t − 1), with μ the
  resolution-dependent value the model's pipeline computes at inference
  (ImageModel.shift_mu); train.timestep_bias reweights any of the three;
- LoRA (peft through diffusers' `add_adapter`), fp8 base, block swapping and
  gradient checkpointing; samples on their own RNG (engine/families/image/sample.py).

The model part (ImageModel) is what differs: which pipeline encodes images and
prompts, how latents are packed into tokens with their position ids, the
default LoRA targets and the export key maps.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Protocol

import torch

from engine.builtin.models import resolve_model_path
from engine.config.job import JobConfig
from engine.errors import JobInvalid
from engine.frozen_base.blockswap import place_model
from engine.frozen_base.precision import apply_base_precision, quantization_config
from engine.frozen_base.precision import resolve as resolve_precision
from engine.report.quiet import quiet_libraries
from engine.training.adapters import adapter_layers, check_base_precision, peft_config, set_adapter_dtype
from engine.training.dtypes import pick_device, torch_dtype


class ImageModel(Protocol):
    """What one image model contributes to an ImageFamily (engine/families/image/flux2.py, qwen_image.py)."""

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
        """[B, C, h, w] latents → the transformer's token layout (to compare targets with predictions)."""

    def sample_kwargs(self, emb: dict[str, torch.Tensor], empty: dict[str, torch.Tensor], device, dtype,
                      cfg: JobConfig) -> dict[str, Any]: ...

    def export(self, model, cfg: JobConfig, out_dir: Path, meta: dict[str, Any]) -> list[str]: ...


def sample_sigmas(kind: str, batch: int, shift: float, generator: torch.Generator, bias=None) -> torch.Tensor:
    """Noise levels σ in [0, 1] for one batch (module docstring: sigmoid, linear, or shift by `shift` = e^μ, the
    model's own resolution-dependent factor; unused by the other two kinds).

    `bias` (train.timestep_bias) reweights the density (engine/families/image/timestep_bias.py); balanced leaves it alone.
    """
    if bias is not None and bias.strategy != "balanced":
        from engine.families.image.timestep_bias import sample_biased

        return sample_biased(kind, batch, shift if kind == "shift" else 1.0, bias.strategy, bias.multiplier,
                             bias.begin, bias.end, generator)
    if kind == "sigmoid":
        return torch.sigmoid(torch.randn(batch, generator=generator))
    t = torch.rand(batch, generator=generator)
    if kind == "linear":
        return t
    return shift * t / (shift * t + (1 - t))


def flip_and_drop(batch: dict[str, Any], cfg: JobConfig, generator: torch.Generator, conds: tuple[str, ...],
                  draw: bool = True):
    """(latents, flip, conditions) of a batch with the two data draws, in this order, from `generator`:
    data.flip per sample (the mirrored latents where drawn; flip is None without data.flip), then caption
    dropout per sample (each condition NAME replaced by the batch's `empty_NAME` where drawn). draw=False (a
    validation loss): neither, the sample as it is."""
    x0 = batch["latents"]
    b, device = x0.shape[0], x0.device
    flip = None
    if "latents_flip" in batch and draw:
        flip = (torch.rand(b, generator=generator) < 0.5).to(device)
        x0 = torch.where(flip[:, None, None, None], batch["latents_flip"], x0)
    out = {k: batch[k] for k in conds}
    if cfg.data.caption_dropout > 0 and draw:
        drop = (torch.rand(b, generator=generator) < cfg.data.caption_dropout).to(device)
        out = {k: torch.where(drop.view(b, *[1] * (v.dim() - 1)), batch[f"empty_{k}"].expand_as(v), v)
               for k, v in out.items()}
    return x0, flip, out


def add_lora(transformer: torch.nn.Module, cfg: JobConfig, default_targets: str) -> torch.nn.Module:
    """Freeze the transformer and add the peft adapter of lora.type (named "default") with diffusers' add_adapter."""
    transformer.requires_grad_(False)
    lcfg = peft_config(cfg.lora, cfg.lora.targets if cfg.lora.targets is not None else default_targets)
    try:
        transformer.add_adapter(lcfg)
    except ValueError as e:
        raise JobInvalid(f"lora.targets: {e}".splitlines()[0]) from None
    return transformer


def load_lora_transformer(model_cls: type, path: str, cfg: JobConfig, device: torch.device, log, *, fp8_skip: str,
                          default_targets: str) -> torch.nn.Module:
    """A diffusers transformer from `path`, frozen in its base precision, with LoRA, placed for block swapping.

    base_precision nf4/int8: bitsandbytes quantises while loading (diffusers' BitsAndBytesConfig; CUDA only).
    fp8: the frozen linears become FP8 layers before peft wraps them (engine/frozen_base/precision.py), each quantised on
    the device as it moves there, so the bf16 transformer is never on the GPU whole. After LoRA, the model is
    placed: the swapped blocks' frozen weights stay in host memory (engine/frozen_base/blockswap.py) and their adapters
    (created next to them) move to the device.
    """
    dtype = torch_dtype(cfg.model.dtype)
    precision, _ = resolve_precision(cfg.model.effective_base_precision, device)
    check_base_precision(cfg.lora, precision)
    qconf = quantization_config(precision, dtype, library="diffusers")
    kwargs = {"quantization_config": qconf} if qconf is not None else {}
    try:
        transformer = model_cls.from_pretrained(path, subfolder="transformer", revision=cfg.model.revision,
                                                dtype=dtype, **kwargs)
    except RuntimeError as e:
        if qconf is None or "GPU" not in str(e):
            raise
        raise JobInvalid(f"model.base_precision: {precision} needs a CUDA GPU (bitsandbytes); "
                         "use fp8 or bf16 on this machine") from None
    if qconf is not None:
        from peft import prepare_model_for_kbit_training

        transformer = prepare_model_for_kbit_training(transformer, use_gradient_checkpointing=False)
    swap = cfg.train.blocks_to_swap
    apply_base_precision(transformer, cfg.model.effective_base_precision, device, log, compute_dtype=dtype, skip=fp8_skip,
                         blocks_to_swap=swap)
    if cfg.train.gradient_checkpointing:
        transformer.enable_gradient_checkpointing()
    add_lora(transformer, cfg, default_targets)
    set_adapter_dtype(transformer, cfg.lora.dtype)  # fp32 by default over any base (engine/training/adapters.py)
    if qconf is None:
        place_model(transformer, device, swap)
    n = sum(p.numel() for p in transformer.parameters() if p.requires_grad)
    log.info("lora", trainable_params=n, modules=len(adapter_layers(transformer)), type=cfg.lora.type)
    return transformer


def scan_images(cfg: JobConfig, log) -> tuple[list, list, int]:
    """(records, items, n_train): the image records of data.path trained on and their (image, bucket) items, one
    per resolution, with their loss masks (data.masks); then the regularisation images' items
    (data.regularisation; engine/data/image_sets.py); then, after the first n_train, data.validation's items (a
    fraction of whole images held out by seed, or the images of its own path)."""
    from engine.data.image_sets import regularisation_items, training_masks
    from engine.data.images import make_items, scan
    from engine.training.heldout import holdout

    records = scan(Path(cfg.data.path), cfg.data.caption_ext, cfg.data.trigger, log)
    masks = training_masks(cfg, records, log)
    held = []
    val = cfg.data.validation
    if val is not None and val.fraction is not None:  # whole images are held out, every resolution of each
        train, held_i = holdout(len(records), val.fraction, cfg.train.seed)
        records, held = [records[i] for i in train], [records[i] for i in held_i]
    elif val is not None:
        held, masks = scan(Path(val.path), cfg.data.caption_ext, cfg.data.trigger, log), None
    items = make_items(records, cfg.data.resolution, masks) + regularisation_items(cfg, log)
    n_train = len(items)
    return records, items + make_items(held, cfg.data.resolution, masks), n_train


def bucket_order(cfg: JobConfig, records: list, items: list, log, n_train: int | None = None):
    """The single-bucket batch order of the first n_train items (all when None; the rest are validation items),
    logged as the dataset."""
    from engine.data.images import BucketOrder

    n = len(items) if n_train is None else n_train
    order = BucketOrder(items[:n], cfg.train.batch_size, cfg.data.repeats, cfg.train.seed)
    buckets = sorted({f"{it.bucket[0]}x{it.bucket[1]}" for it in items})
    log.info("dataset", images=len(records), samples_per_epoch=len(order), buckets=buckets,
             captions_missing=sum(r.caption_missing for r in records), masks=sum(it.mask is not None for it in items),
             regularisation=sum(it.repeats is not None for it in items), validation=len(items) - n)
    return order


def scheduler_settings(path: str, revision: str | None) -> dict[str, Any]:
    """The model's own scheduler config (its shift settings drive timestep_sampling: shift)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    try:
        return dict(FlowMatchEulerDiscreteScheduler.load_config(path, subfolder="scheduler", revision=revision))
    except (OSError, ValueError, json.JSONDecodeError):
        return {}  # a transformer-only directory: the pipeline's defaults


class CachedImages:
    """An image family's dataset: items backed by the cache, in single-bucket batches (the BucketOrder)."""

    def __init__(self, items, order, cache, plan):
        self.items, self.order, self.cache, self.plan = items, order, cache, plan
        self.empty = cache.load(plan.empty_text)

    def __len__(self) -> int:
        return len(self.order)

    def indices_at(self, seed: int, start: int, count: int) -> list[int]:
        return self.order.indices_at(seed, start, count)

    def latents(self, indices: list[int]) -> tuple[list[dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
        """The cache entries of these items' latents, and the batch's `latents` (and `latents_flip`)."""
        lat = [self.cache.load(self.plan.item_latent[i]) for i in indices]
        batch = {"latents": torch.stack([x["latent"] for x in lat])}
        if "latent_flip" in lat[0]:
            batch["latents_flip"] = torch.stack([x["latent_flip"] for x in lat])
        return lat, batch


class ImageDataset(CachedImages):
    """FLUX.2 and Qwen-Image batches: text embeddings padded to the batch's longest, with a mask."""

    def collate(self, indices: list[int]) -> dict[str, Any]:
        _lat, batch = self.latents(indices)
        texts = [self.cache.load(self.plan.item_text[i])["prompt_embeds"] for i in indices]
        length = max(max(t.shape[0] for t in texts), self.empty["prompt_embeds"].shape[0])
        embeds, mask = pad_texts(texts, length)
        empty, empty_mask = pad_texts([self.empty["prompt_embeds"]], length)
        return {**batch, "prompt_embeds": embeds, "prompt_mask": mask, "empty_prompt_embeds": empty,
                "empty_prompt_mask": empty_mask}


def pad_texts(texts: list[torch.Tensor], length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[L_i, D] embeddings → [B, length, D] zero-padded, and the [B, length] mask of real tokens."""
    out = texts[0].new_zeros(len(texts), length, texts[0].shape[1])
    mask = torch.zeros(len(texts), length, dtype=torch.long)
    for i, t in enumerate(texts):
        out[i, : t.shape[0]] = t
        mask[i, : t.shape[0]] = 1
    return out, mask


class ImageData:
    """The data half every image family shares (FLUX.1's Flux too): the scanned images, their cache and plan, the
    bucketed dataset built on them (of the family's `dataset_class`), and the dataset hash an export records."""

    dataset_class: type
    cache = plan = items = records = report = dataset = None
    n_train: int | None = None  # items[:n_train] are trained on, the rest are data.validation's (FLUX.1); None: all

    def build_dataset(self, cfg: JobConfig, workdir: Path, log):
        if self.cache is None:
            self.prepare(cfg, workdir, log)
        order = bucket_order(cfg, self.records, self.items, log, self.n_train)
        self.dataset = self.dataset_class(self.items, order, self.cache, self.plan)
        return self.dataset

    def dataset_hash(self) -> str:
        from engine.data.images import dataset_hash

        return dataset_hash(self.records) if self.records else ""

    def export_meta(self, cfg: JobConfig, meta: dict[str, Any]) -> dict[str, Any]:
        """The export metadata with what the data adds: the trigger and the dataset hash."""
        return {**meta, "trigger": cfg.data.trigger or "", "dataset_hash": self.dataset_hash()}


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
        self.records, self.items, self.n_train = scan_images(cfg, log)
        enc = PipelineEncoder(self.model, path, cfg)
        self.cache, self.plan, self.report = fill_cache(
            cfg, self.items, workdir, path, log, bar=bar, max_len=self.model.text_max_len(path, cfg.model.revision),
            open_image_encoder=enc.image_encoder, open_text_encoder=enc.text_encoder)

    # ---------------------------------------------------------------- model
    def load_model(self, cfg: JobConfig, workdir: Path, device: torch.device, log) -> torch.nn.Module:
        self.cfg = cfg
        path = resolve_model_path(cfg.model.path, workdir)
        self.sched = scheduler_settings(path, cfg.model.revision)
        return load_lora_transformer(self.model.transformer_class(), path, cfg, device, log,
                                     fp8_skip=self.model.fp8_skip, default_targets=self.model.default_targets)

    def loss(self, model: torch.nn.Module, batch: dict[str, Any], generator: torch.Generator) -> torch.Tensor:
        cfg = self.cfg
        # Every random draw comes from `generator` (checkpointed), in a fixed order: flip, dropout, noise, σ.
        x0, _flip, text = flip_and_drop(batch, cfg, generator, ("prompt_embeds", "prompt_mask"))
        embeds, mask = text["prompt_embeds"], text["prompt_mask"]
        device = x0.device
        b, _c, h, w = x0.shape
        noise = torch.randn(x0.shape, generator=generator).to(device)
        shift = math.exp(self.model.shift_mu(self.sched, (h // 2) * (w // 2))) \
            if cfg.train.timestep_sampling == "shift" else 1.0
        sigma = sample_sigmas(cfg.train.timestep_sampling, b, shift, generator, cfg.train.timestep_bias).to(device)
        x0, noise = x0.float(), noise.float()
        s = sigma[:, None, None, None]
        x_t = (1 - s) * x0 + s * noise
        # Under DDP (several processes) the forward goes through the wrapper, the config is the inner model's.
        pred = self.model.predict(model, getattr(model, "module", model), x_t, sigma, embeds, mask, cfg)
        return torch.nn.functional.mse_loss(pred.float(), self.model.pack(noise - x0))

    # ---------------------------------------------------------------- samples and export
    def on_step_end(self, model: torch.nn.Module, step: int, cfg: JobConfig, workdir: Path, log) -> None:
        from engine.families.image.sample import SampleRenderer, sample_due

        if not sample_due(cfg, step):
            return
        if self.renderer is None:
            path = resolve_model_path(cfg.model.path, workdir)
            empty = self.cache.load(self.plan.empty_text)
            self.renderer = SampleRenderer(
                cfg, path, self.cache, self.plan, Path(workdir),
                pipeline=lambda t: sample_pipeline(path, cfg, t),
                prompt_kwargs=lambda emb, dev, dt: self.model.sample_kwargs(emb, empty, dev, dt, cfg))
        self.renderer.render(model, step, log)

    def export(self, model: torch.nn.Module, cfg: JobConfig, out_dir: Path, meta: dict[str, Any]) -> list[str]:
        return self.model.export(model, cfg, Path(out_dir), self.export_meta(cfg, meta))


def sample_pipeline(model_path: str, cfg: JobConfig, transformer):
    """The model's own pipeline with the training transformer and no text encoder (prompts come from the cache)."""
    from diffusers import DiffusionPipeline

    components = DiffusionPipeline.load_config(model_path, revision=cfg.model.revision)
    text_parts = {k: None for k in components if k.startswith(("text_encoder", "tokenizer", "processor"))}
    pipe = DiffusionPipeline.from_pretrained(model_path, revision=cfg.model.revision, transformer=transformer,
                                             dtype=torch_dtype(cfg.model.dtype), **text_parts)
    pipe.vae.to(transformer.device)
    return pipe


class PipelineEncoder:
    """The cache's encoders (engine/families/image/cache.py) for an ImageModel: its own pipeline, no transformer.

    The VAE-only pipeline (for images) and the text-only one (for captions) are opened one after the other
    and dropped by the cache before the transformer loads.
    """

    def __init__(self, model: ImageModel, model_path: str, cfg: JobConfig):
        self.model, self.model_path, self.cfg = model, model_path, cfg

    def _pipeline(self, keep: tuple[str, ...]):
        from diffusers import DiffusionPipeline

        rev = self.cfg.model.revision
        components = DiffusionPipeline.load_config(self.model_path, revision=rev)
        drop = {k: None for k in components if not k.startswith(("_", "scheduler", *keep))}
        return DiffusionPipeline.from_pretrained(self.model_path, revision=rev, dtype=torch_dtype(self.cfg.model.dtype),
                                                 **drop)

    def image_encoder(self):
        device = pick_device()
        pipe = self._pipeline(("vae",))
        pipe.vae.to(device).eval()
        return lambda x: self.model.encode_latents(pipe, x.to(device, pipe.vae.dtype))

    def text_encoder(self):
        device = pick_device()
        max_len = self.model.text_max_len(self.model_path, self.cfg.model.revision)
        pipe = self._pipeline(("text_encoder", "tokenizer", "processor"))
        encoders = [getattr(pipe, n) for n in pipe.components
                    if n.startswith("text_encoder") and getattr(pipe, n, None) is not None]
        need = sum(p.numel() * p.element_size() for e in encoders for p in e.parameters())
        if device.type == "cuda" and need > 0.9 * torch.cuda.mem_get_info(device)[0]:
            # An encoder larger than the card (FLUX.2-dev's 24 B Mistral: 48 GB in bf16) streams its layers from
            # host RAM through diffusers' sequential offload: slow, but once per caption, and then cached.
            pipe.enable_sequential_cpu_offload(device=device)
        else:
            for e in encoders:
                e.to(device)
        return lambda text: {"prompt_embeds": self.model.encode_text(pipe, text, max_len, device)}
