"""Buckets never crash a family (issue 41): every bucket side is a multiple of the family's spatial multiple (VAE
factor × patch, declared in its package), so whatever the aspect ratio, resolution and frame count, the latent the
planner gives the family is one its transformer takes. A resolution with no such bucket is refused at submit.

Each family's tiny built-in model is prepared once for the module (one 32 px image or a clip of one window, cached, the
model loaded); hypothesis then draws sizes, and each draw runs the family's own loss on a latent of its bucket.
"""

from __future__ import annotations

import pytest
import torch
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.config.buckets import assign_bucket
from engine.config.job import load_job
from engine.errors import JobInvalid
from engine.registry.families import families, names, spatial_multiple
from tests.helpers.fakes import RecLog
from tests.helpers.images import make_images
from tests.helpers.videos import make_clips

# Per image and video family: its first built-in model (each family's first is its text-to-image/video base).
MODELS = {f.name: f.offline[0].name for f in families().values() if f.kind != "text"}


def job(family: str, model: str, data, **data_over) -> dict:
    d = {"name": "fit", "model": {"family": family, "path": str(model), "dtype": "float32"},
         "lora": {"rank": 2, "alpha": 2}, "data": {"path": str(data), "resolution": [32], **data_over},
         "train": {"steps": 1, "batch_size": 1, "seed": 5}, "output": {"formats": ["diffusers"]}}
    if family in names("video"):
        d["data"].setdefault("frames", [families()[family].temporal + 1])  # one window: t·1 + 1 frames
    return d


def prepare(family: str, model, data, root, **data_over):
    """(family object, LoRA model, its dataset, job) after the family's own prepare, dataset and load."""
    from engine.families import get_family

    (root / f"{family}.yaml").write_text(yaml.safe_dump(job(family, model, data, **data_over)))
    cfg = load_job(root / f"{family}.yaml")
    fam, wd, log = get_family(family), root / f"wd-{family}", RecLog()
    wd.mkdir()
    fam.prepare(cfg, wd, log)
    dataset = fam.build_dataset(cfg, wd, log)
    return fam, fam.load_model(cfg, wd, torch.device("cpu"), log), dataset, cfg


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    from engine.builtin.models import materialise

    root = tmp_path_factory.mktemp("buckets-fit")
    images = make_images(root / "images", [("a.png", 32, 32, "a red square")])
    longest = max(families()[f].temporal or 1 for f in names("video")) + 1  # one window of every video family
    clips = make_clips(root / "clips", [("red.mp4", longest, 32, 32, 16, "a red square")], still=False)
    done = {}

    def get(family: str):
        if family not in done:
            model = materialise(MODELS[family], root / "models")
            data = clips if family in names("video") else images
            fam, lora, dataset, _cfg = prepare(family, model, data, root)
            batch = dataset.collate(dataset.indices_at(5, 0, 1))
            factor = 32 // batch["latents"].shape[-1]  # the 32 px image's latent side: the VAE's factor
            done[family] = fam, lora, batch, factor, spatial_multiple(family, str(model))
        return done[family]

    return get


def test_every_image_and_video_family_is_covered():
    assert set(MODELS) == set(names("image", "edit", "video"))


@pytest.mark.parametrize("family", sorted(MODELS))
@settings(max_examples=4, deadline=None, derandomize=True)
@given(w=st.integers(8, 600), h=st.integers(8, 600), resolution=st.integers(32, 160), k=st.integers(0, 2))
def test_the_family_trains_at_every_bucket_of_any_size(family, prepared, w, h, resolution, k):
    fam, lora, batch, factor, multiple = prepared(family)
    bw, bh = assign_bucket(w, h, resolution, multiple)
    assert bw % multiple == 0 and bh % multiple == 0
    lat = batch["latents"]
    frames = (k + 1,) if lat.dim() == 5 else ()  # a window of 4k + 1 frames is k + 1 latent frames
    sized = {key: v for key, v in batch.items() if not key.startswith("latents")}
    sized["latents"] = torch.randn((1, lat.shape[1], *frames, bh // factor, bw // factor),
                                   generator=torch.Generator().manual_seed(w * h))
    with torch.no_grad():
        loss = fam.loss(lora, sized, torch.Generator().manual_seed(0))
    assert torch.isfinite(loss)


def test_the_wan_5b_repro_trains_at_resolutions_48_and_64(tmp_path):
    """Issue 41's defect: 64x48 clips at data.resolution [48, 64] gave TI2V-5B (16x VAE, patch 2) buckets whose
    latent sides were odd, and the first step died in the transformer."""
    from engine.builtin.models import materialise

    clips = make_clips(tmp_path / "clips", [("wide.mp4", 5, 64, 48, 16, "a red square")], still=False)
    model = materialise("tiny-wan22-5b", tmp_path / "models")
    fam, lora, dataset, cfg = prepare("wan", model, clips, tmp_path, resolution=[48, 64])
    for i in range(len(dataset)):  # before the fix: RuntimeError in the transformer, at the first step
        loss = fam.loss(lora, dataset.collate(dataset.indices_at(cfg.train.seed, i, 1)), torch.Generator())
        assert torch.isfinite(loss)
    assert {it.bucket for it in fam.items} == {(5, 64, 32), (5, 64, 64)}  # not 48x48 or 80x48


def test_a_resolution_below_the_bases_multiple_is_refused_at_submit_naming_it(tmp_path):
    # A Wan base whose VAE compresses 32x, patch 2: every side a multiple of 64, so resolution 48 has no bucket.
    for sub in ("vae", "transformer"):
        (tmp_path / "base" / sub).mkdir(parents=True)
    (tmp_path / "base" / "vae" / "config.json").write_text('{"scale_factor_spatial": 32}')
    (tmp_path / "base" / "transformer" / "config.json").write_text('{"patch_size": [1, 2, 2]}')
    clips = make_clips(tmp_path / "clips", [("wide.mp4", 5, 64, 48, 16, "a red square")], still=False)
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job("wan", tmp_path / "base", clips, resolution=[48, 64])))
    with pytest.raises(JobInvalid) as e:
        load_job(tmp_path / "job.yaml")
    assert "data.resolution: 48 is below the smallest bucket" in str(e.value)
    assert "multiple of 64 px" in str(e.value) and "use at least 64" in str(e.value)
