"""train.timestep_bias: emphasise a band of noise levels by reweighting the σ sampling density.

train.timestep_sampling picks a base density p(σ) on [0, 1] (logit-normal,
uniform or shifted uniform; engine/families/image/flux/family.py). A bias multiplies it by
a step weight w(σ) = multiplier inside a band [a, b] and 1 outside, and
samples from

    p'(σ) = p(σ)·w(σ) / Z.

`later` is the band [begin, 1] (default begin 0.5): high noise, where
composition and layout are decided; `earlier` is [0, end] (default end 0.5):
low noise, fine detail and texture; `range` is [begin, end]; `balanced` is no
bias (the default). multiplier > 1 draws the band more often, < 1 less.

Exact sampling with one uniform draw per sample. Every base density is the
image of a uniform u under its quantile function Q (σ = Q(u); F = Q⁻¹ is the
base CDF). Weighting σ by w(σ) weights u by w(Q(u)), which is again a step
function: `multiplier` on [F(a), F(b)], 1 elsewhere. So u is drawn from that
three-piece density by inverting its (piecewise-linear) CDF, and σ = Q(u).
"""

from __future__ import annotations

import math

import torch


def band(strategy: str, begin: float | None, end: float | None) -> tuple[float, float]:
    """The σ band a strategy weights."""
    if strategy == "later":
        return (0.5 if begin is None else begin), 1.0
    if strategy == "earlier":
        return 0.0, (0.5 if end is None else end)
    return float(begin), float(end)


def base_cdf(kind: str, sigma: float, shift: float) -> float:
    """F(σ) of train.timestep_sampling's density; `shift` is e^μ for kind `shift`."""
    if sigma <= 0.0:
        return 0.0
    if sigma >= 1.0:
        return 1.0
    if kind == "sigmoid":  # σ = sigmoid(z), z ~ N(0, 1)
        return 0.5 * (1.0 + math.erf(math.log(sigma / (1.0 - sigma)) / math.sqrt(2.0)))
    if kind == "linear":
        return sigma
    return sigma / (shift * (1.0 - sigma) + sigma)  # the inverse of σ = e·t / (e·t + 1 − t)


def base_quantile(kind: str, u: torch.Tensor, shift: float) -> torch.Tensor:
    """Q(u) = σ: the inverse of base_cdf."""
    if kind == "sigmoid":
        return torch.sigmoid(torch.special.ndtri(u))
    if kind == "linear":
        return u
    return shift * u / (shift * u + (1.0 - u))


def sample_biased(kind: str, batch: int, shift: float, strategy: str, multiplier: float,
                  begin: float | None, end: float | None, generator: torch.Generator) -> torch.Tensor:
    """σ for one batch from the reweighted density (see the module docstring)."""
    a, b = band(strategy, begin, end)
    lo, hi = base_cdf(kind, a, shift), base_cdf(kind, b, shift)
    # u's density: 1 on [0, lo), multiplier on [lo, hi), 1 on [hi, 1]; its CDF, scaled by the total mass:
    mass = [lo, multiplier * (hi - lo), 1.0 - hi]
    total = sum(mass)
    v = torch.rand(batch, generator=generator, dtype=torch.float64) * total
    u = torch.where(v < mass[0], v,
                    torch.where(v < mass[0] + mass[1], lo + (v - mass[0]) / multiplier, hi + (v - mass[0] - mass[1])))
    # ndtri(0) = −inf and sigmoid(−inf) = 0 are fine; keep u inside [0, 1] against rounding.
    return base_quantile(kind, u.clamp(0.0, 1.0), shift).float()
