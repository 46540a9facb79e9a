"""What an image LoRA job trains on besides its images and captions: loss masks and regularisation images.

`training_masks` finds each training image's mask (engine/data/masks.py);
`regularisation_items` reads data.regularisation's folder (its own captions,
no trigger added, no masks) into items that carry the folder's loss weight and
repeats, so engine.data.images.BucketOrder mixes them into the same
deterministic order (a pure function of seed and position); `extra_batch` adds
their per-sample tensors (masks, loss weights, DOP class-prompt embeddings) to
a collated batch. Shared by the image families.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from engine.config.job import JobConfig
from engine.data.images import ImageRecord, Item, MaskSource, make_items, scan
from engine.registry.families import spatial_multiple


def training_masks(cfg: JobConfig, records: list[ImageRecord], log) -> dict[str, MaskSource] | None:
    if cfg.data.masks is None:
        return None
    from engine.data.masks import find_masks

    path = Path(cfg.data.masks.path) if cfg.data.masks.path is not None else None
    return find_masks(records, path, cfg.data.masks.alpha, log)


def regularisation_items(cfg: JobConfig, log) -> list[Item]:
    reg = cfg.data.regularisation
    if reg is None:
        return []
    records = scan(Path(reg.path), cfg.data.caption_ext, None, log)
    return make_items(records, cfg.data.resolution, None, loss_weight=reg.weight, repeats=reg.repeats,
                      multiple=spatial_multiple(cfg.model.family, cfg.model.path))


def extra_batch(items: list[Item], cache, plan, indices: list[int], latents: list[dict[str, torch.Tensor]],
                texts: Callable[[list[dict[str, torch.Tensor]]], dict[str, torch.Tensor]]) -> dict[str, Any]:
    """Masks (all-ones for an unmasked sample), loss weights and DOP class prompts, where the job has them.

    `texts` batches cached text entries the family's way (FLUX.1 stacks T5 and CLIP; the others pad to the
    longest with a mask); each of its keys K comes back as class_K."""
    out: dict[str, Any] = {}
    picked = [items[i] for i in indices]
    if any(it.mask is not None for it in picked):
        for name, src in (("masks", "mask"), ("masks_flip", "mask_flip")):
            if src == "mask_flip" and "latent_flip" not in latents[0]:
                continue
            out[name] = torch.stack([x[src] if src in x else torch.ones(x["latent"].shape[-2:]) for x in latents])
    if any(it.loss_weight != 1.0 for it in items):
        out["loss_weight"] = torch.tensor([it.loss_weight for it in picked], dtype=torch.float32)
    if plan.item_class_text is not None:
        txt = texts([cache.load(plan.item_class_text[i]) for i in indices])
        out.update({f"class_{k}": v for k, v in txt.items()})
    return out
