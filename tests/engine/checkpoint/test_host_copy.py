"""A checkpoint's host copies (engine/checkpoint/host_copy.py): pinned and asynchronous on a GPU, with an event the
background writer waits on before it serialises; plain synchronous copies on the CPU."""

from __future__ import annotations

import gc
import threading

import pytest
import torch

from engine.checkpoint.host_copy import CopyDone, pinned_like, to_host
from engine.checkpoint.store import CheckpointStore, Snapshot
from engine.checkpoint.writer import AsyncCheckpointer
from engine.frozen_base.swap_ops import LastUse


class CopyInFlight(CopyDone):
    """Copies the device has not finished: the tensor holds its final values only once `land` is set."""

    def __init__(self, tensor: torch.Tensor, final: torch.Tensor):
        super().__init__()
        self.tensor, self.final = tensor, final
        self.land = threading.Event()
        self.waited_in: list[str] = []

    def wait(self) -> None:
        self.waited_in.append(threading.current_thread().name)
        assert self.land.wait(30)
        self.tensor.copy_(self.final)


def test_the_background_writer_waits_for_the_copies_before_it_serialises_and_training_never_does(tmp_path):
    adapter = {"lora.weight": torch.zeros(4)}
    copies = CopyInFlight(adapter["lora.weight"], torch.arange(4.0))
    store = CheckpointStore(tmp_path / "checkpoints", "hash", keep=2)
    saver = AsyncCheckpointer(store)
    saver.submit(Snapshot(3, adapter, {}, {}, {}, {"step": 3}, ready=copies), background=True)
    assert saver.busy() and not (tmp_path / "checkpoints" / "step-00000003").exists()  # submit did not wait
    copies.land.set()
    [result] = saver.wait()
    assert result.error is None
    loaded, _ = CheckpointStore(tmp_path / "checkpoints", "hash", keep=2).load_latest()
    assert torch.equal(loaded.adapter["lora.weight"], torch.arange(4.0))  # the values after the copy landed
    assert copies.waited_in == ["ckpt-3"]  # on the writer's thread


def test_on_the_cpu_host_copies_are_plain_independent_copies_complete_at_once():
    src = {"a": torch.randn(3, 5).t(), "b": torch.arange(6, dtype=torch.int32)}  # a non-contiguous one too
    [host], done = to_host([src])
    assert done.event is None and done.query()
    for k, v in src.items():
        assert torch.equal(host[k], v) and host[k].is_contiguous()
        assert host[k].untyped_storage().data_ptr() != v.untyped_storage().data_ptr()
    src["b"].add_(1)
    assert torch.equal(host["b"], torch.arange(6, dtype=torch.int32))


class FakeCudart:
    def __init__(self):
        self.calls = []

    def cudaHostRegister(self, ptr, nbytes, flags):
        self.calls.append(("register", ptr, nbytes))
        return 0

    def cudaHostUnregister(self, ptr):
        self.calls.append(("unregister", ptr))
        return 0


class FakeEvent:
    def __init__(self, calls):
        self.calls = calls

    def synchronize(self):
        self.calls.append(("synchronize",))


def test_snapshot_buffers_are_exactly_sized_and_unregistered_after_the_copies_once_dropped(monkeypatch):
    asked = []
    real_empty = torch.empty

    def empty(*args, **kw):
        asked.append(kw)
        return real_empty(*args, **kw)

    cudart = FakeCudart()
    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    last = LastUse()
    # 4,000 and 6,006 bytes: the pinned allocator would hand out 4,096 and 8,192
    like = [torch.zeros(1000), torch.zeros(3, 1001, dtype=torch.bfloat16)]
    host = [pinned_like(t, last) for t in like]
    assert not any(kw.get("pin_memory") for kw in asked)
    assert [c[2] for c in cudart.calls] == [4000, 6006]
    for h, t in zip(host, like, strict=True):
        assert h.shape == t.shape and h.dtype == t.dtype and h.untyped_storage().nbytes() == t.numel() * t.element_size()
    host[0].copy_(torch.arange(1000.0))
    assert torch.equal(host[0], torch.arange(1000.0))
    ptrs = [h.data_ptr() for h in host]
    last.event = FakeEvent(cudart.calls)  # to_host records it after queuing the copies
    del host, h
    gc.collect()
    after = cudart.calls[2:]
    assert after[0::2] == [("synchronize",)] * 2  # each waits for the copies before it lets its buffer go
    assert sorted(c[1] for c in after[1::2]) == sorted(ptrs)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_gpu_host_copies_are_pinned_and_queued_without_waiting_for_the_device():
    src = {"a": torch.randn(1024, 1024, device="cuda"), "step": torch.tensor(7.0)}
    torch.cuda._sleep(200_000_000)  # the compute stream is busy for a while (~0.1 s)
    [host], done = to_host([src])
    assert not done.query()  # queued behind the busy stream: the call returned before the copy ran
    assert host["a"].is_pinned() and host["step"].item() == 7.0
    assert host["a"].untyped_storage().nbytes() == 1024 * 1024 * 4  # exactly, not a pinned-cache block
    expected = src["a"].cpu()
    done.wait()
    assert torch.equal(host["a"], expected)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_gpu_an_in_place_update_after_the_snapshot_never_reaches_the_copy():
    src = {"a": torch.zeros(4096, 4096, device="cuda")}
    torch.cuda._sleep(200_000_000)
    [host], done = to_host([src])
    src["a"].add_(1)  # the next optimizer step, queued right after the snapshot
    done.wait()
    assert host["a"].abs().sum().item() == 0
