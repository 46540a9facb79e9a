"""Training-time speed and memory options applied to a loaded, LoRA-wrapped model.

    train.blocks_to_swap: N   stream the frozen weights of the last N blocks from pinned host memory
    train.compile: true       torch.compile each transformer block's forward (regional compilation)

Regional compilation compiles one block's code once and reuses it for every
block of the same type, so compile time does not grow with depth, and the
block-swap hooks stay outside the compiled region (they run in eager mode
around each block's compiled forward). Activation checkpointing and SDPA are
chosen by the family when it loads the model.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from engine.frozen_base.blockswap import BlockSwapper, find_blocks, swapped_blocks


def compile_blocks(blocks: list[nn.Module], backend: str = "inductor") -> int:
    """Replace each block's forward by a compiled one; return how many blocks were compiled."""
    for block in blocks:
        block.forward = torch.compile(block.forward, backend=backend, dynamic=False)
    return len(blocks)


def avoid_cudnn_attention(device: torch.device, log=None) -> bool:
    """On CUDA, keep SDPA off its cuDNN backend; return whether the setting was changed.

    Measured, not assumed: on an H200 with torch 2.11 (cu130), the cuDNN attention backward failed at the
    FLUX.1-dev shape ("mha_graph.execute(...).is_good()", then an illegal memory access that ends the
    process). Flash attention, SDPA's next choice on Hopper and Ada, trained the same step
    (bench/RESULTS.md, engine speed). The flag is process-wide, so this runs once, in the trainer.
    """
    if device.type != "cuda" or not torch.backends.cuda.cudnn_sdp_enabled():
        return False
    torch.backends.cuda.enable_cudnn_sdp(False)
    if log is not None:
        log.info("attention_backend", cudnn=False)
    return True


def apply_train_speedups(model: nn.Module, train, device: torch.device, log=None) -> BlockSwapper | None:
    """Install block swapping and compilation as `train` (the job's TrainConfig) asks; log what was done."""
    avoid_cudnn_attention(device, log)
    blocks = find_blocks(model) if (train.blocks_to_swap or train.compile) else []
    swapper = None
    if train.blocks_to_swap:
        n = len(swapped_blocks(model, train.blocks_to_swap))
        swapper = BlockSwapper(blocks, n, device)
        if log is not None:
            log.info("block_swap", blocks=len(blocks), swapped=n,
                     host_bytes=sum(h.numel() * h.element_size() for hs in swapper._host.values() for h in hs))
    if train.compile:
        compiled = compile_blocks(blocks) if blocks else 0
        if not blocks:
            model.forward = torch.compile(model.forward)
        if log is not None:
            log.info("compile", blocks=compiled, whole_model=not blocks)
    return swapper
