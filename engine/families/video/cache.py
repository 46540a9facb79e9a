"""What a video family caches: one latent per window of a clip (engine/data/videos.py), on the image families'
cache (engine/families/image/cache.py: the same plan, text entries and store; only the latents differ).

    cache/latent-KEY-SHA.safetensors   latent [C, F', h, w] (+ latent_flip with data.flip)

A window's key covers the clip's bytes, the window (start, frames), data.fps, the bucket, the flip flag, the
model and dtype: an edited caption re-encodes only that caption (its text entry), a new clip only its windows.

A clip that breaks while its windows are decoded (a truncated file that still probed whole) is skipped: a
`clip_skipped` warning names it and says why, no entry is written for the window (an entry commits only after
its tensors are complete), and the dataset leaves the window out (VideoFamily.prepare). The next attempt tries
it again and skips it the same way, so the data order stays a pure function of the inputs.
"""

from __future__ import annotations

import functools

import torch

from engine.data.videos import ClipUnreadable, VideoItem, read_window
from engine.families.image import cache as image_cache
from engine.storage import cache as store


def window_key(item: VideoItem, flip: bool, mid: str, dtype: str, fps: float) -> str:
    frames, w, h = item.bucket
    return store.content_key(kind="latent", clip=item.record.sha256, start=item.start, frames=frames, fps=fps,
                             bucket=[w, h], flip=flip, model=mid, dtype=dtype)


def window_need(fps: float):
    def need(item: VideoItem, mid: str, dtype: str, flip: bool) -> tuple[str, store.Need]:
        k = window_key(item, flip, mid, dtype, fps)
        f, w, h = item.bucket
        return k, store.Need(k, f"{item.record.rel}@{f}x{w}x{h}+{item.start}", (item, flip), label=item.record.rel)
    return need


def readable_windows(todo: list[store.Need], fps: float, log):
    """(need, item, flip, frames [3, F, H, W] in [-1, 1]) for each needed window whose clip decodes; a clip that
    breaks is skipped with a reason (the module's docstring)."""
    for need in todo:
        item, flip = need.payload
        try:
            x = read_window(item, fps)
        except ClipUnreadable as e:
            log.warning("clip_skipped", file=item.record.rel, start=item.start, frames=item.bucket[0], reason=str(e),
                        message=f"data.path: {item.record.rel} {e}; its window at frame {item.start} is left out")
            continue
        yield need, item, flip, x


def encode_windows(todo: list[store.Need], done: store.Done, *, open_encoder, dtype: torch.dtype, fps: float,
                   log) -> None:
    """Each needed window through the video encoder ([1, 3, F, H, W] in [-1, 1] → [C, F', h, w])."""
    encode = None
    for need, _item, flip, x in readable_windows(todo, fps, log):
        encode = encode or open_encoder()  # the VAE loads only once a window is readable
        with torch.no_grad():
            out = {"latent": encode(x[None]).to(dtype)}
            if flip:
                out["latent_flip"] = encode(x.flip(-1)[None]).to(dtype)
        done(need, out)


def fill_video_cache(cfg, items: list[VideoItem], workdir, model_path: str, log, *, max_len: int,
                     open_video_encoder, open_text_encoder, bar=None):
    """(cache, plan, report): image_cache.fill_cache with windows for latents."""
    return image_cache.fill_cache(
        cfg, items, workdir, model_path, log, max_len=max_len, open_image_encoder=open_video_encoder,
        open_text_encoder=open_text_encoder, bar=bar, latent_need=window_need(cfg.data.fps),
        encode_latents=functools.partial(encode_windows, fps=cfg.data.fps, log=log))
