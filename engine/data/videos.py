"""Video datasets for the video families (wan, hunyuan_video): clips and stills with same-stem captions, cut into
windows of frames, bucketed over (frames, width, height).

Layout (data.path): clips (.mp4 .webm .mov, and animated .gif / .webp) and still images (.png .jpg .jpeg .webp
.bmp, a one-frame .gif), each with a same-stem caption (IMAGE.<caption_ext>; a missing one means the trigger
alone, as for images: engine/data/images.py).

Frames. Every clip is resampled to data.fps: output frame k is the source frame shown at time k / fps (the last
one whose timestamp is at or before it), so a 30 fps clip at 16 fps drops frames and an 8 fps clip repeats them.
A clip of n frames at data.fps gives, for each length F in data.frames (each 4k + 1, what the Wan and
HunyuanVideo VAEs accept), the windows [0, F), [F, 2F), ... that fit: consecutive and non-overlapping, so an
epoch sees the whole clip once per length; the tail shorter than F is not trained on. A length longer than the
clip gives no window. A clip shorter than the shortest data.frames is refused when the job is submitted (it would
train on nothing), naming the file. Stills train as one-frame videos (the 4·0 + 1 case).

Buckets are (frames, width, height): the (width, height) of engine/data/images.py's aspect buckets per
data.resolution, one per clip (all its frames share it), and the window length. Each window is resized to cover
its bucket and centre-cropped, frame by frame, exactly as an image is.

Decoding: PyAV for .mp4 .webm .mov; Pillow for .gif and .webp (FFmpeg's WebP decoder reads no animation), with
each frame's duration as its timestamp.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from engine.config.clips import ClipUnreadable, probe
from engine.config.sources import list_media
from engine.data.images import ImageRecord, read_caption
from engine.errors import JobInvalid

__all__ = ["ClipUnreadable", "VideoItem", "VideoRecord", "make_video_items", "read_window", "scan_videos"]


@dataclass(frozen=True)
class VideoRecord(ImageRecord):
    """One clip or still: an ImageRecord (dataset_hash reads its fields) with its frames at data.fps."""

    frames: int  # at data.fps; 1 for a still
    still: bool


@dataclass(frozen=True)
class VideoItem:
    """One training sample: `bucket[0]` frames from frame `start` (at data.fps), at the (w, h) = bucket[1:]."""

    record: VideoRecord
    resolution: int
    bucket: tuple[int, int, int]  # (frames, width, height)
    start: int
    mask: None = None
    loss_weight: float = 1.0
    repeats: int | None = None
    controls: tuple = ()  # no edit pairs for video (engine/families/image/cache.py plans controls per item)


def scan_videos(folder: Path, fps: float, caption_ext: str, trigger: str | None, log=None,
                key: str = "data.path") -> list[VideoRecord]:
    """Every clip and still with its content hash, size, frames at fps and final caption (engine/data/images.py's
    caption rules)."""
    folder = Path(folder)
    out = []
    for p in list_media(folder):
        try:
            n, w, h, still = probe(p, fps)
        except ClipUnreadable as e:
            raise JobInvalid(f"{key}: {p.relative_to(folder)} {e}") from None
        caption, missing = read_caption(p, folder, caption_ext, trigger, log)
        with open(p, "rb") as f:  # streamed: a clip may be larger than what we want to hold to hash it
            digest = hashlib.file_digest(f, "sha256").hexdigest()
        out.append(VideoRecord(p, str(p.relative_to(folder)), digest, w, h, caption, missing, n,
                               still))
    if not out:
        raise JobInvalid(f"{key}: {folder} contains no clips or images")
    return out


def make_video_items(records: list[VideoRecord], resolutions: list[int], frames: list[int],
                     multiple: int = 16) -> list[VideoItem]:
    """Every window of every record (module docstring) at each resolution; a still once per resolution."""
    from engine.data.images import assign_bucket

    out = []
    for r in records:
        for res in sorted(set(resolutions)):
            w, h = assign_bucket(r.width, r.height, res, multiple)
            lengths = [1] if r.still else sorted(set(frames))
            for f in lengths:
                out += [VideoItem(r, res, (f, w, h), s) for s in range(0, r.frames - f + 1, f)]
    return out


def read_window(item: VideoItem, fps: float):
    """The item's frames as a float tensor [3, F, H, W] in [-1, 1], each resized to cover its bucket and
    centre-cropped. ClipUnreadable if the clip breaks before the window ends."""
    import numpy as np
    import torch

    from engine.data.images import cover_crop, load_for_bucket

    f, w, h = item.bucket
    if item.record.still:
        frames = [load_for_bucket(item.record.path, (w, h))]
    else:
        wanted = [(item.start + k) / fps for k in range(f)]
        frames = [cover_crop(im, (w, h)) for im in _frames_at(item.record.path, wanted)]
    x = torch.from_numpy(np.stack([np.asarray(im, dtype=np.float32) for im in frames]))  # [F, H, W, 3]
    return x.permute(3, 0, 1, 2) / 127.5 - 1.0


def _decoded(path: Path):
    """(time from the first frame, PIL RGB frame) of every frame in order."""
    if path.suffix.lower() in (".gif", ".webp"):
        from PIL import Image

        with Image.open(path) as im:
            t = 0.0
            for i in range(getattr(im, "n_frames", 1)):
                im.seek(i)
                yield t, im.convert("RGB")
                t += (im.info.get("duration") or 100) / 1000.0
        return
    import av

    with av.open(str(path)) as box:
        stream = box.streams.video[0]
        t0 = None
        for frame in box.decode(stream):
            t = float(frame.pts * stream.time_base) if frame.pts is not None else 0.0
            t0 = t if t0 is None else t0
            yield t - t0, frame.to_image()


def _frames_at(path: Path, wanted: list[float]) -> list:
    """The frame shown at each of the sorted `wanted` times (the last at or before it), decoding only up to the
    last one needed."""
    out, last, seen = [], None, [0.0, 0.0]  # seen: the last two frames' times
    try:
        for t, im in _decoded(path):
            while len(out) < len(wanted) and wanted[len(out)] < t - 1e-6:
                out.append(last)
            if len(out) == len(wanted):
                break
            last, seen = im, [seen[1], t]
    except Exception as e:  # noqa: BLE001 - PyAV and Pillow raise many kinds; any is a broken clip here
        raise ClipUnreadable(f"broke while decoding ({type(e).__name__}: {e})") from None
    if last is None or any(im is None for im in out):
        raise ClipUnreadable("has no decodable frames")
    if len(out) < len(wanted):
        # Past the last frame it stays on screen for one frame's time; later than that, the clip ended early.
        if wanted[-1] > seen[1] + max(seen[1] - seen[0], 1.0 / 1000) + 1e-6:
            raise ClipUnreadable(f"ended at {seen[1]:.3f} s, before the window's frame at {wanted[-1]:.3f} s")
        out += [last] * (len(wanted) - len(out))
    return out
