"""Tiny clips for the video families' tests: written with engine/data/clip_files.py (PyAV, Pillow), a few KB each."""

from __future__ import annotations

from pathlib import Path

# name, frames, width, height, fps, caption
CLIPS = [("red.mp4", 10, 32, 32, 16, "a red square slides right"),
         ("blue.gif", 5, 32, 32, 8, "a blue square slides right")]


def make_clips(folder: Path, clips=CLIPS, still: bool = True) -> Path:
    """Clips (MP4 or animated GIF/WebP by the name) with same-stem captions, and a still PNG."""
    from PIL import Image

    from engine.data.clip_files import moving_square, write_animated, write_mp4

    folder.mkdir(parents=True, exist_ok=True)
    for i, (name, n, w, h, fps, caption) in enumerate(clips):
        frames = moving_square(n, w, h, (200, 40 * i, 30), seed=i)
        (write_mp4 if name.endswith(".mp4") else write_animated)(frames, folder / name, fps)
        (folder / name).with_suffix(".txt").write_text(caption + "\n")
    if still:
        Image.fromarray(moving_square(1, 32, 32, (240, 200, 20), seed=9)[0]).save(folder / "still.png")
        (folder / "still.txt").write_text("a yellow square\n")
    return folder


def truncated_mid_stream(path: Path, frames: int = 40) -> Path:
    """An MP4 whose index comes first (faststart) but whose frame data is cut: it probes whole, then breaks while
    its frames are decoded."""
    from fractions import Fraction

    import av

    from engine.data.clip_files import moving_square

    with av.open(str(path), "w", format="mp4", options={"movflags": "faststart"}) as box:
        s = box.add_stream("libx264", rate=Fraction(16))
        s.width, s.height, s.pix_fmt = 32, 32, "yuv420p"
        for f in moving_square(frames, 32, 32, (0, 200, 0)):
            box.mux(s.encode(av.VideoFrame.from_ndarray(f, format="rgb24")))
        box.mux(s.encode())
    data = path.read_bytes()
    path.write_bytes(data[: len(data) * 2 // 3])
    return path
