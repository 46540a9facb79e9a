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


def make_sound_clip(path: Path, frames: int = 9, fps: int = 16, size: int = 32, tone: float = 440.0,
                    rate: int = 16000, seed: int = 0) -> Path:
    """An MP4 of a moving square with an AAC stereo track: a sine of `tone` Hz lasting as long as the frames."""
    from fractions import Fraction

    import av
    import numpy as np

    from engine.data.clip_files import moving_square

    n = round(frames / fps * rate)
    wave = (0.5 * np.sin(2 * np.pi * tone * np.arange(n) / rate)).astype(np.float32)
    wave = np.stack([wave, wave])
    with av.open(str(path), "w", format="mp4") as box:
        video = box.add_stream("libx264", rate=Fraction(fps))
        video.width, video.height, video.pix_fmt = size, size, "yuv420p"
        sound = box.add_stream("aac", rate=rate, layout="stereo")
        for f in moving_square(frames, size, size, (30, 200, 90), seed=seed):
            box.mux(video.encode(av.VideoFrame.from_ndarray(f, format="rgb24")))
        box.mux(video.encode())
        step = sound.codec_context.frame_size or 1024
        for i in range(0, n, step):
            chunk = av.AudioFrame.from_ndarray(np.ascontiguousarray(wave[:, i:i + step]), format="fltp",
                                               layout="stereo")
            chunk.sample_rate, chunk.pts = rate, i
            box.mux(sound.encode(chunk))
        box.mux(sound.encode())
    return path
