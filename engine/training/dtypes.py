"""The one table from a job's `model.dtype` name to the torch dtype, and the device training runs on."""

from __future__ import annotations

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype for a `model.dtype` value (engine/config/job.py validates the name)."""
    return DTYPES[name]


def pick_device() -> torch.device:
    """The GPU when there is one (training and the cache's encoders), else the CPU."""
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def peak_memory_gib(device: torch.device) -> float | None:
    """The most memory training has held on `device` so far (CUDA), for TensorBoard; None elsewhere."""
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
