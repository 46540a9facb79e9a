"""Host copies of training state for a checkpoint, taken at a step boundary without stalling the loop.

On CUDA each tensor is copied into its own pinned host buffer (page-locked: the GPU writes it by DMA,
and the copy returns at once instead of waiting for the device) and an event recorded after the copies
says when they are complete. The buffers are allocated at their exact size and registered with
cudaHostRegister (engine/frozen_base/swap_ops.py), not taken from `pin_memory=True`, which rounds each one
up to a power of two and keeps it in PyTorch's pinned cache for the life of the process; each buffer's
registration ends, after that event, when the snapshot is dropped. The background writer waits on that event before it serialises the
snapshot (checkpoint.Snapshot.files), so the training thread never waits for the device.

The copies are queued on the compute stream, right after the optimizer step that produced the values:
everything that changes those tensors in place later (the next optimizer step, schedule-free's swap to
its averaged weights for samples) is queued behind them, so no copy can read a half-updated tensor,
whatever the loop does next. A side stream would overlap the copy with the next forward, but only with
a wait before every such in-place change; a checkpoint of LoRA state is a few milliseconds of copying.

Each tensor gets its own buffer because safetensors refuses to write tensors that share a storage.
On the CPU the copies are the plain synchronous ones and the event is already complete.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.frozen_base.swap_ops import PINNED, LastUse, owned_host_buffer


@dataclass
class CopyDone:
    """Says when a snapshot's host copies are complete; `event` None: they already are."""

    event: torch.cuda.Event | None = None

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()

    def query(self) -> bool:
        return self.event is None or self.event.query()


def to_host(groups: list[dict[str, torch.Tensor]]) -> tuple[list[dict[str, torch.Tensor]], CopyDone]:
    """Host copies of every tensor of every group (same names), and when they are complete."""
    on_cuda = [t for g in groups for t in g.values() if t.is_cuda]
    if not on_cuda:
        return [{k: v.detach().to("cpu", copy=True).contiguous() for k, v in g.items()} for g in groups], CopyDone()
    last = LastUse()  # the copies' event: what a buffer dropped early waits for before it is unregistered
    out = [{k: _pinned_copy(v, last) for k, v in g.items()} for g in groups]
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(on_cuda[0].device))
    last.event = event
    return out, CopyDone(event)


def _pinned_copy(t: torch.Tensor, last: LastUse) -> torch.Tensor:
    if not t.is_cuda:  # e.g. a step counter an optimizer keeps on the host
        return t.detach().to("cpu", copy=True).contiguous()
    host = pinned_like(t, last)
    with torch.cuda.device(t.device):
        host.copy_(t.detach(), non_blocking=True)
    return host


def pinned_like(t: torch.Tensor, last: LastUse) -> torch.Tensor:
    """A page-locked host tensor of t's shape and dtype, of exactly its bytes."""
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:  # nothing to register
        return torch.empty(t.shape, dtype=t.dtype)
    flat, _ = owned_host_buffer(PINNED, nbytes, last)
    return flat.view(t.dtype).view(t.shape)
