"""An exponential moving average of the adapter weights (`train.ema`).

After optimizer step `step` (1-based), when step > start_step and (step - start_step) % every_steps == 0:

    the first such step:  ema = θ                      (the average starts from the weights it first sees)
    every later one:      ema = decay · ema + (1 − decay) · θ

kept in fp32 whatever the adapters' dtype. It is checkpointed as its own safetensors file
(`ema.safetensors`, no pickles) and restored bit-exactly, used for samples (and validation) while
enabled, and exported as the output — the raw weights go to output/raw/ with `export_raw: true`.

Written here rather than taken from a library: torch.optim.swa_utils.AveragedModel averages whole
modules (the frozen base included) and keeps its counter in a buffer; we need the few adapter tensors only,
by name, in the checkpoint's no-pickle form.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


class AdapterEMA:
    def __init__(self, params: dict[str, torch.nn.Parameter], decay: float, every_steps: int, start_step: int):
        self.params, self.decay, self.every, self.start = params, decay, every_steps, start_step
        self.shadow: dict[str, torch.Tensor] | None = None  # None until the first averaging step

    def due(self, step: int) -> bool:
        return step > self.start and (step - self.start) % self.every == 0

    @torch.no_grad()
    def update(self, step: int) -> None:
        if not self.due(step):
            return
        if self.shadow is None:
            self.shadow = {n: p.detach().to(torch.float32, copy=True) for n, p in self.params.items()}
            return
        for n, p in self.params.items():
            self.shadow[n].lerp_(p.detach().to(torch.float32), 1.0 - self.decay)

    def tensors(self) -> dict[str, torch.Tensor]:
        """For the checkpoint: host copies (empty before the first averaging step)."""
        return {n: t.to("cpu", copy=True).contiguous() for n, t in (self.shadow or {}).items()}

    def load(self, tensors: dict[str, torch.Tensor]) -> None:
        if not tensors:
            self.shadow = None
            return
        missing = set(tensors) ^ set(self.params)
        if missing:
            raise ValueError(f"the checkpoint's EMA does not match the adapter's parameters: {sorted(missing)[:3]}")
        self.shadow = {n: tensors[n].to(self.params[n].device, torch.float32) for n in self.params}

    @contextlib.contextmanager
    def swapped_in(self) -> Iterator[None]:
        """Within the block the adapter holds the averaged weights; the raw ones are put back bit for bit."""
        if self.shadow is None:
            yield
            return
        saved = {n: p.detach().clone() for n, p in self.params.items()}
        with torch.no_grad():
            for n, p in self.params.items():
                p.copy_(self.shadow[n])
        try:
            yield
        finally:
            with torch.no_grad():
                for n, p in self.params.items():
                    p.copy_(saved[n])
