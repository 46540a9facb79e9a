"""Flux training quality: masked loss, regularisation images, differential output preservation — and their resume."""

from __future__ import annotations

import copy
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from engine.config.job import parse_job
from engine.data.images import BucketOrder
from engine.errors import JobInvalid
from engine.families.image.flux import Flux
from tests.helpers import images as fh
from tests.helpers.fakes import RecLog
from tests.helpers.forked import killed_then_resumed, run_to_end
from tests.helpers.images import IMAGES, make_images

tiny_flux = fh.tiny_flux  # shared session fixture

REG_IMAGES = [("r0.png", 64, 64, "a person standing"), ("r1.png", 96, 48, "a person sitting")]
MASKED = {name for name, *_ in IMAGES[:3]}  # the other two images have no mask file


def quality_job(root: Path, model: Path | str, **over) -> dict:
    """A Flux job with every quality feature: a timestep bias, masks, regularisation images and DOP."""
    from PIL import Image

    data = make_images(root / "data")
    reg = make_images(root / "reg", images=REG_IMAGES, seed=3)
    masks = root / "masks"
    masks.mkdir(exist_ok=True)
    for name, w, h, _ in IMAGES:
        if name in MASKED:  # the left half trains, the right half does not
            a = np.zeros((h, w), np.uint8)
            a[:, : w // 2] = 255
            Image.fromarray(a).save(masks / Path(name).with_suffix(".png"))
    d = fh.flux_job_dict(model, data, **{
        "lora": {"dropout": 0.0},
        "data": {"masks": {"path": str(masks)}, "regularisation": {"path": str(reg), "weight": 0.5, "repeats": 3},
                 "flip": True},
        "train": {"steps": 8, "timestep_bias": {"strategy": "later", "multiplier": 3.0},
                  "dop": {"preservation_class": "person", "weight": 1.0}},
        "checkpoint": {"every_steps": 2},
    })
    return fh.deep_update(d, over)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, tiny_flux):
    """The quality job's family, cache and dataset, prepared once in this process."""
    root = tmp_path_factory.mktemp("quality")
    cfg = parse_job(quality_job(root, tiny_flux), root)
    fam, log = Flux(), RecLog()
    fam.prepare(cfg, root / "work", log)
    return cfg, fam, fam.build_dataset(cfg, root / "work", log), log


