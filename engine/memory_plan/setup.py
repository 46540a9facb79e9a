"""The memory plan at an attempt's set-up (engine/recipe.py calls these in order).

    micro_batch    the daemon's floors ($LORAD_MEMORY_PLAN) and the micro-batch they ask for, when the job's
                   global batch keeps it (grad_accum grows to make up the difference)
    with_train     the job with this attempt's train keys (block swap before loading, the plan's after): the
                   identity is always the job's own, computed from the unchanged config
    plan_attempt   the loaded model's costs, the budget, the plan; its activation checkpointing applied; logged
"""

from __future__ import annotations

from typing import Any

import torch

from engine.frozen_base.blockswap import find_blocks
from engine.memory_plan.apply import checkpoint_blocks
from engine.memory_plan.attempt import AttemptMemory, attempt_memory
from engine.memory_plan.budget import vram_budget
from engine.memory_plan.choose import MemoryPlan, plan_for
from engine.memory_plan.costs import measure
from engine.training.dtypes import torch_dtype


def micro_batch(cfg, world_size: int) -> tuple[AttemptMemory, str | None, int]:
    """(floors, a warning about a bad $LORAD_MEMORY_PLAN or None, this attempt's micro-batch)."""
    floor, warning = attempt_memory()
    micro = floor.micro_batch or cfg.train.batch_size
    if cfg.global_batch() % (micro * world_size):  # not a split of this job's global batch: the job's own
        micro = cfg.train.batch_size
    return floor, warning, micro


def with_train(cfg, **train: Any):
    """`cfg` with train keys set for this attempt."""
    return cfg.model_copy(update={"train": cfg.train.model_copy(update=train)})


def plan_attempt(model: torch.nn.Module, cfg, device: torch.device, floor: AttemptMemory, micro: int, grad_accum: int,
                 log) -> MemoryPlan:
    """This attempt's plan for the loaded model (LoRA attached), its activation checkpointing applied, logged as
    the `memory_plan` event (the daemon shows its summary in `lorad status`)."""
    blocks = find_blocks(model)
    costs = measure(model, blocks, cfg, micro, torch_dtype(cfg.model.dtype))
    budget = vram_budget(cfg.resources.vram_gb, device)
    plan = plan_for(cfg, costs, budget, floor, micro, grad_accum, cuda=device.type == "cuda")
    if not plan.family_checkpointing:  # the family's own checkpointing covers every block already
        checkpoint_blocks(blocks, plan.activations)
    log.info("memory_plan", **plan.report(), replan_level=floor.level(), tried=floor.tried)
    return plan
