"""Near-duplicate images (data.dedupe): the same picture resized, re-encoded or slightly cropped overweights one
pose or frame. Each image gets a 64-bit difference hash (dHash: a 9×8 grey thumbnail, one bit per horizontal
neighbour pair brighter to the left) and a 64-bit mean hash of an 8×8 thumbnail; two images are near-duplicates
when both hashes are within THRESHOLD bits. Groups are the connected sets of such pairs.

Clips (the video families): a clip's fingerprint is those two hashes of each of FRAMES frames sampled evenly over
it (frames.py's rule, at data.fps), a still's is its own; two clips are near-duplicates when they have as many
sampled frames and each frame is near its counterpart (the k-th with the k-th) by the image rule. A re-encoded,
resized or slightly cropped copy keeps its length at data.fps, so its frames are sampled at the same times; a
trimmed, sped-up or reversed copy is not found. A clip that breaks before a sampled frame is in no group.

Our own few lines rather than a library: the well-kept one (imagehash) pulls scipy and PyWavelets into the
training stack for two of its hashes, which take a dozen lines of PIL and numpy.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

THRESHOLD = 10  # of 64 bits, for each hash: resizes and re-encodes move a few bits, a 5 % crop under ten
FRAMES = 4  # sampled per clip: its first, last and two between (a clip of fewer frames gives each once)


def _grey(im, size: tuple[int, int]) -> np.ndarray:
    from PIL import Image

    return np.asarray(im.convert("L").resize(size, Image.Resampling.LANCZOS), dtype=np.float32)


def hashes_of(im) -> tuple[int, int]:
    """(dHash, mean hash) of one PIL image, each 64 bits."""
    d = _grey(im, (9, 8))
    m = _grey(im, (8, 8))
    bits_d = (d[:, :-1] > d[:, 1:]).flatten()
    bits_m = (m > m.mean()).flatten()
    return _pack(bits_d), _pack(bits_m)


def image_hashes(path: Path) -> tuple[int, int]:
    """(dHash, mean hash) of one image file, upright."""
    from engine.data.images import load_upright

    return hashes_of(load_upright(path))


def fingerprint(path: Path, fps: float | None = None, frames: int | None = None,
                still: bool = True) -> tuple[tuple[int, int], ...] | None:
    """The hashes of what a file shows: an image (or a still) one pair, a clip of `frames` frames at `fps` one pair
    per sampled frame; None for a clip that breaks before one (it is in no group)."""
    if still or fps is None:
        return (image_hashes(path),)
    from engine.captioning.frames import frame_indices
    from engine.config.clips import ClipUnreadable
    from engine.data.videos import _frames_at

    try:
        return tuple(hashes_of(im) for im in _frames_at(path, [i / fps for i in frame_indices(frames, FRAMES)]))
    except ClipUnreadable:
        return None


def file_fingerprint(path: Path, fps: float | None):
    """A file's fingerprint, probed first in a video folder (fps set): `lorad check`, which has no records."""
    if fps is None:
        return fingerprint(path)
    from engine.config.clips import ClipUnreadable, probe

    try:
        n, _w, _h, still = probe(path, fps)
    except ClipUnreadable:
        return None
    return fingerprint(path, fps, n, still)


def _pack(bits: np.ndarray) -> int:
    return int("".join("1" if b else "0" for b in bits), 2)


def _near(a: tuple[tuple[int, int], ...] | None, b: tuple[tuple[int, int], ...] | None) -> bool:
    """Fingerprints near by the image rule, frame by frame (and of as many frames)."""
    if a is None or b is None or len(a) != len(b):
        return False
    return all(bin(x ^ y).count("1") <= THRESHOLD for fa, fb in zip(a, b, strict=True)
               for x, y in zip(fa, fb, strict=True))


def near_duplicate_groups(named: list[tuple[str, Path]], fps: float | None = None) -> list[list[str]]:
    """Groups (of two or more names, each group and its names sorted) of near-duplicate images, or with `fps` of a
    video folder's clips and stills."""
    if fps is not None:  # said (ImportError), not taken for broken clips: a client without PyAV cannot compare
        import av  # noqa: F401
    return group([(name, file_fingerprint(p, fps)) for name, p in named])


def group(named: list[tuple[str, tuple | None]]) -> list[list[str]]:
    """The connected sets (of two or more) of near fingerprints, by name."""
    parent = list(range(len(named)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for i in range(len(named)):
        for j in range(i + 1, len(named)):
            if _near(named[i][1], named[j][1]):
                parent[root(j)] = root(i)
    groups: dict[int, list[str]] = {}
    for i, (name, _fp) in enumerate(named):
        groups.setdefault(root(i), []).append(name)
    return sorted(sorted(g) for g in groups.values() if len(g) > 1)


def dedupe_records(mode: str, records: list, log, fps: float | None = None) -> list:
    """data.dedupe on the scanned records (a video job's with its data.fps): off → as they are; warn → as they are,
    the groups in a `duplicates` warning; skip → the first of each group (by name) kept, the others left out and
    named."""
    if mode == "off":
        return records
    groups = group([(r.rel, fingerprint(r.path, fps, getattr(r, "frames", None), getattr(r, "still", True)))
                    for r in records])
    dropped = {name for g in groups for name in g[1:]} if mode == "skip" else set()
    what = "images" if fps is None else "clips or stills"
    if groups:
        log.warning("duplicates", groups=groups, skipped=sorted(dropped),
                    message=f"{len(groups)} group(s) of near-duplicate {what}: "
                            + "; ".join(", ".join(g) for g in groups[:10])
                            + (f" (skipping {len(dropped)})" if dropped else " (data.dedupe: skip keeps one of each)"))
    return [r for r in records if r.rel not in dropped]
