"""Differential output preservation (train.dop) for image LoRA.

A LoRA trained on "sks person, ..." tends to turn every person into sks.
DOP keeps the class as the base model draws it: for each batch the captions
with the trigger replaced by the class word ("person, ...", embeddings cached
with the others) go through the model twice at the same noisy latents and σ —
once with the LoRA disabled and no gradient (the target: what the base
predicts for the class), once with it — and the mean squared difference,
times train.dop.weight, is added to the loss. The LoRA learns the trigger
while its output on the class prompt is pulled back to the base's.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def class_prompt(caption: str, trigger: str, preservation_class: str) -> str:
    """The caption with the trigger word replaced by the class word."""
    return caption.replace(trigger, preservation_class)


def preservation_loss(model: torch.nn.Module, predict: Callable[..., torch.Tensor], *conds: torch.Tensor
                      ) -> torch.Tensor:
    """MSE between the LoRA's prediction on the class prompt and the base's (adapters disabled, no grad).

    `predict(*conds)` runs the model at the batch's noisy latents and σ with the class prompt's conditions;
    `model` is the peft-wrapped diffusers transformer (PeftAdapterMixin's disable_adapters / enable_adapters),
    or its DDP wrapper.
    """
    inner = getattr(model, "module", model)
    with torch.no_grad():
        inner.disable_adapters()
        try:
            base = predict(*conds)
        finally:
            inner.enable_adapters()
    return torch.nn.functional.mse_loss(predict(*conds).float(), base.float())


def with_preservation(loss: torch.Tensor, cfg, model: torch.nn.Module, predict: Callable[..., torch.Tensor],
                      batch: dict, conds: tuple[str, ...]) -> torch.Tensor:
    """The loss plus train.dop.weight × the preservation loss on the batch's class prompts (class_NAME for each
    condition NAME); the loss as it is without train.dop."""
    if cfg.train.dop is None:
        return loss
    return loss + cfg.train.dop.weight * preservation_loss(model, predict, *(batch[f"class_{k}"] for k in conds))
