"""The flow-matching loss weighted per latent pixel (data.masks) and per sample (regularisation images).

    loss = Σ_i w_i · Σ_p m_ip·(pred_ip − target_ip)² / Σ_p m_ip   /  B

Each sample's squared error is averaged over its mask (so a small mask does
not shrink the sample's share of the step), then weighted by its loss weight
(1, or data.regularisation.weight) and averaged over the batch. A pixel with
m = 0 appears only multiplied by 0: its gradient is exactly zero. Without a
mask and weights the family keeps the plain mean squared error.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def weighted_flow_loss(pred: torch.Tensor, target: torch.Tensor, mask: torch.Tensor | None,
                       sample_weight: torch.Tensor | None) -> torch.Tensor:
    """pred, target, mask: [B, ...] alike (mask in [0, 1], None = everywhere); sample_weight [B] or None."""
    err = (pred - target) ** 2
    dims = tuple(range(1, err.ndim))
    if mask is None:
        per_sample = err.mean(dim=dims)
    else:
        # An all-zero mask (nothing to learn from that sample) counts zero, not 0/0.
        per_sample = (err * mask).sum(dim=dims) / mask.sum(dim=dims).clamp(min=1e-8)
    if sample_weight is not None:
        per_sample = per_sample * sample_weight.to(per_sample)
    return per_sample.mean()


def batch_flow_loss(pred: torch.Tensor, target: torch.Tensor, batch: dict, flip: torch.Tensor | None,
                    pack: Callable[[torch.Tensor], torch.Tensor], shape: torch.Size) -> torch.Tensor:
    """The flow loss of a batch: the plain MSE, or weighted_flow_loss with the batch's masks and loss weights.

    pred, target: packed tokens; batch["masks"]: [B, h, w] per latent pixel (the mirrored "masks_flip" where
    `flip` drew), spread over the channels of the latent `shape` [B, C, h, w] and packed by the model's own
    `pack`, so every token sees its own pixels' weights.
    """
    if "masks" not in batch and "loss_weight" not in batch:
        return torch.nn.functional.mse_loss(pred.float(), target)
    mask = None
    if "masks" in batch:
        m = batch["masks"]
        if flip is not None:
            m = torch.where(flip[:, None, None], batch["masks_flip"], m)
        mask = pack(m[:, None].expand(*shape).float().to(pred.device))
    return weighted_flow_loss(pred.float(), target, mask, batch.get("loss_weight"))
