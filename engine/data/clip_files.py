"""Writing clips: MP4 (H.264 through PyAV) for sample videos and generated example data, animated GIF/WebP too.

frames: uint8 [F, H, W, 3]. H.264 in yuv420p needs even sizes; the tiny builtin models' frames are multiples of 16.
"""

from __future__ import annotations

from pathlib import Path


def write_mp4(frames, path, fps: float) -> None:
    """H.264 MP4 (yuv420p, what every browser's <video> plays), one frame per `frames` row, at `fps`; `path` a path
    or a writable binary file."""
    from fractions import Fraction

    import av

    with av.open(path if hasattr(path, "write") else str(path), mode="w", format="mp4") as box:
        stream = box.add_stream("libx264", rate=Fraction(fps).limit_denominator(1000))
        stream.width, stream.height = int(frames.shape[2]), int(frames.shape[1])
        stream.pix_fmt = "yuv420p"
        stream.options = {"crf": "18", "preset": "veryfast"}
        for f in frames:
            box.mux(stream.encode(av.VideoFrame.from_ndarray(f, format="rgb24")))
        box.mux(stream.encode())


def write_animated(frames, path: Path, fps: float) -> None:
    """An animated GIF or WebP (by the suffix) through Pillow, each frame shown 1000 / fps ms."""
    from PIL import Image

    ims = [Image.fromarray(f) for f in frames]
    extra = {"lossless": True} if Path(path).suffix.lower() == ".webp" else {}
    ims[0].save(path, save_all=True, append_images=ims[1:], duration=round(1000 / fps), loop=0, **extra)


def moving_square(frames: int, width: int, height: int, colour: tuple[int, int, int], seed: int = 0):
    """A synthetic clip: a square of `colour` crossing a gradient background, [frames, height, width, 3] uint8."""
    import numpy as np

    rng = np.random.default_rng(seed)
    bg = np.linspace(0, 255, width, dtype=np.float32)[None, :, None] * rng.uniform(0.3, 1.0, 3)[None, None, :]
    out = np.repeat(np.broadcast_to(bg, (height, width, 3))[None], frames, axis=0).astype(np.uint8)
    side = max(2, min(width, height) // 3)
    for k in range(frames):
        x = int((width - side) * k / max(1, frames - 1))
        y = (height - side) // 2
        out[k, y:y + side, x:x + side] = colour
    return out
