"""Write the tiny paired dataset of the edit examples: configs/examples/data/edit-tiny/{target,control}/.

Each pair is a procedural control image (a gradient with a grey block) and its target (the same image with the
block painted red); the target's caption is the instruction. Run from anywhere:

    python configs/examples/make_edit_pairs.py
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

OUT = Path(__file__).resolve().parent / "data" / "edit-tiny"
PAIRS = [("wide", 48, 32), ("tall", 32, 48), ("square", 40, 40)]
INSTRUCTION = "make the block red"


def control_image(w: int, h: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w]
    base = rng.integers(0, 255, size=3)
    arr = np.stack([(base[c] + xx * (c + 2) + yy * (3 - c)) % 256 for c in range(3)], axis=-1).astype(np.uint8)
    arr[h // 4 : h // 2, w // 4 : w // 2] = 128
    return arr


def main(out: Path = OUT) -> None:
    for sub in ("target", "control"):
        (out / sub).mkdir(parents=True, exist_ok=True)
    for i, (name, w, h) in enumerate(PAIRS):
        ctl = control_image(w, h, i)
        tgt = ctl.copy()
        tgt[h // 4 : h // 2, w // 4 : w // 2] = (220, 30, 30)
        Image.fromarray(ctl).save(out / "control" / f"{name}.png")
        Image.fromarray(tgt).save(out / "target" / f"{name}.png")
        (out / "target" / f"{name}.txt").write_text(INSTRUCTION + "\n")


if __name__ == "__main__":
    main()
