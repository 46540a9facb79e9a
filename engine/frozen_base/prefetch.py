"""Double-buffered host→device batch prefetch.

The loop asks for batch k (`get`), queues step k's forward and backward on
the GPU, and only then calls `prefetch(k+1)`: batch k+1 is collated on the
host, pinned, and copied to the GPU on a side stream while the GPU is still
busy with step k's kernels (the host waits for the GPU only afterwards, when
it reads the loss). Step k+1 then only waits on an event that has usually
fired long before. Two batches are alive on the GPU at most (the one in use
and the one in flight).

Batches are addressed by their sample cursor (`consumed`), the same number
the recipe checkpoints, so prefetching never changes which samples a step
sees: a request for a cursor that was not prefetched (the first step, or the
first after a resume) is simply built synchronously.

On the CPU there is nothing to overlap; the prefetcher is a passthrough that
calls `make_batch` at the moment it is asked, so CPU runs are byte-for-byte
the same with or without it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

Batch = dict[str, Any]


class Prefetcher:
    def __init__(self, make_batch: Callable[[int], Batch], device: torch.device):
        """make_batch(cursor) builds the host batch that starts at sample `cursor`."""
        self.make_batch = make_batch
        self.device = torch.device(device)
        self.enabled = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(device=self.device) if self.enabled else None
        self._pending: tuple[int, Batch, Any] | None = None  # (cursor, device batch, ready event)
        self.hits = 0
        self.misses = 0

    def get(self, cursor: int) -> Batch:
        """The device batch for `cursor`: the prefetched one if `prefetch(cursor)` ran, else built now."""
        if not self.enabled:
            return self.make_batch(cursor)
        if self._pending is not None and self._pending[0] == cursor:
            _, batch, ready = self._pending
            self.hits += 1
        else:
            batch, ready = self._copy(cursor)
            self.misses += 1
        self._pending = None
        current = torch.cuda.current_stream(self.device)
        current.wait_event(ready)
        for v in batch.values():
            if isinstance(v, torch.Tensor):
                # The tensor was allocated on the side stream; tell the allocator the compute stream uses it too.
                v.record_stream(current)
        return batch

    def prefetch(self, cursor: int) -> None:
        """Start building and copying the batch at `cursor`; call it once this step's GPU work is queued."""
        if self.enabled and (self._pending is None or self._pending[0] != cursor):
            self._pending = (cursor, *self._copy(cursor))

    def _copy(self, cursor: int) -> tuple[Batch, Any]:
        host = self.make_batch(cursor)
        out: Batch = {}
        with torch.cuda.stream(self._stream):
            for k, v in host.items():
                if isinstance(v, torch.Tensor):
                    # Pinned memory makes the copy a real asynchronous DMA instead of a staged, blocking one.
                    out[k] = v.pin_memory().to(self.device, non_blocking=True)
                else:
                    out[k] = v
            ready = torch.cuda.Event()
            ready.record(self._stream)
        return out, ready
