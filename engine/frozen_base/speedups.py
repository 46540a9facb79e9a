"""Training-time speed and memory options applied to a loaded, LoRA-wrapped model.

    train.blocks_to_swap: N   stream the frozen weights of the last N blocks from pinned host memory
    train.compile: auto       torch.compile each transformer block's forward (regional compilation); auto: on CUDA

Regional compilation compiles one block's code once and reuses it for every
block of the same type, so compile time does not grow with depth, and the
block-swap hooks stay outside the compiled region (they run in eager mode
around each block's compiled forward). What surrounds torch.compile (once per block, eager after a compile
error or the recompile limit, the cache in the home) is engine/frozen_base/compiling.py. Activation
checkpointing and SDPA are chosen by the family when it loads the model.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from engine.frozen_base import compiling
from engine.frozen_base.blockswap import BlockSwapper, find_blocks, swapped_blocks
from engine.frozen_base.compiling import CompileState, compile_forward, compile_wanted


def compile_blocks(blocks: list[nn.Module], backend: str | None = None, state: CompileState | None = None) -> int:
    """Replace each block's forward by a compiled one, once; return how many blocks were compiled now."""
    state = state or CompileState()
    return sum(compile_forward(block, state, backend or compiling.BACKEND) for block in blocks)


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


def apply_train_speedups(model: nn.Module, train, device: torch.device, log=None,
                         state: CompileState | None = None) -> BlockSwapper | None:
    """Install block swapping and compilation as `train` (the job's TrainConfig) asks; log what was done.

    state: what the compiled forwards report to (engine/frozen_base/compiling.py: the recipe's Compiler)."""
    avoid_cudnn_attention(device, log)
    compile_on = compile_wanted(train, device)
    blocks = find_blocks(model) if (train.blocks_to_swap or compile_on) else []
    swapper = None
    if train.blocks_to_swap:
        n = len(swapped_blocks(model, train.blocks_to_swap))
        swapper = BlockSwapper(blocks, n, device)
        if log is not None:
            log.info("block_swap", blocks=len(blocks), swapped=n,
                     host_bytes=sum(h.numel() * h.element_size() for hs in swapper._host.values() for h in hs))
    if compile_on:
        state = state or CompileState(log)
        compiled = compile_blocks(blocks, state=state) if blocks else 0
        if not blocks:
            compile_forward(model, state, compiling.BACKEND)
        if log is not None:
            log.info("compile", blocks=compiled, whole_model=not blocks)
    return swapper
