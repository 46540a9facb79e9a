"""Loss masks for image LoRA (data.masks): which latent pixels of each image the loss counts, and how much.

A mask is a grey image: white (1) trains, black (0) is ignored, grey weighs in
between. It comes either from a folder (`data.masks.path`) holding one mask
per training image under the same relative name with any image extension
(`photo-001.jpg` ↔ `masks/photo-001.png`), or from each image's own alpha
channel (`data.masks.alpha: true`). An image without a mask (no file, or no
alpha channel) trains everywhere, with a `mask_missing` warning.

The mask gets the image's own resize and centre crop to its bucket (and the
mirror for flipped samples), then is averaged over each latent pixel's 8×8
(the VAE's factor) patch (a box filter), so a latent pixel half inside the
mask weighs 0.5. It is cached with the latent it belongs to and its bytes are
part of the latent's cache key.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from engine.config.sources import IMAGE_EXTS
from engine.data.images import ImageRecord, MaskSource

ALPHA = "alpha"


def find_masks(records: list[ImageRecord], folder: Path | None, alpha: bool, log=None) -> dict[str, MaskSource]:
    """MaskSource by record.rel for every image that has a mask; warns for those that do not."""
    from PIL import Image

    out: dict[str, MaskSource] = {}
    for r in records:
        if alpha:
            with Image.open(r.path) as im:
                has = "A" in im.getbands() or (im.mode == "P" and "transparency" in im.info)
            if has:
                out[r.rel] = MaskSource(None, ALPHA)
        else:
            stem = Path(folder) / Path(r.rel).with_suffix("")
            found = [p for ext in IMAGE_EXTS for p in (stem.with_suffix(ext), stem.with_suffix(ext.upper()))
                     if p.is_file()]
            if found:
                out[r.rel] = MaskSource(found[0], hashlib.sha256(found[0].read_bytes()).hexdigest())
        if r.rel not in out and log is not None:
            where = "an alpha channel" if alpha else f"a mask in {folder}"
            log.warning("mask_missing", image=r.rel, message=f"no {where}; this image trains everywhere")
    return out


def mask_for_bucket(record: ImageRecord, mask: MaskSource, bucket: tuple[int, int], flip: bool,
                    latent_hw: tuple[int, int]):
    """The mask as a float tensor [h, w] on the latent grid, in [0, 1]."""
    import io

    import torch
    from PIL import Image, ImageOps

    from engine.data.images import load_for_bucket

    with Image.open(record.path if mask.path is None else mask.path) as im:
        im = ImageOps.exif_transpose(im)
        grey = im.convert("RGBA").getchannel("A") if mask.path is None else im.convert("L")
    # Stretched to the image's upright size, then the image's own resize, crop and mirror (load_for_bucket reads
    # an RGB file: the grey goes in as a PNG in memory with three equal channels).
    grey = grey.resize((record.width, record.height), Image.Resampling.BILINEAR) if grey.size != (
        record.width, record.height) else grey
    buf = io.BytesIO()
    Image.merge("RGB", (grey, grey, grey)).save(buf, format="PNG")
    buf.seek(0)
    fitted = load_for_bucket(buf, bucket, flip=flip).getchannel(0)
    h, w = latent_hw
    small = fitted.resize((w, h), Image.Resampling.BOX)
    return torch.from_numpy(np.asarray(small, dtype=np.float32) / 255.0)
