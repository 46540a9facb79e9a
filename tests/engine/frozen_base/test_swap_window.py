"""Block swapping's device calls, driven by a recording fake: the window of two holds on the device too,
and host buffers are exactly sized (issue 29, items 3 and 4).

A real CUDA stream cannot be observed on the CPU, so BlockSwapper takes its device calls from an `ops`
object; this fake does what the CPU's HostOps does and records each call in order."""

from __future__ import annotations

import gc

import pytest
import torch

from engine.frozen_base import swap_ops
from engine.frozen_base.blockswap import BlockSwapper, _layout
from tests.helpers.stacks import make_stack, run_steps


class RecordingOps(swap_ops.HostOps):
    def __init__(self):
        self.calls: list[tuple[str, int]] = []
        self.buffers: list[int] = []
        self._block_of: dict[int, int] = {}  # id(flat) → block, to name uploads

    def host_buffer(self, nbytes):
        self.buffers.append(nbytes)
        return super().host_buffer(nbytes)

    def upload(self, flat):
        self.calls.append(("upload", self._block_of[id(flat)]))
        return flat.clone(), "ready"

    def use(self, dev, ready):
        assert ready == "ready"

    def mark(self, block):
        self.calls.append(("mark", block))
        return block

    def wait_for(self, ev):
        self.calls.append(("wait_for", ev))


class ReleaseRecordingOps(RecordingOps):
    """Also records releases (by address) and gives each upload its own event, to tell which one was waited for."""

    def upload(self, flat):
        dev, _ = super().upload(flat)
        return dev, ("ready", self.calls[-1][1], len(self.calls))

    def use(self, dev, ready):
        assert ready[0] == "ready"

    def release_host(self, flat):
        self.calls.append(("release", flat.data_ptr()))


def swapped_stack(n_blocks=6, swap=4, checkpointing=False, ops_type=RecordingOps):
    model = make_stack(n=n_blocks, checkpointing=checkpointing)
    ops = ops_type()
    swapper = BlockSwapper(list(model.blocks), swap, torch.device("cpu"), ops=ops)
    ops._block_of = {id(f): i for i, f in swapper._flat.items()}
    return model, swapper, ops


@pytest.mark.parametrize("checkpointing", [False, True])
def test_no_block_is_loaded_before_the_compute_stream_has_passed_every_eviction_before_it(checkpointing):
    model, swapper, ops = swapped_stack(checkpointing=checkpointing)
    run_steps(model, steps=2)
    uploads = [c for c in ops.calls if c[0] == "upload"]
    assert len(uploads) >= 8 and [c for c in ops.calls if c[0] == "mark"]
    pending: list[int] = []
    for what, block in ops.calls:
        if what == "mark":
            pending.append(block)
        elif what == "wait_for":
            pending.remove(block)
        else:  # an upload with an eviction not yet waited for would take fresh device memory
            assert pending == [], f"block {block} loaded while the evictions of {pending} may still be in use"


def test_in_the_forward_the_eviction_of_block_i_minus_1_is_waited_for_before_block_i_plus_1_loads():
    model, swapper, ops = swapped_stack(n_blocks=6, swap=6)
    with torch.no_grad():
        model(torch.randn(2, 32))
    calls = ops.calls
    for i in range(1, 5):  # entering block i evicts i-1, then starts loading i+1
        evicted, loaded = calls.index(("mark", i - 1)), calls.index(("upload", i + 1))
        assert evicted < calls.index(("wait_for", i - 1)) < loaded


def test_each_swapped_block_has_one_host_buffer_of_exactly_its_aligned_size():
    model, swapper, ops = swapped_stack(n_blocks=6, swap=4)
    expected = [_layout([p for p in model.blocks[i].parameters() if not p.requires_grad])[-1] for i in range(2, 6)]
    assert ops.buffers == expected
    assert all(swapper._flat[i].numel() == n for i, n in zip(range(2, 6), expected, strict=True))


def test_dropping_the_model_releases_every_host_buffer_after_waiting_for_its_last_upload_with_no_remove_call():
    model, swapper, ops = swapped_stack(n_blocks=6, swap=4, ops_type=ReleaseRecordingOps)
    run_steps(model, steps=2)
    address = {f.data_ptr(): i for i, f in swapper._flat.items()}
    assert not [c for c in ops.calls if c[0] == "release"]  # in use: nothing released while the model lives
    del model, swapper
    gc.collect()
    released = [(k, c[1]) for k, c in enumerate(ops.calls) if c[0] == "release"]
    assert sorted(ptr for _, ptr in released) == sorted(address)  # each buffer once
    for k, ptr in released:
        block = address[ptr]
        last_upload = max(j for j, c in enumerate(ops.calls[:k]) if c == ("upload", block))
        # the release waits for the last copy out of that very buffer, right before letting it go
        assert ops.calls[k - 1] == ("wait_for", ("ready", block, last_upload + 1))


def test_remove_loads_nothing_and_leaves_the_swapped_weights_in_their_host_buffers():
    model, swapper, ops = swapped_stack(n_blocks=6, swap=4)
    with torch.no_grad():
        model(torch.randn(2, 32))  # leaves the window's last block resident
    assert swapper.resident()
    ops.calls.clear()
    swapper.remove()
    # never more than the window on the device: nothing is loaded to take the hooks off
    assert not [c for c in ops.calls if c[0] == "upload"] and swapper.resident() == []
    for i in swapper.swapped:
        lo, hi = swapper._flat[i].data_ptr(), swapper._flat[i].data_ptr() + swapper._flat[i].numel()
        assert all(lo <= p.data_ptr() < hi for p in swapper._params[i])
    with torch.no_grad():
        model(torch.randn(2, 32))  # hooks gone: the model runs from the host copies, loading nothing
    assert not [c for c in ops.calls if c[0] == "upload"]


class FakeCudart:
    def __init__(self, result=0):
        self.result, self.calls = result, []

    def cudaHostRegister(self, ptr, nbytes, flags):
        self.calls.append(("register", ptr, nbytes, flags))
        return self.result

    def cudaHostUnregister(self, ptr):
        self.calls.append(("unregister", ptr))
        return self.result


def test_on_cuda_a_host_buffer_is_allocated_at_its_size_and_registered_never_through_the_rounding_pinned_allocator(
        monkeypatch):
    asked = []
    real_empty = torch.empty

    def empty(*args, **kw):
        asked.append(kw)
        return real_empty(*args, **kw)

    cudart = FakeCudart()
    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    ops = swap_ops.CudaOps.__new__(swap_ops.CudaOps)  # no stream: nothing here needs a GPU
    flat = ops.host_buffer(283_000_000 // 1000)
    assert flat.numel() == 283_000 and flat.dtype == torch.uint8
    assert not any(kw.get("pin_memory") for kw in asked)
    assert cudart.calls == [("register", flat.data_ptr(), 283_000, 0)]
    ops.release_host(flat)
    assert cudart.calls[-1] == ("unregister", flat.data_ptr())


def test_a_failed_registration_names_the_setting_to_lower(monkeypatch):
    monkeypatch.setattr(torch.cuda, "cudart", lambda: FakeCudart(result=2))  # cudaErrorMemoryAllocation
    ops = swap_ops.CudaOps.__new__(swap_ops.CudaOps)
    with pytest.raises(RuntimeError, match="cudaHostRegister of 4096 bytes failed.*train.blocks_to_swap"):
        ops.host_buffer(4096)
