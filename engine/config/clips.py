"""What a video family's clips must be, checked when a job is submitted (the inbox and `lorad submit` alike, through
engine/config/paths.py): every file readable, with a video stream, at least one window long. Probing reads only the
container's index (PyAV: the frame count or duration; the packets only where the index has neither) or, for .gif /
.webp, Pillow's frame durations: no frame is decoded and no frame data read, so checking a folder in the daemon's
service loop stays cheap. A file cut short behind a whole index passes; engine/data/videos.py finds out when it
decodes the windows, and they are skipped with a reason (engine/families/video/cache.py).

Here, not in engine/data/, so that job validation imports no data reader module (engine/config/sources.py).
"""

from __future__ import annotations

from pathlib import Path

from engine.config.bounded import CheckTimedOut, open_regular, tick
from engine.config.sources import IMAGE_EXTS, VIDEO_EXTS, list_media
from engine.errors import JobInvalid


class ClipUnreadable(Exception):
    """A clip that cannot be decoded (as far as the job needs it): its file, and why."""


def _timestamps(path: Path) -> tuple[list[float], int, int]:
    """(source frame times in seconds from the first, width, height) of a clip, reading only what it must: the
    container's index (PyAV: the frame count, or the duration, at the stream's average rate; its packets only when
    it has neither) or, for .gif / .webp, Pillow's frame durations. ClipUnreadable when it cannot."""
    if path.suffix.lower() in (".gif", ".webp"):
        from PIL import Image, UnidentifiedImageError

        try:
            with _open(path) as f, Image.open(f) as im:
                times, t = [], 0.0
                for i in range(getattr(im, "n_frames", 1)):
                    tick("data.path", path)
                    im.seek(i)
                    times.append(t)
                    t += (im.info.get("duration") or 100) / 1000.0
                return times, im.width, im.height
        except (UnidentifiedImageError, OSError, EOFError) as e:
            raise ClipUnreadable(f"not a readable image ({e})") from None
    import av

    try:
        # opened here, as a regular file only (engine/config/bounded.py); PyAV reads it through the file object
        with _open(path) as f, av.open(f) as box:
            if not box.streams.video:
                raise ClipUnreadable("has no video stream")
            stream = box.streams.video[0]
            width, height = stream.codec_context.width, stream.codec_context.height
            rate = float(stream.average_rate or stream.guessed_rate or 0)
            n = stream.frames
            if not n and rate and (stream.duration or box.duration):  # WebM: no count, a duration
                seconds = float(stream.duration * stream.time_base) if stream.duration else box.duration / 1e6
                n = round(seconds * rate)
            if n and rate:  # a file cut short behind a whole index passes here: its windows are skipped when cached
                return [k / rate for k in range(n)], width, height
            times = sorted(float(p.pts * stream.time_base) for p in _ticking(box.demux(stream), path)
                           if p.pts is not None and p.size > 0)
    except av.error.FFmpegError as e:
        raise ClipUnreadable(f"cannot be read as a video ({e})") from None
    if not times:
        raise ClipUnreadable("has no frames")
    return [t - times[0] for t in times], width, height


def _open(path: Path):
    """The clip opened as a regular file only (engine/config/bounded.py): a FIFO or a device is unreadable."""
    try:
        return open_regular(path, "data.path")
    except CheckTimedOut:
        raise
    except JobInvalid:
        raise ClipUnreadable("is not a regular file that can be read") from None


def _ticking(packets, path: Path):
    for n, packet in enumerate(packets):
        if n % 256 == 0:
            tick("data.path", path)
        yield packet


def frames_at(times: list[float], fps: float) -> int:
    """How many frames a clip whose frames show at `times` has at `fps`: every k with k / fps within the clip (the
    last frame shown for as long as the one before it)."""
    end = times[-1] + (times[-1] - times[-2] if len(times) > 1 else 0.0)
    return max(1, int(end * fps + 1e-6)) if len(times) > 1 else 1


def probe(path: Path, fps: float) -> tuple[int, int, int, bool]:
    """(frames at fps, width, height, still) of one file of a video dataset; ClipUnreadable when it cannot be read."""
    if not path.is_file():  # a FIFO or a device (swapped in since the folder was listed): never opened
        raise ClipUnreadable("is not a regular file that can be read")
    if path.stat().st_size == 0:
        raise ClipUnreadable("is empty (0 bytes)")
    suffix = path.suffix.lower()
    animated = suffix in (".gif", ".webp")  # Pillow reads their frames; a one-frame one is a still
    times, w, h = _timestamps(path) if animated or suffix in VIDEO_EXTS else _still_size(path)
    if len(times) == 1 and (animated or suffix in IMAGE_EXTS):
        return 1, w, h, True
    return frames_at(times, fps), w, h, False


def _still_size(path: Path) -> tuple[list[float], int, int]:
    from PIL import Image, ImageOps, UnidentifiedImageError

    try:
        with _open(path) as f, Image.open(f) as im:
            w, h = ImageOps.exif_transpose(im).size
    except (UnidentifiedImageError, OSError) as e:
        raise ClipUnreadable(f"is not a readable image ({e})") from None
    return [0.0], w, h


def check_video_folder(folder: Path, fps: float, frames: list[int], key: str = "data.path") -> None:
    """What a job's clip folder must hold, checked when it is submitted (the inbox and `lorad submit` alike): at
    least one clip or still, and every clip readable and at least one window (min(data.frames)) long. JobInvalid
    names the first file that is not."""
    folder = Path(folder)
    if not folder.is_dir():
        raise JobInvalid(f"{key}: {folder} must be a folder of clips and images with same-stem captions")
    files = list_media(folder, key)
    if not files:
        raise JobInvalid(f"{key}: {folder} contains no clips or images ({', '.join(VIDEO_EXTS + IMAGE_EXTS)})")
    shortest = min(frames)
    for p in files:
        try:
            n, _w, _h, still = probe(p, fps)
        except ClipUnreadable as e:
            raise JobInvalid(f"{key}: {p.relative_to(folder)} {e}") from None
        if not still and n < shortest:
            raise JobInvalid(f"{key}: {p.relative_to(folder)} has {n} frames at data.fps {fps:g}, shorter than one "
                             f"window (data.frames {shortest}); trim data.frames or remove the clip")
