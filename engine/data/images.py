"""Image datasets for Flux LoRA: a folder of images with same-name caption files, aspect-ratio buckets.

Layout (data.path):

    photo-001.png   photo-001.txt     "a man in a red coat"
    photo-002.jpg   photo-002.txt
    sub/pic.webp    sub/pic.txt       (sub-folders are read too; hidden files are skipped)

A missing caption file means the trigger word alone (with a warning); a
trigger (data.trigger) is prepended to every caption that does not already
start with it.

Buckets. For each resolution R in data.resolution the bucket set holds the
sizes (w, h), both multiples of the step (16 px up to R=256, 64 px above, made
a multiple of the family's VAE factor × patch: 32 for Wan 2.2 TI2V-5B),
whose area is at most R² and whose aspect ratio is at most 2:1 either way.
Every image is trained once per resolution, at the bucket whose aspect ratio
is closest (in log space) to its own: resized to cover the bucket, then
centre-cropped. Nothing is random here, so the cache is stable.

Order. Every micro-batch holds samples of one bucket only (Flux needs one
latent size per batch). For epoch e the samples of each bucket (repeated
data.repeats times) are shuffled with a generator seeded by (seed, e,
bucket), cut into batches (the last one topped up from the start of the same
bucket), and the list of batches is permuted with a generator seeded by
(seed, e). Batch k of the run is therefore a pure function of (seed, epoch,
position) and resume needs only the count of samples consumed.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from pathlib import Path

from engine.config.buckets import MAX_ASPECT, assign_bucket, bucket_step, buckets_for  # noqa: F401 - their home was here
from engine.config.sources import list_images
from engine.errors import JobInvalid


def load_upright(path: Path):
    """The image as RGB, its EXIF orientation applied."""
    from PIL import Image, ImageOps

    with Image.open(path) as im:
        return ImageOps.exif_transpose(im).convert("RGB")


def load_for_bucket(path: Path, bucket: tuple[int, int], flip: bool = False):
    """The image as RGB, resized to cover the bucket (Lanczos) and centre-cropped to it."""
    from PIL import Image

    im = cover_crop(load_upright(path), bucket)
    return im.transpose(Image.Transpose.FLIP_LEFT_RIGHT) if flip else im


def cover_crop(im, bucket: tuple[int, int]):
    """An RGB PIL image resized to cover the (w, h) bucket (Lanczos) and centre-cropped to it (video frames too)."""
    from PIL import Image

    w, h = bucket
    scale = max(w / im.width, h / im.height)
    size = (max(w, round(im.width * scale)), max(h, round(im.height * scale)))
    im = im.resize(size, Image.Resampling.LANCZOS)
    left, top = (size[0] - w) // 2, (size[1] - h) // 2
    return im.crop((left, top, left + w, top + h))


@dataclass(frozen=True)
class ImageRecord:
    path: Path
    rel: str
    sha256: str
    width: int
    height: int
    caption: str
    caption_missing: bool


@dataclass(frozen=True)
class MaskSource:
    """Where an image's loss mask comes from: a mask file (path, its sha256) or, with path None, its alpha channel."""

    path: Path | None
    sha256: str


@dataclass(frozen=True)
class Item:
    """One training sample: an image at one resolution's bucket (regularisation images weigh `loss_weight`)."""

    record: ImageRecord
    resolution: int
    bucket: tuple[int, int]
    mask: MaskSource | None = None
    loss_weight: float = 1.0
    repeats: int | None = None  # per epoch; None = the order's own (data.repeats)
    controls: tuple = ()  # an edit pair's control images (engine/config/controls.py ControlSource), one per slot


def read_caption(p: Path, folder: Path, caption_ext: str, trigger: str | None, log=None) -> tuple[str, bool]:
    """(final caption, whether its file was missing) of an image or clip P: P.<caption_ext>, through make_caption;
    a missing one is said once in the log."""
    cap_path = p.with_suffix("." + caption_ext)
    missing = not cap_path.is_file()
    raw = None if missing else cap_path.read_text(encoding="utf-8", errors="replace")
    if missing and log is not None:
        log.warning("caption_missing", image=str(p.relative_to(folder)),
                    message=f"no {cap_path.name}; the caption is the trigger alone ({trigger or 'empty'})")
    return make_caption(raw, trigger), missing


def make_caption(raw: str | None, trigger: str | None) -> str:
    text = " ".join((raw or "").split())
    if trigger:
        if not text:
            return trigger
        if not text.startswith(trigger):
            return f"{trigger}, {text}"
    return text


