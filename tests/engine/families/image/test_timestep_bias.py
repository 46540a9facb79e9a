"""train.timestep_bias: the drawn σ follow the base density reweighted by the band's multiplier."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.config.job import parse_job
from engine.config.train import TimestepBias
from engine.errors import JobInvalid
from engine.families.image.flux import SCHEDULER_DEFAULTS, sample_sigmas
from tests.helpers.images import flux_job_dict

N = 200_000
BINS = np.linspace(0.0, 1.0, 21)


def _histogram(sigmas: torch.Tensor, weights: np.ndarray | None = None) -> np.ndarray:
    h, _ = np.histogram(sigmas.double().numpy(), bins=BINS, weights=weights)
    return h / h.sum()


@pytest.mark.parametrize("kind", ["sigmoid", "linear", "shift"])
@pytest.mark.parametrize("bias", [
    {"strategy": "later", "multiplier": 3.0},
    {"strategy": "earlier", "multiplier": 2.0, "end": 0.3},
    {"strategy": "range", "multiplier": 0.25, "begin": 0.4, "end": 0.7},
])
def test_drawn_sigmas_follow_the_reweighted_density(kind, bias):
    bias = TimestepBias(**bias)
    seq_len = 1024  # the shift kind depends on the image size
    drawn = sample_sigmas(kind, N, seq_len, SCHEDULER_DEFAULTS, torch.Generator().manual_seed(1), bias)
    # The intended density, estimated independently: unbiased draws, each weighted by w(σ).
    base = sample_sigmas(kind, 4 * N, seq_len, SCHEDULER_DEFAULTS, torch.Generator().manual_seed(2))
    a = 0.5 if bias.begin is None and bias.strategy == "later" else (bias.begin or 0.0)
    b = 1.0 if bias.strategy == "later" else bias.end
    inside = ((base >= a) & (base <= b)).numpy()
    intended = _histogram(base, np.where(inside, bias.multiplier, 1.0))
    got = _histogram(drawn)
    assert np.abs(got - intended).max() < 3e-3, np.round(np.c_[BINS[:-1], got, intended], 4)
    # ... and it differs from the unbiased density where the band is.
    assert np.abs(_histogram(base) - intended).max() > 0.01
    assert drawn.min() >= 0.0 and drawn.max() <= 1.0


def test_balanced_draws_exactly_what_no_bias_draws():
    """Jobs without a bias keep their random stream, so their trained weights do not change."""
    for kind in ("sigmoid", "linear", "shift"):
        plain = sample_sigmas(kind, 64, 256, SCHEDULER_DEFAULTS, torch.Generator().manual_seed(5))
        balanced = sample_sigmas(kind, 64, 256, SCHEDULER_DEFAULTS, torch.Generator().manual_seed(5), TimestepBias())
        assert torch.equal(plain, balanced)


@pytest.mark.parametrize("bias, key", [
    ({"strategy": "range", "begin": 0.2}, "strategy range needs both begin and end"),
    ({"strategy": "range", "begin": 0.6, "end": 0.2}, "begin must be below end"),
    ({"strategy": "later", "end": 0.9}, "end: strategy later"),
    ({"strategy": "late"}, "train.timestep_bias.strategy: must be"),
    ({"strategy": "later", "multiplier": 0}, "train.timestep_bias.multiplier"),
    ({"strategy": "later", "power": 2}, "train.timestep_bias.power: unknown key"),
])
def test_bad_bias_settings_are_refused_naming_the_key(tmp_path, bias, key):
    with pytest.raises(JobInvalid, match=r"train.timestep_bias") as e:
        parse_job(flux_job_dict("builtin:tiny-flux", tmp_path, train={"timestep_bias": bias}), tmp_path,
                  check_paths=False)
    assert key in str(e.value) and "\n" not in str(e.value)
