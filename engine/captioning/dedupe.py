"""Near-duplicate images (data.dedupe): the same picture resized, re-encoded or slightly cropped overweights one
pose or frame. Each image gets a 64-bit difference hash (dHash: a 9×8 grey thumbnail, one bit per horizontal
neighbour pair brighter to the left) and a 64-bit mean hash of an 8×8 thumbnail; two images are near-duplicates
when both hashes are within THRESHOLD bits. Groups are the connected sets of such pairs.

Our own few lines rather than a library: the well-kept one (imagehash) pulls scipy and PyWavelets into the
training stack for two of its hashes, which take a dozen lines of PIL and numpy.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

THRESHOLD = 10  # of 64 bits, for each hash: resizes and re-encodes move a few bits, a 5 % crop under ten


def _grey(path: Path, size: tuple[int, int]) -> np.ndarray:
    from PIL import Image

    from engine.data.images import load_upright

    return np.asarray(load_upright(path).convert("L").resize(size, Image.Resampling.LANCZOS), dtype=np.float32)


def image_hashes(path: Path) -> tuple[int, int]:
    """(dHash, mean hash) of one image, each 64 bits."""
    d = _grey(path, (9, 8))
    m = _grey(path, (8, 8))
    bits_d = (d[:, :-1] > d[:, 1:]).flatten()
    bits_m = (m > m.mean()).flatten()
    return _pack(bits_d), _pack(bits_m)


def _pack(bits: np.ndarray) -> int:
    return int("".join("1" if b else "0" for b in bits), 2)


def _near(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return all(bin(x ^ y).count("1") <= THRESHOLD for x, y in zip(a, b, strict=True))


def near_duplicate_groups(named: list[tuple[str, Path]]) -> list[list[str]]:
    """Groups (of two or more names, each group and its names sorted) of near-duplicate images."""
    hashes = [image_hashes(p) for _name, p in named]
    parent = list(range(len(named)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for i in range(len(named)):
        for j in range(i + 1, len(named)):
            if _near(hashes[i], hashes[j]):
                parent[root(j)] = root(i)
    groups: dict[int, list[str]] = {}
    for i, (name, _p) in enumerate(named):
        groups.setdefault(root(i), []).append(name)
    return sorted(sorted(g) for g in groups.values() if len(g) > 1)


def dedupe_records(mode: str, records: list, log) -> list:
    """data.dedupe on the scanned records: off → as they are; warn → as they are, the groups in a `duplicates`
    warning; skip → the first of each group (by name) kept, the others left out and named."""
    if mode == "off":
        return records
    groups = near_duplicate_groups([(r.rel, r.path) for r in records])
    dropped = {name for g in groups for name in g[1:]} if mode == "skip" else set()
    if groups:
        log.warning("duplicates", groups=groups, skipped=sorted(dropped),
                    message=f"{len(groups)} group(s) of near-duplicate images: "
                            + "; ".join(", ".join(g) for g in groups[:10])
                            + (f" (skipping {len(dropped)})" if dropped else " (data.dedupe: skip keeps one of each)"))
    return [r for r in records if r.rel not in dropped]
