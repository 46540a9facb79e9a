"""Write the tiny example clips of configs/examples/*-tiny video jobs into configs/examples/data/video-tiny/.

Generated, not downloaded: synthetic moving squares (engine/data/clip_files.py), a few KB each.
    python configs/examples/make_video_data.py [DEST]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from engine.data.clip_files import moving_square, write_animated, write_mp4  # noqa: E402

CLIPS = [  # name, frames, width, height, fps, colour, caption
    ("red-square.mp4", 24, 48, 32, 16, (220, 30, 30), "a red square slides right"),
    ("green-square.mp4", 40, 32, 32, 24, (30, 200, 60), "a green square slides right"),
    ("blue-square.gif", 12, 32, 48, 8, (30, 60, 220), "a blue square slides right"),
]


def main(dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    for i, (name, n, w, h, fps, colour, caption) in enumerate(CLIPS):
        frames = moving_square(n, w, h, colour, seed=i)
        (write_mp4 if name.endswith(".mp4") else write_animated)(frames, dest / name, fps)
        (dest / name).with_suffix(".txt").write_text(caption + "\n")
    from PIL import Image

    Image.fromarray(moving_square(1, 32, 32, (240, 200, 20), seed=9)[0]).save(dest / "yellow-still.png")
    (dest / "yellow-still.txt").write_text("a yellow square\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent / "data" / "video-tiny")
