"""Krea 2's own time and prediction conventions, against Krea2Pipeline on the tiny random pipeline.

The family's training runs (killed twice, both export files, the loaders' key rules) are in
tests/e2e/test_image_families.py with the other image families.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.helpers.kill_chain import Quiet


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    from engine.builtin.tiny_krea2 import build_tiny_krea2

    path = tmp_path_factory.mktemp("tiny-krea2")
    build_tiny_krea2(path)
    return path


@pytest.fixture(scope="module")
def pipe(tiny):
    from diffusers import Krea2Pipeline

    return Krea2Pipeline.from_pretrained(tiny, text_encoder=None, tokenizer=None)


def test_predict_is_the_velocity_krea2pipeline_integrates_and_ignores_caption_padding(pipe):
    """predict (what the loss compares with ε − x0) is the velocity Krea2Pipeline hands its scheduler — the
    transformer's output as it is, at time σ, over the pipeline's packing and position ids — for captions cached
    as [L, layers · D] and padded at the end; the padding's values change nothing."""
    from engine.families.image.krea2 import Krea2Model

    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 4, 4, 4, generator=g)
    layers, dim = pipe.transformer.config.num_text_layers, pipe.transformer.config.text_hidden_dim
    caption = torch.randn(1, 9, layers, dim, generator=g)
    model = Krea2Model()
    packed = model.pack(x)
    with torch.no_grad():
        after = pipe(prompt_embeds=caption, prompt_embeds_mask=torch.ones(1, 9, dtype=torch.bool), guidance_scale=0.0,
                     sigmas=[0.6], latents=packed.clone(), height=32, width=32, output_type="latent").images
        sigma = pipe.scheduler.sigmas[0]  # 0.6 moved by the pipeline's resolution-dependent shift
        velocity = (after - packed) / (0 - sigma)  # the Euler step x + (σ_next − σ)·v, σ_next = 0
        padded = torch.cat([caption.flatten(2), torch.randn(1, 3, layers * dim, generator=g)], dim=1)
        mask = torch.tensor([[1] * 9 + [0] * 3])
        pred = model.predict(pipe.transformer, pipe.transformer, x, sigma[None], padded, mask, None)
    assert float(sigma) != pytest.approx(0.6)  # the shift moved it: the test compares at the pipeline's own σ
    torch.testing.assert_close(pred, velocity, rtol=1e-4, atol=1e-5)


def test_shift_is_the_pipelines_resolution_shift_or_turbos_fixed_one():
    """Base: calculate_shift over 256 … 6400 image tokens (μ 0.5 … 1.15, the pipeline's defaults where the
    scheduler config has none); a distilled (Turbo) directory: the fixed μ = 1.15 it was distilled with."""
    from diffusers.pipelines.krea2.pipeline_krea2 import calculate_shift

    from engine.families.image.krea2 import Krea2Model

    m = Krea2Model()
    assert m.shift_mu({}, 256) == pytest.approx(0.5) and m.shift_mu({}, 6400) == pytest.approx(1.15)
    assert m.shift_mu({"base_shift": 0.5, "max_shift": 1.15}, 1024) == pytest.approx(
        calculate_shift(1024, 256, 6400, 0.5, 1.15))
    assert m.shift_mu({"is_distilled": True}, 256) == m.shift_mu({"is_distilled": True}, 4096) == 1.15


def test_the_family_reads_is_distilled_from_model_index_and_shifts_turbo_by_its_fixed_mu(tiny, tmp_path):
    """Krea2Pipeline's `is_distilled` (model_index.json) is what picks Turbo's fixed μ at inference; the family
    loads it with the transformer, so `shift` sampling follows the same schedule; the cached text's layout
    follows the transformer's tapped-layer count."""
    from engine.config.job import parse_job
    from engine.families import get_family
    from tests.e2e.test_image_families import IMAGES, job_dict
    from tests.helpers.images import make_images

    turbo = tmp_path / "turbo"
    shutil.copytree(tiny, turbo)
    index = json.loads((turbo / "model_index.json").read_text())
    (turbo / "model_index.json").write_text(json.dumps({**index, "is_distilled": True}))
    data = make_images(tmp_path / "data", IMAGES[:1])
    mus = {}
    for name, path in (("base", tiny), ("turbo", turbo)):
        family = get_family("krea2")
        cfg = parse_job(job_dict("krea2", path, data), tmp_path)
        family.load_model(cfg, tmp_path, torch.device("cpu"), Quiet())
        assert family.model.text_layers == 2
        mus[name] = family.model.shift_mu(family.sched, 4096)
    assert mus == {"base": pytest.approx(0.5 + 0.65 * (4096 - 256) / (6400 - 256)), "turbo": 1.15}
