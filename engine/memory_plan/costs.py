"""A model of the bytes one training step takes on the device, per block and per choice.

    weights       each block's frozen parameters, as stored (FP8 with its scales, bf16, ...): resident, or, for a
                  swapped block, streamed with at most two swapped blocks on the device (engine/frozen_base/blockswap.py)
    fixed         everything else that stays: frozen weights outside the blocks, and the adapter with its gradient
                  and optimizer state (ADAPTER_COPIES copies of its bytes)
    activations   per block, per micro-batch of `tokens` tokens of width `hidden`, in elements of the compute dtype:
                      keep       ACT_KEEP  × tokens × hidden   everything autograd saves
                      attention  ACT_ATTN  × tokens × hidden   checkpointed, its input and attention output kept
                                                               (attention is not recomputed; the rest is)
                      recompute  ACT_NONE  × tokens × hidden   checkpointed whole: its input only
                  and, when any block recomputes, one block's `keep` activations while it is recomputed
    compile       inductor's buffers: about one block's `keep` activations (COMPILE_BLOCKS)

ACT_KEEP is Korthikanti et al.'s 34·s·b·h bytes per layer in 16-bit elements (Reducing Activation Recomputation
in Large Transformer Models, 2022), without the s² attention-score term that SDPA/flash attention never
stores. The figures are a model, not a measurement: on a GPU the plan's estimate is logged beside the real peak
(`memory_plan` and the step's peak memory) so it can be calibrated; the out-of-memory re-plan
(engine/memory_plan/attempt.py) catches what it gets wrong.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

ACT_KEEP = 17
ACT_ATTN = 2
ACT_NONE = 1
ADAPTER_COPIES = 4  # weight, gradient, two Adam moments (8-bit states take less: the model errs on the safe side)
COMPILE_BLOCKS = 1
RESERVE = 0.10  # of the budget, never planned: the allocator's fragmentation, cuBLAS/cuDNN workspaces
TEXT_TOKENS = 512  # the image families' caption tokens beside the image tokens (FLUX's T5 length)
PATCH = 16  # pixels per image token side: VAE ×8, 2×2 patches


@dataclass(frozen=True)
class BlockCosts:
    """What the plan weighs: bytes per block per choice, and what no choice changes."""

    block_weights: tuple[int, ...]  # frozen bytes of each block, in forward order
    fixed: int
    act_keep: int  # per block, per micro-batch
    act_attn: int
    act_none: int
    compile_extra: int

    @property
    def blocks(self) -> int:
        return len(self.block_weights)

    def activations(self, choice: str) -> int:
        return {"keep": self.act_keep, "attention": self.act_attn, "recompute": self.act_none}[choice]

    def peak(self, swap: int, activations: tuple[str, ...], compile_: bool) -> int:
        """The estimated peak bytes of one step under these choices (swap: the last `swap` blocks stream)."""
        n = self.blocks
        resident = sum(self.block_weights[:n - swap])
        streamed = sorted(self.block_weights[n - swap:], reverse=True)[:2]  # the swap window: two blocks
        acts = sum(self.activations(a) for a in activations)
        if any(a != "keep" for a in activations):
            acts += self.act_keep  # the block being recomputed holds its whole activations for a moment
        return self.fixed + resident + sum(streamed) + acts + (self.compile_extra if compile_ else 0)


def tokens_per_sample(cfg) -> int:
    """Tokens one sample puts through each block: a causal LM's sequence, an image's patches and caption."""
    data = cfg.data
    if cfg.model.family == "causal_lm":
        return int(data.seq_len)
    side = max(getattr(data, "resolution", None) or [512])
    frames = max(getattr(data, "frames", None) or [1])
    frames = (frames - 1) // 4 + 1  # video: the VAE folds 4 frames into one (4k + 1 frames → k + 1 latents)
    return (side // PATCH) ** 2 * frames + TEXT_TOKENS


def _bytes(params) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def hidden_width(block: nn.Module) -> int:
    """A block's residual width: the input width its linears share most often (q, k, v, the MLP's up-projection)."""
    widths: dict[int, int] = {}
    for m in block.modules():
        if isinstance(m, nn.Linear):
            widths[m.in_features] = widths.get(m.in_features, 0) + 1
        elif hasattr(m, "in_features") and isinstance(m.in_features, int):  # FP8 linears, peft layers
            widths[m.in_features] = widths.get(m.in_features, 0) + 1
    return max(widths, key=lambda w: (widths[w], w)) if widths else 0


def measure(model: nn.Module, blocks: list[nn.Module], cfg, micro_batch: int, compute_dtype: torch.dtype) -> BlockCosts:
    """The costs of `model` (loaded, LoRA attached) whose repeated blocks are `blocks`, for this job's samples."""
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    frozen_out = _bytes(p for p in model.parameters() if not p.requires_grad and id(p) not in in_blocks)
    adapter = _bytes(p for p in model.parameters() if p.requires_grad)
    weights = tuple(_bytes(p for p in b.parameters() if not p.requires_grad) for b in blocks)
    elem = torch.empty((), dtype=compute_dtype).element_size()
    unit = tokens_per_sample(cfg) * micro_batch * (hidden_width(blocks[0]) if blocks else 0) * elem
    return BlockCosts(weights, frozen_out + ADAPTER_COPIES * adapter, ACT_KEEP * unit, ACT_ATTN * unit,
                      ACT_NONE * unit, COMPILE_BLOCKS * ACT_KEEP * unit)
