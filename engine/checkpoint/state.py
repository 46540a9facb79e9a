"""What a checkpoint holds besides files: the training state taken at a step boundary, and put back on resume.

A snapshot is host copies of the adapter, the optimizer state (as a pickle-free tree of tensors), the EMA's
shadow weights and every RNG, plus the loop's position; the background writer serialises it
(engine/checkpoint/store.py). Restoring puts each of them back in place, so a resumed run continues exactly.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.checkpoint.host_copy import to_host
from engine.checkpoint.store import Snapshot
from engine.errors import JobInvalid
from engine.training.ema import AdapterEMA
from engine.training.optim import join_tree, load_optimizer_state, optimizer_state, split_tree
from engine.training.rng import capture, restore


def snapshot(step: int, params, optimizer, generator, state: dict[str, Any], ema: AdapterEMA | None = None) -> Snapshot:
    """Host copies at a step boundary (on a GPU still landing: `ready`); the background writer serialises them."""
    opt_tensors: dict[str, torch.Tensor] = {}
    tree = split_tree(optimizer_state(optimizer), "", opt_tensors)
    (adapter, opt_tensors, ema_tensors), ready = to_host([dict(params), opt_tensors,
                                                          dict(ema.shadow or {}) if ema is not None else {}])
    rng_meta, rng_tensors = capture(generator)
    return Snapshot(step, adapter, opt_tensors, tree, rng_tensors, {**state, "rng": rng_meta},
                    extra={"ema": ema_tensors} if ema is not None else {}, ready=ready)


def restore_checkpoint(loaded, params, optimizer, generator, log=None, ema: AdapterEMA | None = None) -> dict[str, Any]:
    """Everything but a sharded checkpoint's shards, which every rank loads together after (engine/distributed/fsdp.py)."""
    if loaded.shards is None:
        missing = set(params) ^ set(loaded.adapter)
        if missing:
            raise JobInvalid(f"checkpoint {loaded.path.name} does not match the model's LoRA parameters: "
                             f"{sorted(missing)[:3]}")
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(loaded.adapter[n])
        load_optimizer_state(optimizer, join_tree(loaded.optimizer_tree, loaded.optimizer_tensors))
    if ema is not None:
        ema.load(loaded.extra.get("ema", {}))
    warning = restore(loaded.state["rng"], loaded.rng_tensors, generator)
    if warning and log is not None:
        log.warning("rng_mismatch", message=warning)
    return loaded.state
