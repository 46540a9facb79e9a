"""The validation loss (`data.validation`): a fixed set of samples, evaluated every N steps.

The set is either a separate dataset (`path`, in data.path's format) or a `fraction` of data.path held
out of training (`holdout`): round(fraction · n) samples, at least one, drawn by a seeded permutation that
depends on train.seed and n alone. Training then never sees them: its dataset is the remaining samples,
renumbered in their original order, and its data order is the usual seeded permutation over those
(engine/data/order.py) — a pure function of the seed, as without validation, but a different order from
the same job without `fraction` (which is why `fraction` is part of the job's identity hash and `path`,
`every_steps` and `batches` are not). The causal LM holds out packed samples (data.seq_len tokens), the image
families hold out images (with every resolution of each), the video families clips (with every window of each).

An evaluation (`evaluate`) reads the first `batches` batches of train.batch_size samples of the set, in a
fixed order, so every evaluation sees the same samples. It runs in eval mode without gradients, on the
weights to evaluate (the EMA's when train.ema is set, schedule-free's averaged point), and draws nothing
from the training RNG: an image family's noise and timesteps for validation sample i come from a generator of
its own seeded from (train.seed, i) (`sample_generator`), so two evaluations differ only by the weights, and the
global RNG is forked around the whole evaluation. On several processes batch k goes to rank k % W and the
sums are all-reduced: every rank takes part, rank 0 reports.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from engine.errors import JobInvalid

STREAM = 0x76616C  # "val": seeds the held-out draw and the samples' generators apart from the training order's


@dataclass
class ValidationSet:
    dataset: Any  # collate(indices) -> a host batch
    indices: list[int]  # the set's samples in `dataset`, in evaluation order


def holdout(n: int, fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """(training indices, held-out indices) of n samples, each ascending."""
    k = max(1, round(fraction * n))
    if k >= n:
        raise JobInvalid(f"data.validation.fraction: {fraction:g} of {n} samples leaves none to train on; lower it "
                         "or give data.validation.path")
    held = set(np.random.Generator(np.random.PCG64([STREAM, seed, n])).permutation(n)[:k].tolist())
    return [i for i in range(n) if i not in held], sorted(held)


def sample_generator(seed: int, index: int) -> torch.Generator:
    """The generator of validation sample `index`: the same draws at every evaluation and on any world size."""
    s = int(np.random.SeedSequence([STREAM, seed, index]).generate_state(1, dtype=np.uint64)[0] >> np.uint64(1))
    g = torch.Generator()
    g.manual_seed(s)
    return g


def due(every_steps: int, step: int) -> bool:
    return step % every_steps == 0


def to_device(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def plan_batches(indices: list[int], batch_size: int, batches: int | None) -> list[list[int]]:
    chunks = [indices[i:i + batch_size] for i in range(0, len(indices), batch_size)]
    return chunks if batches is None else chunks[:batches]


def evaluate(family, model: torch.nn.Module, vset: ValidationSet, cfg, device: torch.device, ranks, log,
             step: int) -> tuple[float, int]:
    """(mean loss per sample over the evaluated batches, number of batches); `model` unwrapped (no DDP hooks)."""
    from engine.training.adapters import compute_autocast

    chunks = plan_batches(vset.indices, cfg.train.batch_size, cfg.data.validation.batches)
    mine = chunks[ranks.world.rank::ranks.world.size]
    total, count = 0.0, 0
    was_training = model.training
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.no_grad():
        model.eval()
        try:
            for k, chunk in enumerate(mine):
                # A long phase: the daemon hears the trainer is alive between the batches.
                log.info("heartbeat", phase="validation", step=step, batch=k + 1, batches=len(mine))
                with compute_autocast(cfg.model.dtype, cfg.lora.dtype, device):
                    loss = family.validation_loss(model, vset.dataset, chunk, cfg.train.seed, device)
                total += float(loss) * len(chunk)
                count += len(chunk)
        finally:
            model.train(was_training)
    total, count = ranks.sum(total, float(count))
    return total / count, len(chunks)
