"""Capture and restore every random number generator the training step can touch."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def capture(generator: torch.Generator | None = None) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Return (json-able states, tensor states) for python, numpy, torch CPU, each CUDA device and `generator`."""
    py = random.getstate()
    np_state = np.random.get_state()
    meta = {
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "cuda_devices": torch.cuda.device_count() if torch.cuda.is_available() else 0,
    }
    tensors = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"cuda_{i}"] = s
    if generator is not None:
        tensors["data_generator"] = generator.get_state()
    return meta, tensors


def restore(meta: dict[str, Any], tensors: dict[str, torch.Tensor], generator: torch.Generator | None = None) -> str | None:
    """Restore every RNG; return a warning if the CUDA devices differ from the checkpoint's (those that match are
    restored, the others keep their seed: results on the others are then no longer bit-exact)."""
    v, state, gauss = meta["python"]
    random.setstate((v, tuple(state), gauss))
    name, keys, pos, has_gauss, cached = meta["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(tensors["torch_cpu"])
    warning = None
    saved = sorted(int(k[5:]) for k in tensors if k.startswith("cuda_"))
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for i in range(min(n, len(saved))):
        torch.cuda.set_rng_state(tensors[f"cuda_{i}"], device=i)
    if n != len(saved):
        warning = (f"the checkpoint has the CUDA random state of {len(saved)} GPU(s), this run sees {n}: "
                   f"{'the first ' + str(min(n, len(saved))) + ' were restored; ' if min(n, len(saved)) else ''}"
                   "dropout on the others differs from an uninterrupted run")
    if generator is not None and "data_generator" in tensors:
        generator.set_state(tensors["data_generator"])
    return warning


def seed_everything(seed: int) -> torch.Generator:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    g = torch.Generator()
    g.manual_seed(seed + 1)
    return g
