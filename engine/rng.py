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


def restore(meta: dict[str, Any], tensors: dict[str, torch.Tensor], generator: torch.Generator | None = None) -> None:
    v, state, gauss = meta["python"]
    random.setstate((v, tuple(state), gauss))
    name, keys, pos, has_gauss, cached = meta["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(tensors["torch_cpu"])
    if torch.cuda.is_available():
        n = torch.cuda.device_count()
        states = [tensors[f"cuda_{i}"] for i in range(n) if f"cuda_{i}" in tensors]
        if len(states) == n:
            torch.cuda.set_rng_state_all(states)
    if generator is not None and "data_generator" in tensors:
        generator.set_state(tensors["data_generator"])


def seed_everything(seed: int) -> torch.Generator:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    g = torch.Generator()
    g.manual_seed(seed + 1)
    return g
