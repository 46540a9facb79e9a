"""What every image family caches before training, and the loop that fills it (on the store in engine/storage/cache.py).

Training an image LoRA never needs the VAE encoder or a text encoder at step
time: every image is encoded once per bucket to a latent, and every caption
(and the empty caption used for caption dropout, every sample prompt, and
train.dop's class captions) once to its prompt embedding. Then the encoders
are freed, before the transformer loads.

    cache/latent-KEY-SHA.safetensors   latent [C, h, w] (+ latent_flip with data.flip, + mask with data.masks)
    cache/text-KEY-SHA.safetensors     the family's prompt tensors (prompt_embeds [L, D], ...)
    cache/latent-KEY-SHA.safetensors   an edit pair's control latent [C, h, w] (+ latent_flip), per slot

in the home's shared cache (engine/storage/cache.py: HOME/cache for HOME/jobs/ID).

A latent's key covers the image bytes, the bucket, the flip flag, the mask,
the model (path@revision) and dtype; a text's the final caption text, the
model, the text length and dtype; an edit pair's control's the control's bytes (not its target's), the bucket,
the flip flag, the model and dtype. So an edited caption re-encodes that caption
only, a new image only that image, a new bucket list only what moved.

What differs per family is only how a [1, 3, H, W] image in [-1, 1] becomes a
latent and how a text becomes its tensors: the family passes those two
encoders (engine/families/image/flux_encode.py for FLUX.1, dataset.PipelineEncoder
for FLUX.2 and Qwen-Image).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.builtin.models import BUILTIN_PREFIX
from engine.config.job import JobConfig
from engine.data.images import Item, load_for_bucket
from engine.storage import cache as store
from engine.storage.fsio import FileLayer
from engine.training.dtypes import torch_dtype

# pixels [1, 3, H, W] in [-1, 1] -> the latent [C, h, w] the transformer trains on
PixelEncoder = Callable[[torch.Tensor], torch.Tensor]


def model_id(cfg: JobConfig, model_path: str) -> str:
    """The model in a cache key: builtin:NAME as named (every job builds the same weights in its own directory)."""
    name = cfg.model.path if cfg.model.path.startswith(BUILTIN_PREFIX) else model_path
    return f"{name}@{cfg.model.revision or 'main'}"


def latent_key(item: Item, flip: bool, mid: str, dtype: str) -> str:
    # The mask (data.masks) is cached with the latent; without one the key is what it always was.
    mask = {} if item.mask is None else {"mask": item.mask.sha256}
    return store.content_key(kind="latent", image=item.record.sha256, bucket=list(item.bucket), flip=flip, model=mid,
                             dtype=dtype, **mask)


def control_key(item: Item, slot: int, flip: bool, mid: str, dtype: str) -> str:
    # Its own content only (not its target's): editing one control re-encodes that control alone.
    return store.content_key(kind="control", image=item.controls[slot].sha256, bucket=list(item.bucket), flip=flip,
                             model=mid, dtype=dtype)


def text_key(text: str, mid: str, max_len: int, dtype: str, kind: str = "text") -> str:
    # kind: what the entry holds; "text" (the embeddings) keeps every key as it was
    return store.content_key(kind=kind, text=text, model=mid, max_len=max_len, dtype=dtype)


@dataclass
class Plan:
    """What the job needs from the cache: a latent per item (and bucket), a text embedding per distinct text."""

    latents: dict[str, store.Need]  # key -> need (payload: (item, flip))
    texts: dict[str, store.Need]    # key -> need (payload: the text)
    item_latent: list[str]          # per item index
    item_text: list[str]            # per item index
    empty_text: str                 # key of "" (caption dropout)
    prompt_texts: list[str]         # keys of sample.prompts, in order
    item_class_text: list[str] | None = None  # per item: its caption with the trigger → train.dop's class word
    negative_texts: list[str] = field(default_factory=list)  # keys of each sample prompt's negative prompt
    item_controls: list[tuple[str, ...]] = field(default_factory=list)  # per item: its control latents' keys
    item_empty_text: list[str] | None = None  # per item: "" with its controls (an edit text), for caption dropout


# (item, mid, dtype, flip) -> the latent's key and its need: the video families' windows bring their own
LatentNeed = Callable[[Item, str, str, bool], tuple[str, store.Need]]


def image_latent_need(it: Item, mid: str, dt: str, flip: bool) -> tuple[str, store.Need]:
    k = latent_key(it, flip, mid, dt)
    return k, store.Need(k, f"{it.record.rel}@{it.bucket[0]}x{it.bucket[1]}", (it, flip), label=it.record.rel)


def edit_text_key(text: str, item: Item, flip: bool, mid: str, max_len: int, dtype: str) -> str:
    # An instruction encoded with its controls (Qwen-Image-Edit): their bytes, not their bucket (the
    # vision-language encoder reads each control at its own size).
    return store.content_key(kind="edit_text", text=text, controls=[c.sha256 for c in item.controls], flip=flip,
                             model=mid, max_len=max_len, dtype=dtype)


def plan(cfg: JobConfig, items: list[Item], model_path: str, max_len: int,
         latent_need: LatentNeed = image_latent_need, text_sees_controls: bool = False,
         text_kind: str = "text") -> Plan:
    """text_sees_controls: the family encodes an edit pair's instruction with its control images (payload
    (text, item, flip); the entry holds prompt_embeds and, with data.flip, prompt_embeds_flip). text_kind: the
    kind of a text entry in its key, where a family caches something else than embeddings (SDXL's token ids when
    its text encoders train)."""
    mid, dt = model_id(cfg, model_path), cfg.model.dtype
    latents: dict[str, store.Need] = {}
    texts: dict[str, store.Need] = {}

    def need_text(text: str) -> str:
        k = text_key(text, mid, max_len, dt, text_kind)
        texts.setdefault(k, store.Need(k, text, text))
        return k

    def need_control(it: Item, slot: int) -> str:
        k = control_key(it, slot, cfg.data.flip, mid, dt)
        name = it.controls[slot].path.name
        latents.setdefault(k, store.Need(k, f"{name}@{it.bucket[0]}x{it.bucket[1]}", (it, cfg.data.flip, slot),
                                         label=f"control {name}"))
        return k

    def need_edit_text(text: str, it: Item) -> str:
        k = edit_text_key(text, it, cfg.data.flip, mid, max_len, dt)
        names = ", ".join(c.path.name for c in it.controls)
        texts.setdefault(k, store.Need(k, f"{text} | {names}", (text, it, cfg.data.flip)))
        return k

    item_latent, item_text, item_controls, item_empty = [], [], [], []
    for it in items:
        k, need = latent_need(it, mid, dt, cfg.data.flip)
        latents.setdefault(k, need)
        item_latent.append(k)
        edit = text_sees_controls and bool(it.controls)
        item_text.append(need_edit_text(it.record.caption, it) if edit else need_text(it.record.caption))
        item_empty.append(need_edit_text("", it) if edit else None)
        item_controls.append(tuple(need_control(it, j) for j in range(len(it.controls))))
    # An edit pipeline that reads every text with a control image has no plain "": the first pair's stands in.
    empty = item_empty[0] if item_empty and item_empty[0] else need_text("")
    entries = cfg.sample.entries()
    prompts = [need_text(p) for p, _neg, _seed in entries]
    negatives = [need_text(neg) for _p, neg, _seed in entries]
    class_texts = None
    if cfg.train.dop is not None:
        from engine.families.image.dop import class_prompt

        class_texts = [need_text(class_prompt(it.record.caption, cfg.data.trigger, cfg.train.dop.preservation_class))
                       for it in items]
    return Plan(latents, texts, item_latent, item_text, empty, prompts, class_texts, negatives, item_controls,
                item_empty if any(item_empty) else None)


def encode_images(todo: list[store.Need], done: store.Done, encode: PixelEncoder, dtype: torch.dtype) -> None:
    """Each needed image (and its mirror with data.flip) at its bucket through `encode`, with its mask if any; an
    edit pair's control (payload (item, flip, slot)) at its target's bucket, mirrored with it."""
    import numpy as np

    for need in todo:
        item, flip, *slot = need.payload
        path = item.controls[slot[0]].path if slot else item.record.path
        out = {}
        for name, flipped in [("latent", False)] + ([("latent_flip", True)] if flip else []):
            im = load_for_bucket(path, item.bucket, flip=flipped)
            x = torch.from_numpy(np.asarray(im, dtype=np.float32).copy()).permute(2, 0, 1) / 127.5 - 1.0
            with torch.no_grad():
                out[name] = encode(x[None]).to(dtype)
            if item.mask is not None and not slot:  # data.masks: the mask on this latent's grid, stored beside it
                from engine.data.masks import mask_for_bucket

                suffix = name.removeprefix("latent")
                out["mask" + suffix] = mask_for_bucket(item.record, item.mask, item.bucket, flipped,
                                                       tuple(out[name].shape[-2:]))
        done(need, out)


# open_*(): load the model part and return the function that encodes with it; dropped (and freed) when done.
ImageEncoderFactory = Callable[[], PixelEncoder]
TextEncoderFactory = Callable[[], Callable[[str], dict[str, torch.Tensor]]]


def _encode_latents(todo: list[store.Need], done: store.Done, *, open_encoder: ImageEncoderFactory,
                    dtype: torch.dtype) -> None:
    encode_images(todo, done, open_encoder(), dtype)


def _encode_texts(todo: list[store.Need], done: store.Done, *, open_encoder: TextEncoderFactory) -> None:
    encode = open_encoder()
    for need in todo:
        with torch.no_grad():
            done(need, encode(need.payload))


def fill_cache(cfg: JobConfig, items: list[Item], workdir: Path, model_path: str, log, *, max_len: int,
               open_image_encoder: ImageEncoderFactory, open_text_encoder: TextEncoderFactory, bar=None,
               fs: FileLayer | None = None, latent_need: LatentNeed = image_latent_need,
               encode_latents=_encode_latents,
               text_sees_controls: bool = False, text_kind: str = "text"
               ) -> tuple[store.Cache, Plan, store.CacheReport]:
    """Make every latent and text embedding the job needs present and valid; encode only what is not.

    The image encoder is opened only if a latent is missing, the text encoder only if a text is, each in turn,
    so the VAE and the text encoders are never in memory together (engine/storage/cache.py frees each after its group).
    latent_need and encode_latents: a video family's windows (engine/families/video/cache.py) instead of images.
    """
    p = plan(cfg, items, model_path, max_len, latent_need, text_sees_controls, text_kind)
    groups = [store.Group("latent", p.latents, functools.partial(encode_latents, open_encoder=open_image_encoder,
                                                                 dtype=torch_dtype(cfg.model.dtype))),
              store.Group("text", p.texts, functools.partial(_encode_texts, open_encoder=open_text_encoder))]
    cache, report = store.ensure(store.job_cache_dir(workdir, log), groups, log, bar=bar, fs=fs)
    return cache, p, report