def _batch_with(dataset, want) -> dict:
    """The first batch of the run's order whose items satisfy want(items)."""
    for k in range(len(dataset) // 2):
        idx = dataset.indices_at(dataset.order.seed, 2 * k, 2)
        if want([dataset.items[i] for i in idx]):
            return dataset.collate(idx)
    raise AssertionError("no such batch")


def test_each_mask_is_cached_with_its_latent_on_the_latent_grid(prepared):
    cfg, fam, ds, log = prepared
    assert sorted(e["image"] for e in log.named("mask_missing")) == ["square-0.png", "tall-1.png"]
    for i, it in enumerate(fam.items):
        entry = fam.cache.load(fam.plan.item_latent[i])
        if it.mask is None:
            assert "mask" not in entry
            continue
        m, mf = entry["mask"], entry["mask_flip"]
        assert m.shape == entry["latent"].shape[-2:]
        w = m.shape[1]
        # the left half (up to the latent pixel the edge runs through) is 1, the right half 0, mirrored when flipped
        assert (m[:, : w // 2 - 1] == 1).all() and (m[:, w // 2 + 1:] == 0).all()
        assert torch.equal(mf, m.flip(-1))


def test_pixels_outside_the_mask_get_exactly_zero_gradient(prepared, tmp_path):
    cfg, fam, ds, _ = prepared
    model = fam.load_model(cfg, tmp_path, torch.device("cpu"), RecLog())
    batch = _batch_with(ds, lambda items: all(it.mask is not None for it in items))
    outputs = []
    def keep(mod, args, out):
        if out[0].requires_grad:  # not DOP's base pass (no grad)
            out[0].retain_grad()
            outputs.append(out[0])

    hook = model.register_forward_hook(keep)
    loss = fam.loss(model, batch, torch.Generator().manual_seed(0))
    hook.remove()
    loss.backward()
    pred = outputs[0]  # the LoRA prediction of the training prompt (DOP's two passes come after it)
    from diffusers import FluxPipeline

    b, c, h, w = batch["latents"].shape
    # which mask (plain or mirrored) each sample drew is the loss's choice: rebuild both and take the one that
    # matches the gradient's zeros, then check it is exact and complete
    grads = pred.grad.abs()
    for i in range(b):
        packed = [FluxPipeline._pack_latents(m[i][None, None].expand(1, c, h, w), 1, c, h, w)[0]
                  for m in (batch["masks"], batch["masks_flip"])]
        outside = [(p == 0) for p in packed]
        matches = [bool((grads[i][o] == 0).all()) for o in outside]
        assert any(matches), f"sample {i}: pixels outside the mask got gradient"
        inside = packed[matches.index(True)] > 0
        assert (grads[i][inside] > 0).float().mean() > 0.99  # ... while the pixels inside do get one
        assert outside[matches.index(True)].any() and inside.any()


def test_regularisation_images_join_the_order_with_their_own_captions_repeats_and_weight(prepared):
    cfg, fam, ds, _ = prepared
    reg = [i for i, it in enumerate(fam.items) if it.repeats is not None]
    assert len(reg) == len(REG_IMAGES) * len(cfg.data.resolution)
    assert {fam.items[i].record.caption for i in reg} == {c for *_, c in REG_IMAGES}  # no trigger added
    assert all(fam.items[i].loss_weight == 0.5 and fam.items[i].mask is None for i in reg)
    # one epoch: each training item data.repeats (2) times, each regularisation item its own 3 times
    order = BucketOrder(fam.items, 2, cfg.data.repeats, cfg.train.seed)
    seen = [i for k in range(order.n_batches) for i in order.epoch_batches(0)[k]]
    for i in range(len(fam.items)):
        assert seen.count(i) >= (3 if i in reg else 2)  # (the last batch of a bucket may be topped up)
    # a pure function of (seed, position): a fresh order gives the same batches anywhere in the run
    again = BucketOrder(fam.items, 2, cfg.data.repeats, cfg.train.seed)
    assert [again.indices_at(cfg.train.seed, p, 2) for p in (0, 40, 6)] == [
        order.indices_at(cfg.train.seed, p, 2) for p in (0, 40, 6)]
    batch = _batch_with(ds, lambda items: {it.loss_weight for it in items} == {0.5})
    assert batch["loss_weight"].tolist() == [0.5, 0.5]


def test_dop_keeps_the_class_prompt_output_closer_to_the_base(prepared, tmp_path):
    from diffusers import FluxPipeline

    cfg, fam, ds, _ = prepared
    probe = ds.collate(ds.indices_at(cfg.train.seed, 0, 2))
    b, c, h, w = probe["latents"].shape
    g = torch.Generator().manual_seed(123)
    x_t = 0.5 * probe["latents"].float() + 0.5 * torch.randn(probe["latents"].shape, generator=g)

    def class_output(model):
        with torch.no_grad():
            return model(hidden_states=FluxPipeline._pack_latents(x_t, b, c, h, w), timestep=torch.full((b,), 0.5),
                         guidance=torch.ones(b), pooled_projections=probe["class_pooled"],
                         encoder_hidden_states=probe["class_prompt_embeds"],
                         txt_ids=torch.zeros(probe["class_prompt_embeds"].shape[1], 3),
                         img_ids=FluxPipeline._prepare_latent_image_ids(b, h // 2, w // 2, "cpu", torch.float32),
                         return_dict=False)[0]

    def distance_after_training(with_dop: bool) -> float:
        job = cfg.model_copy(deep=True)
        job.train.dop = cfg.train.dop if with_dop else None
        torch.manual_seed(0)
        model = fam.load_model(job, tmp_path, torch.device("cpu"), RecLog())
        base = copy.deepcopy(class_output(model))  # B = 0 at the start: the LoRA is the base
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.02)
        gen = torch.Generator().manual_seed(7)
        for step in range(4):
            loss = fam.loss(model, ds.collate(ds.indices_at(cfg.train.seed, 2 * step, 2)), gen)
            loss.backward()
            opt.step()
            opt.zero_grad()
        return float((class_output(model) - base).pow(2).mean())

    without, with_dop = distance_after_training(False), distance_after_training(True)
    fam.cfg = cfg
    assert without > 0 and with_dop < 0.5 * without, (with_dop, without)


@pytest.mark.parametrize("over, key", [
    ({"data": {"trigger": None}}, "train.dop: "),
    ({"data": {"masks": {"alpha": True, "path": "masks"}}}, "data.masks: give exactly one"),
    ({"data": {"masks": {"path": None}}}, "data.masks: give exactly one"),
    ({"data": {"masks": {"path": "nowhere"}}}, "data.masks.path: "),
    ({"data": {"regularisation": {"path": "nowhere"}}}, "data.regularisation.path: "),
    ({"data": {"regularisation": {"path": "reg", "weight": 0}}}, "data.regularisation.weight: "),
    ({"train": {"dop": {"preservation_class": ""}}}, "train.dop.preservation_class: "),
    ({"train": {"dop": {"preservation_class": "person", "strength": 2}}}, "train.dop.strength: unknown key"),
])
def test_bad_quality_settings_are_refused_naming_the_key(tmp_path, over, key):
    with pytest.raises(JobInvalid) as e:
        parse_job(quality_job(tmp_path, "builtin:tiny-flux", **over), tmp_path)
    assert key in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_the_quality_keys_are_for_the_image_families_only(tmp_path):
    from tests.helpers.jobs import tiny_job

    with pytest.raises(JobInvalid, match=r"data.masks, data.regularisation: only for model.family flux"):
        tiny_job("builtin:tiny-llama", tmp_path, data={"masks": {"alpha": True}, "regularisation": {"path": "x"}})


# ------------------------------------------------------------------ exact resume, all features at once
def _uninterrupted(job: Path, wd: Path) -> Path:
    assert run_to_end(job, wd, timeout=400).named("cache_start")[0]["to_encode"] == 0
    return wd


def test_a_killed_job_with_bias_masks_regularisation_and_dop_resumes_bit_identical(tmp_path, tiny_flux, prepared):
    job = tmp_path / "quality.yaml"
    job.write_text(yaml.safe_dump(quality_job(tmp_path, tiny_flux), sort_keys=False))
    # The same images, masks and captions as `prepared`: its cache (keyed by content) saves each run the encoding.
    for wd in ("uninterrupted", "interrupted"):
        shutil.copytree(Path(prepared[0].data.path).parent / "work" / "cache", tmp_path / wd / "cache")
    with ThreadPoolExecutor(max_workers=2) as pool:
        ref = pool.submit(_uninterrupted, job, tmp_path / "uninterrupted")
        got = pool.submit(killed_then_resumed, job, tmp_path / "interrupted", kill_at=(3, 6), timeout=400)
        ref_wd, from_step = ref.result(timeout=900), got.result(timeout=900)
    for name in ("pytorch_lora_weights.safetensors",):
        want, have = (fh.tensor_bytes(wd / "output" / name) for wd in (ref_wd, tmp_path / "interrupted"))
        assert sorted(want) == sorted(have)
        assert [k for k in want if want[k] != have[k]] == [], f"resumed from step {from_step}"


def test_the_new_keys_at_their_defaults_leave_existing_jobs_hashes_alone_and_set_they_count(tmp_path):
    from tests.helpers.jobs import QUICKSTART_DATA, deep_update, tiny_job_dict

    def hashes(base: dict, overs: list[dict]) -> list[str]:
        return [parse_job(deep_update(base, o), tmp_path, check_paths=False).identity_hash() for o in overs]

    flux = fh.flux_job_dict("builtin:tiny-flux", tmp_path)
    same, *changed = hashes(flux, [
        {"train": {"timestep_bias": {"strategy": "balanced", "multiplier": 2.0}}},
        {"train": {"timestep_bias": {"strategy": "later"}}},
        {"train": {"dop": {"preservation_class": "person"}}},
        {"data": {"masks": {"alpha": True}}},
        {"data": {"regularisation": {"path": "reg"}}},
    ])
    assert same == parse_job(flux, tmp_path, check_paths=False).identity_hash()
    assert len({same, *changed}) == 5
    lm = tiny_job_dict("builtin:tiny-llama", QUICKSTART_DATA)
    same, *changed = hashes(lm, [{"train": {"chunked_loss": "auto"}}, {"train": {"chunked_loss": True}},
                                 {"data": {"train_on": "all"}}])
    assert same == parse_job(lm, tmp_path, check_paths=False).identity_hash()
    assert len({same, *changed}) == 3


def test_alpha_masks_come_from_each_images_alpha_channel(tmp_path):
    from PIL import Image

    from engine.data.images import assign_bucket, scan
    from engine.data.masks import find_masks, mask_for_bucket

    rgba = np.zeros((48, 96, 4), np.uint8)
    rgba[..., :3] = 120
    rgba[:, :48, 3] = 255  # opaque left half
    Image.fromarray(rgba, "RGBA").save(tmp_path / "cut-out.png")
    Image.fromarray(np.full((48, 96, 3), 90, np.uint8)).save(tmp_path / "opaque.png")
    records = scan(tmp_path, "txt", "sks")
    log = RecLog()
    found = find_masks(records, None, True, log)
    assert list(found) == ["cut-out.png"] and [e["image"] for e in log.named("mask_missing")] == ["opaque.png"]
    rec = records[0]
    bucket = assign_bucket(rec.width, rec.height, 48)
    m = mask_for_bucket(rec, found["cut-out.png"], bucket, False, (bucket[1] // 8, bucket[0] // 8))
    w = m.shape[1]
    assert (m[:, : w // 2 - 1] == 1).all() and (m[:, w // 2 + 1:] == 0).all()
