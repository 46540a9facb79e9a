"""What the Flux family caches before training, and how it encodes it (on the store in engine/cache.py).

Training a Flux LoRA never needs the VAE encoder, CLIP or T5 at step time:
every image is encoded once per bucket to VAE latents, and every caption (and
the empty caption used for caption dropout, and every sample prompt) once to
T5 sequence embeddings + the CLIP pooled embedding. Then the encoders are
freed.

    cache/latent-KEY.safetensors   latent [C, h, w] (+ latent_flip with data.flip), scaled and shifted
    cache/text-KEY.safetensors     prompt_embeds [L, D] (T5), pooled [D'] (CLIP)

A latent's key covers the image bytes, the bucket, the flip flag, the model
(path@revision) and dtype; a text's the final caption text, the model, the T5
length and dtype. So an edited caption re-encodes that caption only, a new
image only that image, a new bucket list only what moved.

Latents are the VAE posterior mean, `(mean - shift_factor) * scaling_factor`,
as the Flux pipeline expects them; sampling the posterior would add noise
that flow matching adds anyway. Texts go through the pipeline's own
`encode_prompt`, so cached embeddings are exactly what inference computes.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from engine import cache as store
from engine.config import JobConfig
from engine.data.images import Item, load_for_bucket
from engine.dtypes import pick_device, torch_dtype
from engine.fsio import FileLayer


def model_id(cfg: JobConfig, model_path: str) -> str:
    return f"{model_path}@{cfg.model.revision or 'main'}"


def latent_key(item: Item, flip: bool, mid: str, dtype: str) -> str:
    # The mask (data.masks) is cached with the latent; without one the key is what it always was.
    mask = {} if item.mask is None else {"mask": item.mask.sha256}
    return store.content_key(kind="latent", image=item.record.sha256, bucket=list(item.bucket), flip=flip, model=mid,
                             dtype=dtype, **mask)


def text_key(text: str, mid: str, max_len: int, dtype: str) -> str:
    return store.content_key(kind="text", text=text, model=mid, max_len=max_len, dtype=dtype)


def t5_length(model_path: str, revision: str | None) -> int:
    """T5 tokens per caption: what the pipeline uses (512 for dev), capped by the tokenizer's own limit."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path, subfolder="tokenizer_2", revision=revision)
    limit = getattr(tok, "model_max_length", 512) or 512
    return int(min(512, limit))


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


def plan(cfg: JobConfig, items: list[Item], model_path: str, max_len: int) -> Plan:
    mid, dt = model_id(cfg, model_path), cfg.model.dtype
    latents: dict[str, store.Need] = {}
    texts: dict[str, store.Need] = {}

    def need_text(text: str) -> str:
        k = text_key(text, mid, max_len, dt)
        texts.setdefault(k, store.Need(k, text, text))
        return k

    item_latent, item_text = [], []
    for it in items:
        k = latent_key(it, cfg.data.flip, mid, dt)
        latents.setdefault(k, store.Need(k, f"{it.record.rel}@{it.bucket[0]}x{it.bucket[1]}", (it, cfg.data.flip),
                                         label=it.record.rel))
        item_latent.append(k)
        item_text.append(need_text(it.record.caption))
    empty = need_text("")
    prompts = [need_text(p) for p in cfg.sample.prompts]
    class_texts = None
    if cfg.train.dop is not None:
        from engine.dop import class_prompt

        class_texts = [need_text(class_prompt(it.record.caption, cfg.data.trigger, cfg.train.dop.preservation_class))
                       for it in items]
    return Plan(latents, texts, item_latent, item_text, empty, prompts, class_texts)


def encode_latents(todo: list[store.Need], done: store.Done, *, model_path: str, revision: str | None,
                   dtype: torch.dtype) -> None:
    import numpy as np
    from diffusers import AutoencoderKL

    device = pick_device()
    vae = AutoencoderKL.from_pretrained(model_path, subfolder="vae", revision=revision, dtype=dtype).to(device).eval()
    shift = vae.config.shift_factor or 0.0
    scale = vae.config.scaling_factor
    for need in todo:
        item, flip = need.payload
        out = {}
        for name, flipped in [("latent", False)] + ([("latent_flip", True)] if flip else []):
            im = load_for_bucket(item.record.path, item.bucket, flip=flipped)
            x = torch.from_numpy(np.asarray(im, dtype=np.float32).copy()).permute(2, 0, 1) / 127.5 - 1.0
            with torch.no_grad():
                mean = vae.encode(x[None].to(device, vae.dtype)).latent_dist.mean
            out[name] = ((mean - shift) * scale)[0].to(dtype)
            if item.mask is not None:  # data.masks: the mask on this latent's grid, stored beside it
                from engine.data.masks import mask_for_bucket

                suffix = name.removeprefix("latent")
                out["mask" + suffix] = mask_for_bucket(item.record, item.mask, item.bucket, flipped,
                                                       tuple(out[name].shape[-2:]))
        done(need, out)


def encode_texts(todo: list[store.Need], done: store.Done, *, model_path: str, revision: str | None,
                 dtype: torch.dtype, max_len: int) -> None:
    from diffusers import FluxPipeline

    device = pick_device()
    pipe = FluxPipeline.from_pretrained(model_path, transformer=None, vae=None, revision=revision, dtype=dtype)
    pipe.text_encoder.to(device)
    pipe.text_encoder_2.to(device)
    for need in todo:
        with torch.no_grad():
            embeds, pooled, _ids = pipe.encode_prompt(need.payload, prompt_2=None, device=device,
                                                      max_sequence_length=max_len)
        done(need, {"prompt_embeds": embeds[0], "pooled": pooled[0]})


def fill_cache(cfg: JobConfig, items: list[Item], workdir: Path, model_path: str, log, bar=None,
               fs: FileLayer | None = None) -> tuple[store.Cache, Plan, store.CacheReport]:
    """Make every latent and text embedding the job needs present and valid; encode only what is not."""
    max_len = t5_length(model_path, cfg.model.revision)
    p = plan(cfg, items, model_path, max_len)
    model = dict(model_path=model_path, revision=cfg.model.revision, dtype=torch_dtype(cfg.model.dtype))
    groups = [store.Group("latent", p.latents, functools.partial(encode_latents, **model)),
              store.Group("text", p.texts, functools.partial(encode_texts, **model, max_len=max_len))]
    cache, report = store.ensure(Path(workdir) / "cache", groups, log, bar=bar, fs=fs)
    return cache, p, report
