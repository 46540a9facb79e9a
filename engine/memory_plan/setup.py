"""The memory plan at an attempt's set-up (engine/recipe.py calls these in order).

    micro_batch    the daemon's floors ($LORAD_MEMORY_PLAN) and the micro-batch they ask for, when the job's
                   global batch keeps it (grad_accum grows to make up the difference)
    load_planned   the model loaded with the floors' block swap (placed on the host, never loaded whole), its plan
                   made and applied: activation checkpointing, block swap and compile
    with_train     the job with this attempt's train keys: the identity is always the job's own, computed from the
                   unchanged config
    plan_attempt   the loaded model's costs, the budget, the plan; its activation checkpointing applied; logged
    samples_config the job as its samples see it: none rendered when a re-plan skipped them
"""

from __future__ import annotations

from typing import Any

import torch

from engine.errors import OutOfMemory
from engine.frozen_base.blockswap import find_blocks
from engine.frozen_base.compiling import start_compiling
from engine.frozen_base.placing import LoadOutOfMemory
from engine.frozen_base.speedups import apply_train_speedups
from engine.memory_plan.apply import checkpoint_blocks
from engine.memory_plan.attempt import AttemptMemory, attempt_memory
from engine.memory_plan.budget import vram_budget
from engine.memory_plan.choose import MemoryPlan, plan_for
from engine.memory_plan.costs import measure
from engine.memory_plan.oom import first_line, needed_bytes
from engine.training.dtypes import torch_dtype

__all__ = ["AttemptMemory", "MemoryPlan", "load_planned", "micro_batch", "plan_attempt", "samples_config", "with_train"]


def micro_batch(cfg, world_size: int, log) -> tuple[AttemptMemory, int]:
    """(floors, this attempt's micro-batch); a bad $LORAD_MEMORY_PLAN is said and ignored."""
    floor, warning = attempt_memory()
    if warning is not None:
        log.warning("memory_plan_ignored", message=warning)
    micro = floor.micro_batch or cfg.train.batch_size
    if cfg.global_batch() % (micro * world_size):  # not a split of this job's global batch: the job's own
        micro = cfg.train.batch_size
    return floor, micro


def load_planned(family, cfg, workdir, device: torch.device, floor: AttemptMemory, micro: int, grad_accum: int,
                 log) -> tuple[torch.nn.Module, MemoryPlan]:
    """The family's model for this attempt, with its memory plan applied; OutOfMemory while it loads."""
    try:
        model = family.load_model(with_train(cfg, blocks_to_swap=max(cfg.train.blocks_to_swap, floor.swap_at_least)),
                                  workdir, device, log)
    except torch.OutOfMemoryError as e:  # placing the base: the plan it was placed with, for the re-plan
        plan = e.plan() if isinstance(e, LoadOutOfMemory) else None
        raise OutOfMemory("load", 0, first_line(e), needed_bytes(e), plan) from None
    plan = plan_attempt(model, cfg, device, floor, micro, grad_accum, log)
    # A model without blocks keeps the job's swap, refused there as before (JobInvalid).
    apply_train_speedups(model, with_train(cfg, blocks_to_swap=plan.swap or cfg.train.blocks_to_swap,
                                           compile=plan.compile).train, device, log)
    if plan.compile:  # the compile caches in the home: loaded now, saved after a step that compiled
        start_compiling(model, family, cfg, workdir, device, log)
    return model, plan


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


def samples_config(cfg, plan: MemoryPlan):
    """The job as its end-of-step work sees it: no samples due when an out-of-memory re-plan skipped them."""
    if plan.samples != "skip":
        return cfg
    return cfg.model_copy(update={"sample": cfg.sample.model_copy(update={"every_steps": None})})
