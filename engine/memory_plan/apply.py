"""Activation checkpointing per block, as the plan chose it.

    keep        the block as it is: autograd saves what it needs
    attention   checkpointed, but the attention kernel's outputs are saved (selective activation checkpointing,
                torch.utils.checkpoint.create_selective_checkpoint_contexts): the backward recomputes the
                projections and the MLP, never the attention, the block's most expensive part at long sequences
    recompute   checkpointed whole: only the block's inputs are saved

The block's `forward` is wrapped in place (like engine/frozen_base/speedups.py's compile), so parameter names,
checkpoints and exports are unchanged, and module hooks (block swapping's) still run around each call. Non-reentrant
checkpointing restores the RNG state for the recomputation, so dropout draws the same mask: on the CPU a
checkpointed step is bit-identical to a kept one (tests/engine/memory_plan/test_memory_plan_resume.py).
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

_ATTENTION_NAMES = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
                    "_scaled_dot_product_fused_attention_overrideable")
ATTENTION_OPS = frozenset(getattr(torch.ops.aten, n).default for n in _ATTENTION_NAMES if hasattr(torch.ops.aten, n))


def _save_attention(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in ATTENTION_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _keep_attention_context():
    return create_selective_checkpoint_contexts(_save_attention)


def _checkpointed(inner, selective: bool, *args, **kwargs):
    if not torch.is_grad_enabled():  # validation and samples: nothing to save, nothing to recompute
        return inner(*args, **kwargs)
    extra = {"context_fn": _keep_attention_context} if selective else {}
    return checkpoint(inner, *args, use_reentrant=False, **extra, **kwargs)


def checkpoint_blocks(blocks: list[nn.Module], activations: tuple[str, ...]) -> dict[str, int]:
    """Wrap each block's forward for its choice; how many blocks got each."""
    done = {"attention": 0, "recompute": 0}
    for block, choice in zip(blocks, activations, strict=True):
        if choice == "keep":
            continue
        block.forward = functools.partial(_checkpointed, block.forward, choice == "attention")
        done[choice] += 1
    return done
