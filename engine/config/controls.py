"""data.control_path: the control (input) images of an edit LoRA's targets, paired by file stem and checked at submit.

An edit model turns control image(s) and an instruction into the target image. Each folder of data.control_path is
one reference slot and holds one control per target image, under the target's relative path with any image
extension (`0001.png` ↔ `control/0001.jpg`). The same pairing runs when a job is submitted (the inbox and `lorad
submit` both validate through engine/config/paths.py) and when the trainer scans its data (engine/data/images.py),
so a job the daemon accepts trains on exactly the pairs it was checked with.

Refused, each naming the file: a target with no control, a control with no target (or two controls of one stem),
a control that is not a readable image, and a control the pipeline cannot take at its target's size: controls
follow their target's bucket (resized to cover it and centre-cropped, flipped with it), so a control of another
aspect ratio than its target (beyond ASPECT_TOLERANCE) would be cropped to other content than the target, and a
control smaller than one latent patch (MIN_SIDE px) has nothing to encode.

Which bases read controls: the edit pipelines, by the pipeline class their model_index.json names (EDIT_PIPELINES);
a control_path on any other base is refused naming the key.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

from engine.config.bounded import CheckTimedOut, open_regular, read_capped, tick
from engine.config.buckets import assign_bucket
from engine.config.sources import IMAGE_EXTS, list_images
from engine.errors import JobInvalid

KEY = "data.control_path"
ASPECT_TOLERANCE = 0.02  # relative; resizing to a bucket already moves an aspect ratio by up to a few percent
MIN_SIDE = 16  # px: one 2x2 patch of 8x-downsampled latents
# pipeline class (model_index.json's _class_name) -> the family that trains it as an edit model
EDIT_PIPELINES = {"FluxKontextPipeline": "flux", "QwenImageEditPipeline": "qwen_image",
                  "QwenImageEditPlusPipeline": "qwen_image", "Flux2Pipeline": "flux2", "Flux2KleinPipeline": "flux2"}
# the pipelines that take one control image (the others take a list: one per slot)
ONE_CONTROL = ("FluxKontextPipeline", "QwenImageEditPipeline")
# (least side in px, greatest aspect ratio) a pipeline takes for a reference image: FLUX.2's image processor
# refuses others (Flux2ImageProcessor.check_image_input's defaults; a test holds these to them). Checked on the
# control as it trains: at its target's bucket.
REFERENCE_LIMITS = {"Flux2Pipeline": (64, 8.0), "Flux2KleinPipeline": (64, 8.0)}


@dataclass(frozen=True)
class ControlSource:
    """One control image of a target: its file and its content hash (its cache key)."""

    path: Path
    sha256: str


def pipeline_class(model_dir: Path) -> str | None:
    """The pipeline class a diffusers directory names (model_index.json), None where there is none."""
    index = Path(model_dir) / "model_index.json"
    try:
        return json.loads(read_capped(index, "model.path", 1 << 20)).get("_class_name")
    except JobInvalid:
        if index.exists() and not index.is_file():  # a FIFO or a device in its place: named, never opened
            raise
        return None
    except (OSError, ValueError, AttributeError):
        return None


def check_edit_base(family: str, pipeline: str | None, model_path: str, slots: int) -> None:
    """JobInvalid unless `pipeline` is an edit pipeline of `family` that takes `slots` controls per target."""
    if EDIT_PIPELINES.get(pipeline or "") != family:
        edit = ", ".join(k for k, v in EDIT_PIPELINES.items() if v == family) or "none"
        raise JobInvalid(f"{KEY}: {model_path} is not an edit model ({pipeline or 'no pipeline class'}); control "
                         f"images are read by model.family {family} with an edit base ({edit})")
    if slots > 1 and pipeline in ONE_CONTROL:
        raise JobInvalid(f"{KEY}: {pipeline} takes one control image per target; give one folder, not {slots}")


def check_bucket(pipeline: str | None, target: Path, bucket: tuple[int, int], resolution: int) -> None:
    """JobInvalid naming the target if its bucket (the size its controls train at) is one the pipeline refuses as
    a reference image."""
    if pipeline not in REFERENCE_LIMITS:
        return
    least, ratio = REFERENCE_LIMITS[pipeline]
    bw, bh = bucket
    if min(bw, bh) < least or max(bw / bh, bh / bw) > ratio:
        raise JobInvalid(f"{KEY}: the controls of {target} train at its bucket {bw}x{bh} (data.resolution "
                         f"{resolution}), which {pipeline} refuses as a reference image (at least {least} px a "
                         f"side, aspect ratio at most {ratio:g}:1); raise data.resolution")


def check_buckets(pipeline: str | None, targets: dict[str, tuple[int, int]], resolutions: list[int],
                  folder: Path) -> None:
    """check_bucket for every target at every resolution (targets: {relative path: upright (width, height)})."""
    for rel, (w, h) in targets.items():
        for res in resolutions:
            check_bucket(pipeline, folder / rel, assign_bucket(w, h, res), res)


def upright_size(path: Path, key: str = KEY) -> tuple[int, int]:
    """(width, height) with the EXIF orientation applied, from the header; JobInvalid (naming `key`) for a missing
    or unreadable image."""
    from PIL import Image, UnidentifiedImageError

    try:
        f = open_regular(path, key)  # a FIFO or a device is refused, not read (engine/config/bounded.py)
    except CheckTimedOut:
        raise
    except JobInvalid as e:
        raise JobInvalid(f"{key}: {path} is not a readable image ({str(e).removeprefix(f'{key}: {path} ')})") from None
    try:
        with f:
            with Image.open(f) as im:
                im.verify()  # the file's own checksums (PNG chunks): a truncated or damaged file fails here
            f.seek(0)
            with Image.open(f) as im:  # verify leaves the image unusable: the header again, for the size
                w, h = im.size
                turned = im.getexif().get(0x0112) in (5, 6, 7, 8)
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:
        raise JobInvalid(f"{key}: {path} is not a readable image ({e})") from None
    return (h, w) if turned else (w, h)


def _by_stem(folder: Path) -> dict[str, Path]:
    out: dict[str, Path] = {}
    for p in list_images(folder):
        stem = str(p.relative_to(folder).with_suffix(""))
        if stem in out:
            raise JobInvalid(f"{KEY}: {p} and {out[stem]} are two controls for one target ({stem}.*)")
        out[stem] = p
    return out


def pair_controls(target_folder: Path, targets: dict[str, tuple[int, int]], folders: list[str],
                  check_sizes: bool = True) -> dict[str, tuple[ControlSource, ...]]:
    """Each target's controls, one per folder of data.control_path: {target rel: (slot 0, slot 1, ...)}.

    targets: {relative path: upright (width, height)} of the images of data.path. JobInvalid naming the file for
    a missing or extra control, an unreadable one, or one of a size refused (module docstring)."""
    stems = {str(Path(rel).with_suffix("")): rel for rel in targets}
    out: dict[str, list[ControlSource]] = {rel: [] for rel in targets}
    for folder in map(Path, folders):
        if not folder.is_dir():
            raise JobInvalid(f"{KEY}: {folder} is not a folder of control images")
        found = _by_stem(folder)
        for stem, p in found.items():
            if stem not in stems:
                raise JobInvalid(f"{KEY}: {p} has no target image in {target_folder} (no {stem}.* there)")
        for stem, rel in stems.items():
            if stem not in found:
                raise JobInvalid(f"{KEY}: {target_folder / rel} has no control in {folder} (expected "
                                 f"{folder / stem}.{{{','.join(e[1:] for e in IMAGE_EXTS)}}})")
            p = found[stem]
            size = upright_size(p)
            if check_sizes:
                _check_size(p, size, targets[rel], target_folder / rel)
            out[rel].append(ControlSource(p, _sha256(p)))
    return {rel: tuple(c) for rel, c in out.items()}


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open_regular(path, KEY) as f:
        while block := f.read(1 << 20):
            h.update(block)
            tick(KEY, path)
    return h.hexdigest()


def _check_size(path: Path, size: tuple[int, int], target: tuple[int, int], target_path: Path) -> None:
    if min(size) < MIN_SIDE:
        raise JobInvalid(f"{KEY}: {path} is {size[0]}x{size[1]}; a control needs at least {MIN_SIDE} px a side")
    if abs(math.log((size[0] / size[1]) / (target[0] / target[1]))) > math.log1p(ASPECT_TOLERANCE):
        raise JobInvalid(f"{KEY}: {path} is {size[0]}x{size[1]} but its target {target_path} is "
                         f"{target[0]}x{target[1]}: a control is resized and cropped to its target's bucket, so "
                         f"their aspect ratios must agree (within {ASPECT_TOLERANCE:.0%})")


def check_controls(data_path: Path, folders: list[str], pipeline: str | None, resolutions: list[int]) -> None:
    """Submit time: every target of data_path has its readable, fitting controls and every control its target."""
    folder = Path(data_path)
    targets = {str(p.relative_to(folder)): upright_size_of_target(p, folder) for p in list_images(folder)}
    pair_controls(folder, targets, folders)
    check_buckets(pipeline, targets, resolutions, folder)


def upright_size_of_target(path: Path, folder: Path) -> tuple[int, int]:
    try:
        return upright_size(path)
    except JobInvalid:
        raise JobInvalid(f"data.path: {path.relative_to(folder)} is not a readable image") from None
