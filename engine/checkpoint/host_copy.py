"""Host copies of training state for a checkpoint, taken at a step boundary without stalling the loop.

On CUDA each tensor is copied into its own pinned host buffer (page-locked: the GPU writes it by DMA,
and the copy returns at once instead of waiting for the device) and an event recorded after the copies
says when they are complete. The background writer waits on that event before it serialises the
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
    out = [{k: _pinned_copy(v) for k, v in g.items()} for g in groups]
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(on_cuda[0].device))
    return out, CopyDone(event)


def _pinned_copy(t: torch.Tensor) -> torch.Tensor:
    if not t.is_cuda:  # e.g. a step counter an optimizer keeps on the host
        return t.detach().to("cpu", copy=True).contiguous()
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    with torch.cuda.device(t.device):
        host.copy_(t.detach(), non_blocking=True)
    return host
