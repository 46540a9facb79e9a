"""The trainer keeps SDPA off cuDNN on CUDA: its attention backward crashed at the FLUX.1-dev shape
on an H200 (bench/RESULTS.md). The flag is process-wide, so each test restores it."""

import pytest
import torch

from engine.frozen_base.speedups import avoid_cudnn_attention
from tests.helpers.fakes import RecLog


@pytest.fixture
def cudnn_sdp_restored():
    before = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(True)
    yield
    torch.backends.cuda.enable_cudnn_sdp(before)


def test_on_cuda_the_cudnn_attention_backend_is_turned_off_and_the_change_is_logged(cudnn_sdp_restored):
    log = RecLog()
    assert avoid_cudnn_attention(torch.device("cuda"), log) is True
    assert torch.backends.cuda.cudnn_sdp_enabled() is False
    assert log.events == [("info", "attention_backend", {"cudnn": False})]
    assert avoid_cudnn_attention(torch.device("cuda"), log) is False  # once is enough
    assert len(log.events) == 1


def test_on_the_cpu_nothing_changes(cudnn_sdp_restored):
    log = RecLog()
    assert avoid_cudnn_attention(torch.device("cpu"), log) is False
    assert torch.backends.cuda.cudnn_sdp_enabled() is True
    assert log.events == []
