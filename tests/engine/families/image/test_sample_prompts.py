"""Sample prompts with their own negative prompt and seed: what reaches the pipeline, per prompt.

The renderer runs with a recording pipeline (the real diffusers pipelines are driven in tests/e2e); the job's
prompts go through the real config and the real cache plan."""

from __future__ import annotations

import types

import pytest
import torch
from PIL import Image

from engine.config.job import JobInvalid, parse_job
from engine.families.image import cache as image_cache
from engine.families.image.sample import SampleRenderer
from tests.helpers.fakes import RecLog
from tests.helpers.images import flux_job_dict, make_images


class RecordingPipeline:
    def __init__(self):
        self.calls = []

    def set_progress_bar_config(self, **kw):
        pass

    def __call__(self, prompt_embeds=None, negative_prompt_embeds=None, height=None, width=None,
                 num_inference_steps=None, guidance_scale=None, generator=None, output_type=None):
        self.calls.append({"prompt": prompt_embeds, "negative": negative_prompt_embeds,
                           "seed": generator.initial_seed()})
        return types.SimpleNamespace(images=[Image.new("RGB", (8, 8))])


class TextCache:
    """Each cached text's embedding is its key's characters, so the test can tell which text reached the pipeline."""

    def __init__(self, plan):
        self.text_of = {k: need.payload for k, need in plan.texts.items()}

    def load(self, key):
        return {"prompt_embeds": torch.tensor([float(ord(c)) for c in self.text_of[key]] or [0.0])}


def job(tmp_path, family="qwen_image", **sample):
    images = make_images(tmp_path / "images")
    d = flux_job_dict("builtin:tiny-qwen-image" if family == "qwen_image" else "builtin:tiny-flux", images,
                      sample={"every_steps": 2, **sample})
    d["model"]["family"] = family
    if family != "flux":
        d["data"].pop("flip", None)
    return parse_job(d, tmp_path)


def render(cfg, tmp_path, negative_kwarg=True):
    plan = image_cache.plan(cfg, [], "builtin", 64)
    pipe = RecordingPipeline()
    text = lambda e: "".join(chr(int(v)) for v in e["prompt_embeds"].tolist() if v)  # noqa: E731

    def kwargs(emb, neg, device, dtype):
        out = {"prompt_embeds": text(emb)}
        if negative_kwarg:
            out["negative_prompt_embeds"] = text(neg)
        return out

    log = RecLog()
    r = SampleRenderer(cfg, "builtin", TextCache(plan), plan, tmp_path / "work", pipeline=lambda t: pipe,
                       prompt_kwargs=kwargs)
    transformer = torch.nn.Linear(1, 1)
    transformer.device, transformer.dtype = torch.device("cpu"), torch.float32  # what a diffusers model has
    r.render(transformer, 2, log)
    return pipe.calls, log


def test_each_prompt_gets_its_own_negative_and_seed_and_the_rest_take_the_defaults(tmp_path):
    cfg = job(tmp_path, seed=100,
              prompts=["sks dog", {"prompt": "sks cat", "negative": "ugly", "seed": 7}, {"prompt": "sks bird"}])
    calls, log = render(cfg, tmp_path)
    assert [(c["prompt"], c["negative"], c["seed"]) for c in calls] == [
        ("sks dog", "", 100), ("sks cat", "ugly", 7), ("sks bird", "", 102)]
    samples = [kw for _lvl, ev, kw in log.events if ev == "samples"]
    assert samples[0]["prompts"] == ["sks dog", "sks cat", "sks bird"]


def test_a_negative_prompt_the_pipeline_cannot_take_is_said_once_per_prompt_not_dropped_silently(tmp_path):
    cfg = job(tmp_path, prompts=[{"prompt": "a", "negative": "blurry"}, {"prompt": "b", "negative": "dark"}, "c"])
    calls, log = render(cfg, tmp_path, negative_kwarg=False)
    assert len(calls) == 3
    warned = [kw["prompt"] for lvl, ev, kw in log.events if ev == "sample_negative_ignored"]
    assert warned == [0, 1]


def test_flux1_refuses_a_negative_prompt_naming_the_key(tmp_path):
    with pytest.raises(JobInvalid, match=r"sample\.prompts: FLUX\.1-dev .* takes no negative prompt"):
        job(tmp_path, family="flux", prompts=[{"prompt": "sks", "negative": "blurry"}])
    assert job(tmp_path, family="flux", prompts=["sks"]).sample.entries() == [("sks", "", 42)]
