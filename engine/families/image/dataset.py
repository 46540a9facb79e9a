"""The image families' data half: the scanned images (and held-out, regularisation images), their single-bucket
batch order, the cache-backed dataset (text embeddings padded with a mask), and the encoders that fill the cache
from an ImageModel's own pipeline."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from engine.config.job import JobConfig
from engine.families.image.model import ImageModel
from engine.training.dtypes import pick_device, torch_dtype


def scan_images(cfg: JobConfig, log, workdir: Path | None = None) -> tuple[list, list, int]:
    """(records, items, n_train): the image records of data.path trained on and their (image, bucket) items, one
    per resolution, with their loss masks (data.masks); then the regularisation images' items
    (data.regularisation; engine/data/image_sets.py); then, after the first n_train, data.validation's items (a
    fraction of whole images held out by seed, or the images of its own path). With `workdir`, near-duplicates
    are handled (data.dedupe) and captions written first (data.captions; engine/captioning/)."""
    from engine.data.image_sets import regularisation_items, training_masks
    from engine.data.images import make_items, scan
    from engine.registry.families import spatial_multiple
    from engine.training.heldout import holdout

    records = scan(Path(cfg.data.path), cfg.data.caption_ext, cfg.data.trigger, log)
    if workdir is not None:
        from engine.captioning.dedupe import dedupe_records
        from engine.captioning.stage import caption_records

        records = caption_records(cfg, dedupe_records(cfg.data.dedupe_mode, records, log), workdir, log)
    masks = training_masks(cfg, records, log)
    controls = None
    if cfg.data.control_path is not None:  # edit pairs, checked again here as at submit (before anything is cached)
        from engine.config.controls import pair_controls

        controls = pair_controls(Path(cfg.data.path), {r.rel: (r.width, r.height) for r in records},
                                 cfg.data.control_paths())
    held, held_masks = [], masks
    val = cfg.data.validation
    if val is not None and val.fraction is not None:  # whole images are held out, every resolution of each
        train, held_i = holdout(len(records), val.fraction, cfg.train.seed)
        records, held = [records[i] for i in train], [records[i] for i in held_i]
    elif val is not None:  # a folder of its own: no masks (the training masks stay with the training images)
        held, held_masks = scan(Path(val.path), cfg.data.caption_ext, cfg.data.trigger, log), None
    multiple = spatial_multiple(cfg.model.family, cfg.model.path)
    items = make_items(records, cfg.data.resolution, masks, controls=controls, multiple=multiple)
    items += regularisation_items(cfg, log)
    n_train = len(items)
    return records, items + make_items(held, cfg.data.resolution, held_masks, controls=controls,
                                       multiple=multiple), n_train


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
        for j in range(len(self.plan.item_controls[indices[0]]) if self.plan.item_controls else 0):
            # an edit pair's control latents of slot j (at the target's bucket, so one size in a batch)
            ctl = [self.cache.load(self.plan.item_controls[i][j]) for i in indices]
            batch[f"control_{j}"] = torch.stack([x["latent"] for x in ctl])
            if "latent_flip" in ctl[0]:
                batch[f"control_{j}_flip"] = torch.stack([x["latent_flip"] for x in ctl])
        return lat, batch


class ImageDataset(CachedImages):
    """The ImageFamily batches: text embeddings padded to the batch's longest, with a mask; and the masks, loss
    weights and DOP class prompts of the job's quality features (engine/data/image_sets.py)."""

    # While compiling, for a family whose transformer masks padded text (ImageData.bound_shapes): the batch's text
    # length rounded up to a multiple of this, so that captions fall on a few lengths, not one compile each.
    text_multiple = 1

    def collate(self, indices: list[int]) -> dict[str, Any]:
        from engine.data.image_sets import extra_batch

        lat, batch = self.latents(indices)
        entries = [self.cache.load(self.plan.item_text[i]) for i in indices]
        # An edit pair's own "" (with its controls) for caption dropout, else the one empty caption.
        empties = [self.cache.load(self.plan.item_empty_text[i]) for i in indices] if self.plan.item_empty_text \
            else [self.empty]
        length = max(e["prompt_embeds"].shape[0] for e in entries + empties)
        length = -(-length // self.text_multiple) * self.text_multiple
        for name, group in (("", entries), ("empty_", empties)):
            batch[f"{name}prompt_embeds"], batch[f"{name}prompt_mask"] = pad_texts(
                [e["prompt_embeds"] for e in group], length)
            if "prompt_embeds_flip" in group[0]:  # encoded with the mirrored controls: as long as the other
                batch[f"{name}prompt_embeds_flip"] = pad_texts([e["prompt_embeds_flip"] for e in group], length)[0]
        batch.update(extra_batch(self.items, self.cache, self.plan, indices, lat, self.texts))
        return batch

    @staticmethod
    def texts(entries: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Cached text entries as a batch: padded to the longest, with the mask of real tokens."""
        embeds = [e["prompt_embeds"] for e in entries]
        padded, mask = pad_texts(embeds, max(t.shape[0] for t in embeds))
        return {"prompt_embeds": padded, "prompt_mask": mask}


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
    n_train: int | None = None  # items[:n_train] are trained on, the rest are data.validation's; None: all

    def build_dataset(self, cfg: JobConfig, workdir: Path, log):
        if self.cache is None:
            self.prepare(cfg, workdir, log)
        order = bucket_order(cfg, self.records, self.items, log, self.n_train)
        self.dataset = self.dataset_class(self.items, order, self.cache, self.plan)
        return self.dataset

    def bound_shapes(self, multiple: int) -> bool:
        """Pad text to multiples of `multiple` tokens while compiling, where the model's `text_masked` says its
        attention masks padded tokens out (Qwen-Image); True when it does. Elsewhere padding would change what
        the model computes (FLUX's text is fixed-length already), and automatic dynamic shapes bound the compiles."""
        if not getattr(getattr(self, "model", None), "text_masked", False) or self.dataset is None:
            return False
        self.dataset.text_multiple = multiple
        return True

    def dataset_hash(self) -> str:
        from engine.data.images import dataset_hash

        if not self.records:
            return ""
        # An edit job's controls are part of what it trained on (a job without them keeps its hash).
        controls = {it.record.rel: it.controls for it in self.items or [] if it.controls}
        return dataset_hash(self.records, controls)

    def validation_set(self, cfg: JobConfig, workdir: Path, log):
        """The held-out (or data.validation.path) items, which prepare cached after the training items."""
        from engine.training.heldout import ValidationSet

        return ValidationSet(self.dataset, list(range(self.n_train, len(self.items))))

    def validation_loss(self, model, dataset: CachedImages, indices: list[int], seed: int, device) -> torch.Tensor:
        """One sample at a time: each with its own fixed noise and σ, and samples of a batch may differ in bucket."""
        from engine.training.heldout import sample_generator, to_device

        losses = [self.loss(model, to_device(dataset.collate([i]), device), sample_generator(seed, i), evaluate=True)
                  for i in indices]
        return torch.stack(losses).mean()

    def export_meta(self, cfg: JobConfig, meta: dict[str, Any]) -> dict[str, Any]:
        """The export metadata with what the data adds: the trigger and the dataset hash."""
        return {**meta, "trigger": cfg.data.trigger or "", "dataset_hash": self.dataset_hash()}


def pipeline_components(config: dict[str, Any]) -> list[str]:
    """The component names of a model_index.json: entries naming [library, class]. The others are the pipeline's
    own settings (Krea 2's patch_size, text_encoder_select_layers), which must keep their values."""
    return [k for k, v in config.items() if not k.startswith("_") and isinstance(v, (list, tuple)) and len(v) == 2
            and all(x is None or isinstance(x, str) for x in v)]


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
        own = getattr(self.model, "load_pipeline", None)  # a model whose pipeline is not a DiffusionPipeline (FLUX.3)
        if own is not None:
            return own(self.model_path, rev, torch_dtype(self.cfg.model.dtype), keep)
        components = DiffusionPipeline.load_config(self.model_path, revision=rev)
        components = pipeline_components(components)
        drop = {k: None for k in components if not k.startswith(("scheduler", *keep))}
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
        def encode(payload) -> dict[str, torch.Tensor]:
            if isinstance(payload, str):
                out = self.model.encode_text(pipe, payload, max_len, device)  # HunyuanVideo: several tensors, by name
                return out if isinstance(out, dict) else {"prompt_embeds": out}
            from engine.families.image.edit import control_images

            text, item, flip = payload  # an edit pair's instruction, with its controls (and mirrored: data.flip)
            return {name: self.model.encode_text(pipe, text, max_len, device, images=control_images(item, flipped))
                    for name, flipped in [("prompt_embeds", False)] + ([("prompt_embeds_flip", True)] if flip else [])}

        return encode
