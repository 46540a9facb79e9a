"""Wan 2.2 A14B's two experts: `transformer` denoises the high-noise steps, `transformer_2` the low-noise ones, split
where the pipeline splits them: t ≥ boundary_ratio · num_train_timesteps (WanPipeline.__call__), that is σ ≥
boundary_ratio, goes to the high-noise expert.

model.expert picks what trains:

- `high` / `low`: that expert alone, with LoRA; σ is drawn from train.timestep_sampling's distribution restricted to
  the expert's side of the boundary (rejection sampling from the checkpointed generator: the same draws on resume);
- `both`: the two, one LoRA each, in one `WanExperts` module, so that one optimizer, one checkpoint and one exact
  resume hold both adapters and their optimizer states. σ is drawn from the whole distribution, so each expert
  gets the share of samples its side has; each sample of a batch goes through the expert that owns its σ, and
  the loss of a batch is the mean over all its samples: an expert's LoRA receives gradients only from its own
  samples.

Exports are one pair of files per expert (engine/families/video/wan/family.py: EXPERT_FILES).
"""

from __future__ import annotations

import torch

from engine.errors import JobInvalid
from engine.families.image.flow_lora import sample_sigmas

EXPERTS = {"high": "transformer", "low": "transformer_2"}


class WanExperts(torch.nn.Module):
    """Both experts, each with its LoRA, under the pipeline's names (`transformer`, `transformer_2`)."""

    def __init__(self, transformer: torch.nn.Module, transformer_2: torch.nn.Module):
        super().__init__()
        self.transformer, self.transformer_2 = transformer, transformer_2

    @property
    def dtype(self) -> torch.dtype:
        return self.transformer.dtype

    @property
    def device(self) -> torch.device:
        return self.transformer.device

    @property
    def config(self):
        return self.transformer.config


def pipeline_settings(path: str, revision: str | None) -> dict:
    """model_index.json's settings (boundary_ratio, expand_timesteps) and which transformers the directory has."""
    from diffusers import DiffusionPipeline

    conf = dict(DiffusionPipeline.load_config(path, revision=revision))
    has = {k for k in ("transformer", "transformer_2") if isinstance(conf.get(k), (list, tuple)) and conf[k][0]}
    return {"boundary_ratio": conf.get("boundary_ratio"), "expand_timesteps": bool(conf.get("expand_timesteps")),
            "transformers": has}


def check_expert(expert: str | None, settings: dict) -> None:
    two = "transformer_2" in settings["transformers"] and settings["boundary_ratio"] is not None
    if two and expert is None:
        raise JobInvalid("model.expert: this Wan model has two experts (transformer for high noise, transformer_2 "
                         "for low noise); set model.expert: high, low or both")
    if not two and expert is not None:
        raise JobInvalid(f"model.expert: {expert} needs a two-expert Wan 2.2 model (A14B: transformer_2 and "
                         "boundary_ratio in model_index.json); this one has one transformer, leave model.expert out")


def expert_sigmas(cfg, expert: str | None, boundary: float | None, batch: int, shift: float,
                  generator: torch.Generator) -> torch.Tensor:
    """σ for one batch: the whole distribution (one transformer, or both experts), or its part on `expert`'s side."""
    kind, bias = cfg.train.timestep_sampling, cfg.train.timestep_bias
    if expert in (None, "both"):
        return sample_sigmas(kind, batch, shift, generator, bias)
    keep = (lambda s: s >= boundary) if expert == "high" else (lambda s: s < boundary)
    got: list[torch.Tensor] = []
    for _ in range(10_000):  # rejection: exact, and the draws are a pure function of the generator's state
        s = sample_sigmas(kind, batch, shift, generator, bias)
        got += list(s[keep(s)])
        if len(got) >= batch:
            return torch.stack(got[:batch])
    raise JobInvalid(f"model.expert: {expert}: train.timestep_sampling {kind} almost never draws σ on this "
                     f"expert's side of the boundary ({boundary})")


def routed(model: torch.nn.Module, boundary: float, sigma: torch.Tensor, forward) -> torch.Tensor:
    """forward(transformer, rows) for the rows of the batch each expert owns, put back in the batch's order."""
    inner = getattr(model, "module", model)
    high = sigma >= boundary
    parts, order = [], []
    for rows, transformer in ((high, inner.transformer), (~high, inner.transformer_2)):
        idx = rows.nonzero().flatten()
        if idx.numel():
            parts.append(forward(transformer, idx))
            order.append(idx)
    return torch.cat(parts)[torch.argsort(torch.cat(order))]
