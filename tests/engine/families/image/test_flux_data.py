"""Flux image data and job keys: buckets, captions, the bucketed order, timestep sampling, config checks."""

from __future__ import annotations

import math
import re

import pytest
import torch
import yaml

from engine.config.job import load_job, parse_job
from engine.data.images import BucketOrder, assign_bucket, buckets_for, make_caption, make_items, scan
from engine.errors import JobInvalid
from engine.families.image.flux import DEFAULT_TARGETS, sample_sigmas
from tests.helpers import images as fh
from tests.helpers.images import IMAGES, flux_job_dict, make_images
from tests.helpers.processes import REPO

tiny_flux = fh.tiny_flux  # shared session fixture



class Log:
    def __init__(self):
        self.events = []

    def info(self, event, **kw):
        self.events.append(("info", event, kw))

    def warning(self, event, **kw):
        self.events.append(("warning", event, kw))


# ------------------------------------------------------------------ buckets
@pytest.mark.parametrize("res", [48, 64, 512, 768, 1024])
def test_buckets_keep_the_area_the_aspect_limit_and_the_step(res):
    step = 16 if res <= 256 else 64
    bs = buckets_for(res)
    assert (res, res) in bs
    for w, h in bs:
        assert w % step == 0 and h % step == 0
        assert w * h <= res * res
        assert max(w / h, h / w) <= 2.0


def test_an_image_goes_to_the_bucket_nearest_its_aspect_ratio():
    assert assign_bucket(1024, 1024, 1024) == (1024, 1024)
    w, h = assign_bucket(1920, 1080, 1024)
    assert w > h and abs(math.log(w / h) - math.log(16 / 9)) < 0.1
    w, h = assign_bucket(800, 1200, 768)
    assert h > w and abs(math.log(h / w) - math.log(1.5)) < 0.12


# ------------------------------------------------------------------ captions
def test_captions_get_the_trigger_and_a_missing_caption_is_the_trigger_with_a_warning(tmp_path):
    make_images(tmp_path)
    log = Log()
    recs = {r.rel: r for r in scan(tmp_path, "txt", "sks", log)}
    assert recs["wide-0.png"].caption == "sks, a red square on grass"
    assert recs["tall-1.png"].caption == "sks" and recs["tall-1.png"].caption_missing
    warned = [kw["image"] for lvl, ev, kw in log.events if ev == "caption_missing"]
    assert warned == ["tall-1.png"] and all(lvl == "warning" for lvl, ev, _ in log.events)
    assert make_caption("sks a man", "sks") == "sks a man"  # already starts with it: not doubled
    assert make_caption("  a\n man ", None) == "a man"


# ------------------------------------------------------------------ order
def _items(tmp_path):
    make_images(tmp_path)
    return make_items(scan(tmp_path, "txt", None), [48, 64])


def test_every_batch_is_one_bucket_and_an_epoch_visits_every_sample_times_repeats(tmp_path):
    items = _items(tmp_path)
    order = BucketOrder(items, batch_size=2, repeats=3, seed=1)
    per_epoch = len(order) // 2
    seen = []
    for k in range(per_epoch):
        batch = order.indices_at(1, 2 * k, 2)
        assert len({items[i].bucket for i in batch}) == 1, batch
        seen += batch
    for i in range(len(items)):
        assert seen.count(i) >= 3  # top-up of a bucket's last batch may add one more
    assert len(seen) == len(order)


