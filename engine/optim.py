"""Optimizers, the learning-rate schedule, and a pickle-free form of optimizer state."""

from __future__ import annotations

import math
from typing import Any

import torch

from engine.config import TrainConfig


def build_optimizer(params: list[torch.nn.Parameter], train: TrainConfig) -> torch.optim.Optimizer:
    kw = dict(lr=train.lr, weight_decay=train.weight_decay, betas=(0.9, 0.999), eps=1e-8)
    if train.optimizer == "adamw":
        return torch.optim.AdamW(params, **kw)
    import bitsandbytes as bnb

    cls = bnb.optim.PagedAdamW8bit if train.optimizer == "paged_adamw8bit" else bnb.optim.AdamW8bit
    return cls(params, **kw)


def lr_at(step: int, train: TrainConfig) -> float:
    """Learning rate for optimizer step `step` (0-based): linear warm-up, then constant, linear or cosine decay."""
    if train.warmup_steps and step < train.warmup_steps:
        return train.lr * (step + 1) / train.warmup_steps
    if train.schedule == "constant":
        return train.lr
    span = max(1, train.steps - train.warmup_steps)
    progress = min(1.0, (step - train.warmup_steps) / span)
    if train.schedule == "linear":
        return train.lr * (1.0 - progress)
    return train.lr * 0.5 * (1.0 + math.cos(math.pi * progress))


# Optimizer state is a tree of dicts/lists/tuples with tensors and scalars as leaves
# (bitsandbytes nests its 8-bit state and quantisation maps one level deeper).
# We split it into a flat {path: tensor} map for safetensors and a JSON tree for the rest,
# so checkpoints hold no pickles and reload bit-exactly.

def split_tree(tree: Any, prefix: str, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(tree, torch.Tensor):
        key = prefix.lstrip("/")
        tensors[key] = tree
        return {"__tensor__": key}
    if isinstance(tree, dict):
        return {"__dict__": [[k, split_tree(v, f"{prefix}/{k}", tensors)] for k, v in tree.items()]}
    if isinstance(tree, tuple):
        return {"__tuple__": [split_tree(v, f"{prefix}/{i}", tensors) for i, v in enumerate(tree)]}
    if isinstance(tree, list):
        return [split_tree(v, f"{prefix}/{i}", tensors) for i, v in enumerate(tree)]
    if isinstance(tree, float) and not math.isfinite(tree):
        return {"__float__": repr(tree)}
    if tree is None or isinstance(tree, (bool, int, float, str)):
        return tree
    raise TypeError(f"cannot store optimizer state value of type {type(tree).__name__} at {prefix}")


def join_tree(node: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(node, dict):
        if "__tensor__" in node:
            return tensors[node["__tensor__"]]
        if "__dict__" in node:
            # [key, value] pairs keep integer keys (parameter indices) as ints through JSON.
            return {k: join_tree(v, tensors) for k, v in node["__dict__"]}
        if "__tuple__" in node:
            return tuple(join_tree(v, tensors) for v in node["__tuple__"])
        if "__float__" in node:
            return float(node["__float__"])
    if isinstance(node, list):
        return [join_tree(v, tensors) for v in node]
    return node