def scan(folder: Path, caption_ext: str, trigger: str | None, log=None) -> list[ImageRecord]:
    """Every image with its content hash, its upright size (EXIF orientation applied) and its final caption."""
    from PIL import Image, ImageOps, UnidentifiedImageError

    folder = Path(folder)
    records = []
    for p in list_images(folder):
        data = p.read_bytes()
        try:
            with Image.open(p) as im:
                size = ImageOps.exif_transpose(im).size
        except (UnidentifiedImageError, OSError) as e:
            raise JobInvalid(f"data.path: {p.relative_to(folder)} is not a readable image ({e})") from None
        caption, missing = read_caption(p, folder, caption_ext, trigger, log)
        records.append(ImageRecord(p, str(p.relative_to(folder)), hashlib.sha256(data).hexdigest(), size[0], size[1],
                                   caption, missing))
    if not records:
        raise JobInvalid(f"data.path: {folder} contains no images")
    return records


def make_items(records: list[ImageRecord], resolutions: list[int], masks: dict[str, MaskSource] | None = None,
               loss_weight: float = 1.0, repeats: int | None = None, controls: dict | None = None,
               multiple: int = 16) -> list[Item]:
    """Every record at each resolution; `masks` and `controls` by record.rel, `loss_weight` and `repeats` for all;
    bucket sides a multiple of `multiple` (the family's: engine/registry/families.py's spatial_multiple)."""
    masks, controls = masks or {}, controls or {}
    return [Item(r, res, assign_bucket(r.width, r.height, res, multiple), masks.get(r.rel), loss_weight, repeats,
                 controls.get(r.rel, ())) for r in records for res in sorted(set(resolutions))]


def dataset_hash(records: list[ImageRecord], controls: dict | None = None) -> str:
    """Identifies the training set (image bytes and final captions, and an edit job's control bytes by record.rel)
    in output metadata."""
    h = hashlib.sha256()
    for r in records:
        h.update(f"{r.rel}\0{r.sha256}\0{r.caption}\n".encode())
        for c in (controls or {}).get(r.rel, ()):
            h.update(f"control\0{c.sha256}\n".encode())
    return h.hexdigest()[:16]


class BucketOrder:
    """Deterministic single-bucket batches over `items` (see the module docstring)."""

    def __init__(self, items: list[Item], batch_size: int, repeats: int, seed: int):
        """Each item appears `repeats` times per epoch, or item.repeats where set (regularisation images)."""
        self.batch_size = batch_size
        self.seed = seed
        by_bucket: dict[tuple[int, int], list[int]] = {}
        for i, it in enumerate(items):
            by_bucket.setdefault(it.bucket, []).extend([i] * (repeats if it.repeats is None else it.repeats))
        self.buckets = sorted(by_bucket.items())
        self.n_batches = sum(math.ceil(len(m) / batch_size) for _, m in self.buckets)
        self._epochs: dict[int, tuple[tuple[int, ...], ...]] = {}  # a memo only: values depend on the epoch alone

    def __len__(self) -> int:
        """Samples per epoch (whole batches, so an epoch boundary never splits a batch)."""
        return self.n_batches * self.batch_size

    def epoch_batches(self, epoch: int) -> tuple[tuple[int, ...], ...]:
        if epoch not in self._epochs:
            if len(self._epochs) > 4:
                self._epochs.clear()
            self._epochs[epoch] = self._build_epoch(epoch)
        return self._epochs[epoch]

    def _build_epoch(self, epoch: int) -> tuple[tuple[int, ...], ...]:
        import numpy as np  # here, not at the top: job validation imports this module on torch-free clients

        batches = []
        for b, (_, members) in enumerate(self.buckets):
            rng = np.random.Generator(np.random.PCG64([self.seed, epoch, b, 1]))
            shuffled = [members[i] for i in rng.permutation(len(members))]
            for s in range(0, len(shuffled), self.batch_size):
                chunk = shuffled[s : s + self.batch_size]
                # Top up the last batch from the start of the same bucket, wrapping for tiny buckets.
                k = 0
                while len(chunk) < self.batch_size:
                    chunk.append(shuffled[k % len(shuffled)])
                    k += 1
                batches.append(tuple(chunk))
        rng = np.random.Generator(np.random.PCG64([self.seed, epoch, 2]))
        return tuple(batches[i] for i in rng.permutation(len(batches)))

    def indices_at(self, seed: int, start: int, count: int) -> list[int]:
        """Item indices of the micro-batch that starts at global sample position `start`."""
        if seed != self.seed or count != self.batch_size or start % self.batch_size:
            raise ValueError("bucketed batches are read whole: start must be a multiple of train.batch_size")
        k = start // self.batch_size
        return list(self.epoch_batches(k // self.n_batches)[k % self.n_batches])