def test_the_order_is_a_pure_function_of_seed_and_position(tmp_path):
    items = _items(tmp_path)
    a, b = BucketOrder(items, 2, 2, seed=7), BucketOrder(items, 2, 2, seed=7)
    n = len(a)
    positions = list(range(0, 3 * n, 2))
    forward = [a.indices_at(7, p, 2) for p in positions]
    backward = [b.indices_at(7, p, 2) for p in reversed(positions)][::-1]  # no state carried between calls
    assert forward == backward
    assert forward[: n // 2] != forward[n // 2 : n]  # epochs are shuffled differently
    assert forward != [BucketOrder(items, 2, 2, seed=8).indices_at(8, p, 2) for p in positions]
    with pytest.raises(ValueError):
        a.indices_at(7, 1, 2)  # a batch never starts mid-batch


# ------------------------------------------------------------------ timestep sampling
def test_timestep_sampling_kinds_have_their_documented_shapes():
    sched = {"base_image_seq_len": 256, "max_image_seq_len": 4096, "base_shift": 0.5, "max_shift": 1.15}
    g = torch.Generator().manual_seed(0)
    lin = sample_sigmas("linear", 20000, 1024, sched, g)
    sig = sample_sigmas("sigmoid", 20000, 1024, sched, g)
    small = sample_sigmas("shift", 20000, 256, sched, g)
    big = sample_sigmas("shift", 20000, 4096, sched, g)
    for s in (lin, sig, small, big):
        assert 0.0 <= float(s.min()) and float(s.max()) <= 1.0
    assert abs(float(lin.mean()) - 0.5) < 0.01 and abs(float((lin < 0.25).float().mean()) - 0.25) < 0.01
    # logit-normal: centred on 0.5, fewer extremes than uniform
    assert abs(float(sig.median()) - 0.5) < 0.01 and float((sig < 0.1).float().mean()) < 0.05
    # the shift grows with the number of image tokens: mu = 0.5 at 256 tokens, 1.15 at 4096
    assert float(big.mean()) > float(small.mean()) > 0.55
    # exactly FLUX's time shift of a uniform draw: sigma = e^mu t / (e^mu t + 1 - t), mu = 0.5 at 256 tokens
    t = torch.rand(8, generator=torch.Generator().manual_seed(3))
    e = math.exp(0.5)
    got = sample_sigmas("shift", 8, 256, sched, torch.Generator().manual_seed(3))
    assert torch.allclose(got, e * t / (e * t + 1 - t))


# ------------------------------------------------------------------ config
def test_default_targets_follow_diffusers_and_skip_the_top_level_proj_out(tiny_flux):
    from diffusers import FluxTransformer2DModel

    t = FluxTransformer2DModel.from_pretrained(tiny_flux, subfolder="transformer")
    hit = sorted(n for n, m in t.named_modules() if isinstance(m, torch.nn.Linear) and re.fullmatch(DEFAULT_TARGETS, n))
    assert "proj_out" not in hit and "single_transformer_blocks.0.proj_out" in hit
    assert hit == sorted(
        [f"transformer_blocks.0.{p}" for p in ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj",
                                               "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out", "ff.net.0.proj",
                                               "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2")]
        + [f"single_transformer_blocks.0.{p}" for p in ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp", "proj_out")]
    )


@pytest.mark.parametrize("section,key,value,family,needle", [
    ("data", "flip", True, "causal_lm", "data.flip: only for model.family flux"),
    ("data", "resolution", [512], "causal_lm", "data.resolution: only for model.family flux"),
    ("train", "timestep_sampling", "shift", "causal_lm", "train.timestep_sampling: only for model.family flux"),
    ("data", "seq_len", 128, "flux", "data.seq_len: only for model.family causal_lm"),
    ("data", "packing", False, "flux", "data.packing: only for model.family causal_lm"),
    ("output", "formats", ["peft"], "flux", "output.formats: 'peft' is for causal_lm"),
])
def test_keys_of_the_other_family_are_rejected_by_name(tmp_path, tiny_flux, section, key, value, family, needle):
    make_images(tmp_path / "img")
    d = flux_job_dict(tiny_flux, tmp_path / "img")
    if family == "causal_lm":
        d["model"] = {"family": "causal_lm", "path": "builtin:tiny-llama"}
        d["data"] = {"path": str(REPO / "configs/examples/data/quickstart.jsonl")}
        d["output"] = {"formats": ["peft"]}
        d["train"] = {"steps": 5}
    d.setdefault(section, {})[key] = value
    with pytest.raises(JobInvalid) as e:
        parse_job(d, tmp_path)
    assert needle in str(e.value)


def test_a_flux_job_defaults_to_the_diffusers_format_and_the_family_targets(tmp_path, tiny_flux):
    make_images(tmp_path / "img")
    d = flux_job_dict(tiny_flux, tmp_path / "img")
    del d["output"]
    cfg = parse_job(d, tmp_path)
    assert cfg.output.formats == ["diffusers"] and cfg.lora.targets is None


def test_the_data_folder_must_exist_and_hold_images(tmp_path, tiny_flux):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.txt").write_text("a caption without an image")
    for path, needle in [(tmp_path / "missing", "does not exist"), (tmp_path / "empty", "contains no images"),
                         (tmp_path / "empty" / "notes.txt", "must be a folder of images")]:
        with pytest.raises(JobInvalid) as e:
            parse_job(flux_job_dict(tiny_flux, path), tmp_path)
        assert "data.path" in str(e.value) and needle in str(e.value)


def test_a_flux_model_directory_must_hold_a_transformer(tmp_path):
    make_images(tmp_path / "img")
    (tmp_path / "not-flux").mkdir()
    with pytest.raises(JobInvalid) as e:
        parse_job(flux_job_dict(tmp_path / "not-flux", tmp_path / "img"), tmp_path)
    assert "model.path" in str(e.value) and "transformer/config.json" in str(e.value)


def test_sample_prompts_are_required_when_sampling_is_on(tmp_path, tiny_flux):
    make_images(tmp_path / "img")
    with pytest.raises(JobInvalid) as e:
        parse_job(flux_job_dict(tiny_flux, tmp_path / "img", sample={"every_steps": 10}), tmp_path)
    assert "sample.prompts" in str(e.value)


def test_the_shipped_flux_examples_load(tmp_path):
    real = yaml.safe_load((REPO / "configs/examples/flux-lora.yaml").read_text())
    assert real["model"]["path"] and real["model"]["family"] == "flux"
    # The real job names a model directory that only exists on a GPU box; point it at a hub id to validate the rest.
    real["model"]["path"] = "black-forest-labs/FLUX.1-dev"
    cfg = parse_job(real, REPO / "configs/examples")
    assert cfg.output.formats == ["diffusers", "comfyui"] and cfg.sample.prompts
    tiny = load_job(REPO / "configs/examples/flux-lora-tiny.yaml")
    assert tiny.model.path == "builtin:tiny-flux" and len(IMAGES) >= 4
