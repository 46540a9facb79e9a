"""FLUX.2 with every linear of the transformer targeted (issue 41): which modules of lorad's ComfyUI file diffusers'
load_lora_weights applies, and which it drops — the list docs/families/flux2-qwen-image.md states. The default
targets (the blocks' linears) load fully both ways: tests/e2e/test_image_families.py."""

from __future__ import annotations

import re

import pytest
import torch
import yaml

from engine.config.job import load_job
from engine.families.image.flux2.family import COMFYUI_FILE
from tests.helpers.images import make_images
from tests.helpers.kill_chain import Quiet
from tests.helpers.lycoris import randomise_adapter
from tests.helpers.processes import REPO

DIFFUSERS_FILE = "pytorch_lora_weights.safetensors"


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """(model dir, output dir, the LoRA modules trained): a FLUX.2 adapter on every linear, randomised, exported."""
    from engine.builtin.models import materialise
    from engine.families import get_family

    root = tmp_path_factory.mktemp("flux2-wide")
    model = materialise("tiny-flux2", root / "models")
    from diffusers import Flux2Transformer2DModel

    linears = sorted(n for n, m in Flux2Transformer2DModel.from_pretrained(model, subfolder="transformer")
                     .named_modules() if isinstance(m, torch.nn.Linear))
    job = {"name": "wide", "model": {"family": "flux2", "path": str(model), "dtype": "float32"},
           "lora": {"rank": 2, "alpha": 2, "targets": "^(" + "|".join(map(re.escape, linears)) + ")$"},
           "data": {"path": str(make_images(root / "data", [("a.png", 32, 32, "a")]))},
           "output": {"formats": ["diffusers", "comfyui"]}}
    (root / "job.yaml").write_text(yaml.safe_dump(job))
    cfg = load_job(root / "job.yaml")
    family = get_family("flux2")
    lora = family.load_model(cfg, root, torch.device("cpu"), Quiet())
    randomise_adapter(lora)
    out = root / "output"
    out.mkdir()
    family.export(lora, cfg, out, {"steps": 1})
    trained = {n for n, m in lora.named_modules() if hasattr(m, "lora_A")}
    assert trained == set(linears)
    return model, out, trained


def _loaded(model, out, weight_name: str) -> set[str]:
    from diffusers import Flux2KleinPipeline

    pipe = Flux2KleinPipeline.from_pretrained(model, text_encoder=None, tokenizer=None)  # the transformer reads it
    pipe.load_lora_weights(str(out), weight_name=weight_name)
    return {n for n, m in pipe.transformer.named_modules() if hasattr(m, "lora_A")}


def stated_dropped() -> set[str]:
    """The modules the FLUX.2 page says diffusers drops from the ComfyUI file (its `dropped:` list)."""
    text = (REPO / "docs" / "families" / "flux2-qwen-image.md").read_text()
    line = re.search(r"^diffusers drops from lorad's FLUX.2 ComfyUI file: (.+)$", text, re.M)
    assert line, "the FLUX.2 page does not list what diffusers drops from a wide-target ComfyUI file"
    return set(re.findall(r"`([\w.]+)`", line.group(1)))


def test_the_diffusers_file_loads_every_wide_target_in_diffusers(wide):
    model, out, trained = wide
    assert _loaded(model, out, DIFFUSERS_FILE) == trained


def test_diffusers_drops_from_the_comfyui_file_exactly_what_the_docs_say(wide):
    model, out, trained = wide
    dropped = trained - _loaded(model, out, COMFYUI_FILE)
    assert dropped, "diffusers read every key: the page's list (and this test) can go"
    assert dropped == stated_dropped()
