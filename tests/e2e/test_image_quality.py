"""Masked loss, regularisation images, DOP and the validation loss on every ImageFamily family (FLUX.2, Qwen-Image,
Z-Image, Chroma, ...), with timestep bias and EMA — in process on the loss, and one killed run resumed bit-identical.

The family tuple is tests/helpers/images.IMAGE_FAMILIES; FLUX.1's own are in test_flux_quality.py.
"""

from __future__ import annotations

import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import yaml

from engine.config.job import parse_job
from engine.families import get_family
from tests.helpers.fakes import RecLog
from tests.helpers.forked import killed_then_resumed, run_to_end
from tests.helpers.images import IMAGE_FAMILIES, make_images, tensor_bytes

# One bucket (32x32), so any two images can share a batch.
IMAGES = [("a.png", 32, 32, "a red square on grass"), ("b.png", 36, 36, "a green tower"),
          ("c.png", 32, 32, "a yellow sun")]
MASKED = ("a.png", "b.png")  # the left half trains, the right half does not; c.png has no mask
REG_IMAGES = [("r0.png", 32, 32, "a person standing")]
VAL_IMAGES = [("v0.png", 32, 32, "sks on a hill")]


def features_job(root: Path, family: str, model: Path) -> dict:
    """A job with every quality feature on: masks, regularisation, DOP, validation, timestep bias and EMA."""
    from PIL import Image

    data, reg, val = (make_images(root / n, images=i, seed=s) for n, i, s in
                      (("data", IMAGES, 0), ("reg", REG_IMAGES, 3), ("val", VAL_IMAGES, 5)))
    masks = root / "masks"
    masks.mkdir(exist_ok=True)
    for name, w, h, _ in IMAGES:
        if name in MASKED:
            a = np.zeros((h, w), np.uint8)
            a[:, : w // 2] = 255
            Image.fromarray(a).save(masks / name)
    return {
        "name": f"features-{family.replace('_', '-')}",
        "model": {"family": family, "path": str(model), "dtype": "float32"},
        "lora": {"rank": 4, "alpha": 8},
        "data": {"path": str(data), "resolution": [32], "trigger": "sks", "caption_dropout": 0.2,
                 "masks": {"path": str(masks)}, "regularisation": {"path": str(reg), "weight": 0.5, "repeats": 2},
                 "validation": {"path": str(val), "every_steps": 2}},
        "train": {"steps": 6, "batch_size": 2, "lr": 0.002, "schedule": "constant", "optimizer": "adamw", "seed": 3,
                  "timestep_sampling": "shift", "timestep_bias": {"strategy": "later", "multiplier": 3.0},
                  "dop": {"preservation_class": "person", "weight": 1.0}, "ema": {"decay": 0.9}},
        "checkpoint": {"every_steps": 2, "every_seconds": None, "keep": 2},
        "output": {"formats": ["diffusers", "comfyui"]},
    }


@pytest.fixture(scope="module", params=IMAGE_FAMILIES)
def prepared(request, tmp_path_factory, tiny_image_model):
    """(cfg, family, dataset, model, root) of the features job, cached and loaded once per family; the LoRA's B
    factors are set to small random values, so the adapter changes the output (B = 0 leaves it the base)."""
    family = request.param
    root = tmp_path_factory.mktemp(f"quality-{family}")
    d = features_job(root, family, tiny_image_model(family))
    (root / "job.yaml").write_text(yaml.safe_dump(d, sort_keys=False))
    cfg = parse_job(d, root)
    fam, log = get_family(family), RecLog()
    fam.prepare(cfg, root / "work", log)
    ds = fam.build_dataset(cfg, root / "work", log)
    torch.manual_seed(0)
    model = fam.load_model(cfg, root / "work", torch.device("cpu"), log)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    return SimpleNamespace(cfg=cfg, fam=fam, ds=ds, model=model, root=root, family=family)


def _positions(ds, seed: int) -> list[list[int]]:
    """The batches of the first epoch, in the run's order."""
    return [ds.indices_at(seed, p, 2) for p in range(0, len(ds), 2)]


def _batch_with(p, want) -> dict:
    for idx in _positions(p.ds, p.cfg.train.seed):
        if want([p.ds.items[i] for i in idx]):
            return p.ds.collate(idx)
    raise AssertionError("no such batch")


def _record_predictions(p, monkeypatch) -> list[SimpleNamespace]:
    """Every call of the model's predict: its output (gradient kept), its inputs, and whether the adapter was on."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layer = next(m for m in p.model.modules() if isinstance(m, BaseTunerLayer))
    calls, predict = [], p.fam.model.predict

    def recording(model, inner, x_t, sigma, embeds, mask, cfg):
        out = predict(model, inner, x_t, sigma, embeds, mask, cfg)
        if out.requires_grad:
            out.retain_grad()
        calls.append(SimpleNamespace(out=out, x_t=x_t, sigma=sigma, embeds=embeds, adapter_on=not layer.disable_adapters))
        return out

    monkeypatch.setattr(p.fam.model, "predict", recording)
    return calls


def test_tokens_outside_the_mask_get_exactly_zero_gradient(prepared, monkeypatch):
    p = prepared
    batch = _batch_with(p, lambda items: any(it.mask is not None for it in items))
    calls = _record_predictions(p, monkeypatch)
    p.fam.loss(p.model, batch, torch.Generator().manual_seed(0)).backward()
    p.model.zero_grad(set_to_none=True)
    grad = calls[0].out.grad  # the training prompt's prediction (DOP's passes come after it)
    mask = p.fam.model.pack(batch["masks"][:, None].expand(batch["latents"].shape))
    assert grad.shape == mask.shape and (mask == 0).any() and (mask > 0).any()
    assert (grad[mask == 0] == 0).all(), "tokens outside the mask got gradient"
    assert (grad[mask > 0] != 0).float().mean() > 0.99  # ... while the tokens inside do get one


def test_regularisation_images_come_in_the_order_and_weigh_by_their_loss_weight(prepared):
    p = prepared
    reg = {i for i, it in enumerate(p.fam.items[: p.fam.n_train]) if it.repeats is not None}
    assert reg and all(p.fam.items[i].loss_weight == 0.5 and p.fam.items[i].mask is None for i in reg)
    assert reg <= {i for b in _positions(p.ds, p.cfg.train.seed) for i in b}  # each is trained on every epoch
    batch = _batch_with(p, lambda items: any(it.repeats is not None for it in items) and
                        any(it.repeats is None for it in items))
    assert sorted(batch["loss_weight"].tolist()) == [0.5, 1.0]

    def loss_at(scale: float) -> torch.Tensor:
        with torch.no_grad():
            return p.fam.loss(p.model, {**batch, "loss_weight": batch["loss_weight"] * scale},
                              torch.Generator().manual_seed(1))

    # the flow loss is linear in the per-sample weights (DOP's term does not depend on them)
    torch.testing.assert_close(loss_at(2) - loss_at(1), loss_at(1) - loss_at(0))
    assert loss_at(1) > loss_at(0)


def test_dop_adds_the_class_prompts_distance_from_the_adapter_free_base(prepared, monkeypatch):
    p = prepared
    batch = p.ds.collate(p.ds.indices_at(p.cfg.train.seed, 0, 2))
    calls = _record_predictions(p, monkeypatch)
    with torch.no_grad():
        with_dop = p.fam.loss(p.model, batch, torch.Generator().manual_seed(5))
        train, base, lora = calls
        p.fam.cfg = p.cfg.model_copy(deep=True)
        p.fam.cfg.train.dop = None
        try:
            plain = p.fam.loss(p.model, batch, torch.Generator().manual_seed(5))
        finally:
            p.fam.cfg = p.cfg
    assert len(calls) == 4  # DOP: the caption, then the class prompt without and with the adapter
    assert train.adapter_on and not base.adapter_on and lora.adapter_on
    assert torch.equal(base.embeds, batch["class_prompt_embeds"]) and torch.equal(lora.embeds, base.embeds)
    assert not torch.equal(train.embeds[:, : base.embeds.shape[1]], base.embeds)  # "person", not "sks"
    assert torch.equal(lora.x_t, train.x_t) and torch.equal(lora.sigma, train.sigma)  # the same noisy latents
    term = p.cfg.train.dop.weight * torch.nn.functional.mse_loss(lora.out, base.out)
    assert term > 0
    torch.testing.assert_close(with_dop - plain, term)


def test_the_validation_loss_depends_on_the_weights_alone(prepared):
    p = prepared
    vset = p.fam.validation_set(p.cfg, p.root, RecLog())
    assert vset.indices and min(vset.indices) >= p.fam.n_train
    assert not set(vset.indices) & {i for b in _positions(p.ds, p.cfg.train.seed) for i in b}  # never trained on

    def validation() -> torch.Tensor:
        with torch.no_grad():
            return p.fam.validation_loss(p.model, vset.dataset, vset.indices, p.cfg.train.seed, torch.device("cpu"))

    first = validation()
    g = torch.Generator().manual_seed(9)
    with torch.no_grad():  # training draws in between, in another order: the generators and the global RNG move on
        for pos in (4, 0, 2):
            p.fam.loss(p.model, p.ds.collate(p.ds.indices_at(p.cfg.train.seed, pos, 2)), g)
    torch.manual_seed(1234)
    assert torch.equal(validation(), first)
    b = next(q for n, q in p.model.named_parameters() if "lora_B" in n)
    with torch.no_grad():
        b.add_(0.1)
        moved = validation()
        b.sub_(0.1)
    assert not torch.equal(moved, first)  # ... and the weights do move it


def test_timestep_bias_moves_the_noise_levels_the_family_trains_on(prepared, monkeypatch):
    p = prepared
    sigmas: list[torch.Tensor] = []

    def no_model(model, inner, x_t, sigma, embeds, mask, cfg):  # σ is all this test needs: skip the transformer
        sigmas.append(sigma)
        return p.fam.model.pack(x_t)

    monkeypatch.setattr(p.fam.model, "predict", no_model)
    batch = p.ds.collate(p.ds.indices_at(p.cfg.train.seed, 0, 2))

    def share_below(bias: dict) -> float:
        sigmas.clear()
        p.fam.cfg = p.cfg.model_copy(deep=True)
        p.fam.cfg.train.dop = None
        p.fam.cfg.train.timestep_bias = type(p.cfg.train.timestep_bias)(**bias)
        g = torch.Generator().manual_seed(2)
        try:
            for _ in range(50):
                p.fam.loss(p.model, batch, g)
        finally:
            p.fam.cfg = p.cfg
        return float((torch.cat(sigmas) < 0.1).float().mean())

    balanced = share_below({"strategy": "balanced"})
    biased = share_below({"strategy": "range", "begin": 0.0, "end": 0.1, "multiplier": 100.0})
    # A margin on what is left above 0.1: Ideogram 4's resolution shift already puts most of a 32 px image's σ
    # below 0.1 (its pipeline's μ = 0.5·log(pixels / 512²)).
    assert biased > balanced + 0.4 * (1 - balanced), (biased, balanced)


# ------------------------------------------------------------------ one family's exact resume, every feature on
@pytest.mark.parametrize("prepared", ["z_image"], indirect=True)  # one family's run is enough
def test_a_killed_job_with_every_feature_and_ema_resumes_bit_identical(prepared, tmp_path):
    p = prepared
    job = p.root / "job.yaml"
    for wd in ("uninterrupted", "interrupted"):  # the prepared cache (keyed by content) saves the encoding
        shutil.copytree(p.root / "work" / "cache", tmp_path / wd / "cache")
    with ThreadPoolExecutor(max_workers=2) as pool:
        ref = pool.submit(run_to_end, job, tmp_path / "uninterrupted")
        got = pool.submit(killed_then_resumed, job, tmp_path / "interrupted", kill_at=(3, 4))
        events, from_step = ref.result(timeout=900).events, got.result(timeout=900)
    assert [e for e in events if e.get("event") == "validation"], "no validation loss was reported"
    for name in ("pytorch_lora_weights.safetensors", "z_image_lora_comfyui.safetensors"):
        want, have = (tensor_bytes(tmp_path / wd / "output" / name) for wd in ("uninterrupted", "interrupted"))
        assert sorted(want) == sorted(have)
        assert [k for k in want if want[k] != have[k]] == [], f"{name} differs; resumed from step {from_step}"
