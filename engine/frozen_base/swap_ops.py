"""The device calls block swapping makes (engine/frozen_base/blockswap.py), behind one seam.

`CudaOps` does them on a GPU; `HostOps` stands in on the CPU, where the "device" copy is a fresh CPU
tensor. Tests drive the swapper with a recording fake of the same calls, which is how the order of
loads, evictions and waits is checked without a GPU.
"""

from __future__ import annotations

import weakref

import torch


class CudaOps:
    """The CUDA calls block swapping makes, in one place (tests replace it with a recording fake)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device=device)

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        return PINNED.host_buffer(nbytes)

    def release_host(self, flat: torch.Tensor) -> None:
        PINNED.release_host(flat)

    def upload(self, flat: torch.Tensor) -> tuple[torch.Tensor, object]:
        """Start copying one block on the side stream; the device buffer and an event for its end."""
        with torch.cuda.stream(self.stream):
            dev = flat.to(self.device, non_blocking=True)  # one DMA for the whole block
            ready = torch.cuda.Event()
            ready.record(self.stream)
        return dev, ready

    def use(self, dev: torch.Tensor, ready) -> None:
        """The compute stream waits for the copy; the allocator learns that stream uses the buffer."""
        current = torch.cuda.current_stream(self.device)
        current.wait_event(ready)
        dev.record_stream(current)  # allocated on the side stream, used on the compute stream

    def mark(self, block: int):
        """An event at the compute stream's current point: after it, an evicted block's memory is free."""
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def wait_for(self, ev) -> None:
        ev.synchronize()


class RegisteredHost:
    """Exactly-sized page-locked host memory, without a stream: block swapping's and the checkpoint snapshots'."""

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        # Exactly sized, then page-locked: `pin_memory=True` would round it up to a power of two (and keep it in
        # PyTorch's pinned cache for the life of the process).
        flat = torch.empty(nbytes, dtype=torch.uint8)
        _check(torch.cuda.cudart().cudaHostRegister(flat.data_ptr(), nbytes, 0), "cudaHostRegister", nbytes)
        return flat

    def release_host(self, flat: torch.Tensor) -> None:
        _check(torch.cuda.cudart().cudaHostUnregister(flat.data_ptr()), "cudaHostUnregister", flat.numel())

    def wait_for(self, ev) -> None:
        ev.synchronize()


PINNED = RegisteredHost()


class HostOps:
    """On the CPU the "device" copy is a fresh CPU tensor and there is nothing to wait for."""

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def release_host(self, flat: torch.Tensor) -> None:
        pass

    def upload(self, flat: torch.Tensor):
        return flat.clone(), None

    def use(self, dev: torch.Tensor, ready) -> None:
        pass

    def mark(self, block: int):
        return None

    def wait_for(self, ev) -> None:
        pass


class LastUse:
    """The event of the last upload from one host buffer: what its release waits for."""

    __slots__ = ("event",)

    def __init__(self):
        self.event = None


def owned_host_buffer(ops, nbytes: int, last: LastUse | None = None) -> tuple[torch.Tensor, LastUse]:
    """An exactly-sized host buffer from `ops` whose registration ends with the buffer itself.

    The tensor returned shares its memory with the registered one through a numpy array that only its storage
    holds; when the last view of the buffer goes (the model is dropped), a finalizer on that array waits for the
    last upload from it (`LastUse.event`, set by the caller), unregisters it, and only then lets the memory be
    freed: PyTorch's own pinned allocator keeps that order too. Nobody has to remember a release call, and a
    freed address is never still registered (re-registering it later fails with CUDA error 712).
    """
    raw = ops.host_buffer(nbytes)
    last = last or LastUse()
    arr = raw.numpy()  # holds `raw`; held in turn only by the storage of the tensor below
    flat = torch.from_numpy(arr)
    # Not at exit: the process's end releases every registration, and CUDA may be going down by then.
    weakref.finalize(arr, _release, ops, raw, last).atexit = False
    return flat, last


def _release(ops, raw: torch.Tensor, last: LastUse) -> None:
    if last.event is not None:
        ops.wait_for(last.event)  # a copy from the buffer may still be running
    ops.release_host(raw)


def _check(err, call: str, nbytes: int) -> None:
    code = int(getattr(err, "value", err))
    if code != 0:
        raise RuntimeError(f"block swapping: {call} of {nbytes} bytes failed (CUDA error {code}); host memory for "
                           f"the swapped blocks may be short: lower train.blocks_to_swap")
