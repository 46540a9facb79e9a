"""A stack of tiny blocks (a frozen base linear plus a trainable one each) for block-swapping tests."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.utils.checkpoint as ckpt


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.base = nn.Linear(width, width)
        self.base.requires_grad_(False)
        self.lora = nn.Linear(width, width, bias=False)
        nn.init.normal_(self.lora.weight, std=0.02)

    def forward(self, x):
        return x + torch.tanh(self.base(x)) + self.lora(x)


class Stack(nn.Module):
    def __init__(self, n: int = 6, width: int = 32, checkpointing: bool = False):
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(n))
        self.head = nn.Linear(width, 1)
        self.checkpointing = checkpointing

    def forward(self, x):
        for b in self.blocks:
            x = ckpt.checkpoint(b, x, use_reentrant=False) if self.checkpointing else b(x)
        return self.head(x).sum()


def run_steps(model: nn.Module, steps: int = 3) -> tuple[list[float], dict[str, torch.Tensor]]:
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    # The input follows the model: its width from the head, its device from the parameters (a CUDA
    # stack fed a CPU batch of the wrong width could never pass).
    width, device = model.head.in_features, model.head.weight.device
    g = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(steps):
        loss = model(torch.randn(8, width, generator=g).to(device))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def make_stack(**kw) -> Stack:
    torch.manual_seed(1)
    return Stack(**kw)
