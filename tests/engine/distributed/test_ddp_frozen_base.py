"""DDP with a frozen base that is partly in host memory (block swapping): DDP manages only the adapter.

A real gloo process group of one process, in this process: the device-type check and the start-up broadcast
are DDP's own code, run as on several processes. A `meta` parameter stands in for a swapped block's weight
living on another device type than the rest, as host-resident blocks do beside a GPU model."""

import socket

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from engine.distributed.ddp import ignore_frozen


@pytest.fixture
def one_process_group():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def model_with_a_frozen_block_elsewhere() -> nn.Module:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    model[0].requires_grad_(False)
    model[0].to("meta")  # the swapped block: frozen, on another device type
    return model


def test_ddp_refuses_a_model_whose_frozen_base_is_on_another_device_type(one_process_group):
    with pytest.raises(ValueError, match="same type of devices"):
        DDP(model_with_a_frozen_block_elsewhere())


def test_with_the_frozen_base_ignored_ddp_wraps_it_and_manages_only_the_adapter(one_process_group):
    model = model_with_a_frozen_block_elsewhere()
    assert ignore_frozen(model) == ["0.weight", "0.bias"]
    wrapped = DDP(model)
    assert wrapped.device_type == "cpu"
    assert [p.shape for p in wrapped._module_parameters] == [torch.Size([4, 4]), torch.Size([4])]


class Rope(nn.Module):
    """A base with buffers, as FP8Linear (weight_scale) and the families' RoPE tables have them."""

    def __init__(self):
        super().__init__()
        self.base = nn.Linear(4, 4)
        self.base.requires_grad_(False)
        self.base.register_buffer("weight_scale", torch.ones(4))
        self.register_buffer("freqs", torch.arange(4.0), persistent=False)
        self.lora = nn.Linear(4, 4, bias=False)

    def forward(self, x):
        return self.lora(self.base(x) * self.base.weight_scale + self.freqs)


def test_ddp_broadcasts_none_of_the_frozen_bases_buffers(one_process_group):
    model = Rope()
    assert set(ignore_frozen(model)) >= {"base.weight_scale", "freqs"}
    wrapped = DDP(model)
    assert wrapped.modules_buffers == []  # nothing left for broadcast_buffers to send before each forward
    assert [p.shape for p in wrapped._module_parameters] == [torch.Size([4, 4])]  # the adapter alone
    wrapped(torch.randn(2, 4)).sum().backward()
