"""A single-file SDXL checkpoint as the base, offline: the tiny SDXL pipeline written as one original-layout file
(tests/helpers/sdxl_single_file.py), its diffusers config given locally (model.single_file_config), trains to
the very files the same job trains from the diffusers directory; what is not an SDXL single file is refused at
submit, naming model.path."""

from __future__ import annotations

import pytest
import torch
import yaml
from safetensors.torch import save_file

from engine.config.job import load_job
from engine.errors import JobInvalid
from tests.helpers.images import make_images, tensor_bytes
from tests.helpers.sdxl_single_file import write_single_file

FILES = ("pytorch_lora_weights.safetensors", "sdxl_lora_comfyui.safetensors")


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """(the diffusers directory, the same model as one file, a data folder)."""
    from engine.builtin.tiny_sdxl import build_tiny_sdxl

    root = tmp_path_factory.mktemp("sdxl-single")
    # bigG wider than CLIP-L, as in SDXL: diffusers' converter tells the two encoders apart by their widths
    build_tiny_sdxl(root / "tiny-sdxl", text_dim_2=24)
    single = write_single_file(root / "tiny-sdxl", root / "my-finetune.safetensors")
    return root / "tiny-sdxl", single, make_images(root / "data", [("a.png", 40, 32, "sks, a yellow sun")])


def _job(path, model: dict, data) -> object:
    d = {"name": "single", "model": {"family": "sdxl", "dtype": "float32", **model},
         "lora": {"rank": 4, "alpha": 8}, "data": {"path": str(data), "resolution": [32]},
         "train": {"steps": 2, "batch_size": 1, "lr": 0.01, "seed": 5, "timestep_sampling": "linear"},
         "checkpoint": {"every_steps": 2, "every_seconds": None, "keep": 1},
         "output": {"formats": ["diffusers", "comfyui"]}}
    path.write_text(yaml.safe_dump(d))
    return path


def test_a_single_file_checkpoint_trains_as_its_diffusers_directory_does(base, tmp_path):
    from engine.recipe import train

    model_dir, single, data = base
    runs = {}
    for name, model in (("dir", {"path": str(model_dir)}),
                        ("file", {"path": str(single), "single_file_config": str(model_dir)})):
        cfg = load_job(_job(tmp_path / f"{name}.yaml", model, data))
        assert train(cfg, tmp_path / name, progress="none") == 0
        runs[name] = tmp_path / name
    assert (runs["file"] / "single-file-base" / "unet" / "config.json").is_file()
    for f in FILES:
        want, got = tensor_bytes(runs["dir"] / "output" / f), tensor_bytes(runs["file"] / "output" / f)
        assert sorted(want) == sorted(got) and want == got, f


def test_what_is_not_an_sdxl_single_file_is_refused_at_submit(base, tmp_path):
    model_dir, single, data = base
    lora = tmp_path / "a-lora.safetensors"
    save_file({"lora_unet_x.lora_down.weight": torch.zeros(1)}, str(lora))
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"\0" * 16)
    for model, words in (
            ({"path": str(lora)}, f"model.path: {lora} is not an SDXL single-file checkpoint"),
            ({"path": str(junk)}, f"model.path: {junk} is not a safetensors checkpoint"),
            ({"path": str(single), "family": "flux"}, "is a single-file checkpoint; lorad trains on diffusers"),
            ({"path": str(model_dir), "single_file_config": str(model_dir)},
             "model.single_file_config: only with a single-file checkpoint as model.path"),
            ({"path": str(single), "single_file_config": str(data)},
             f"model.single_file_config: {data} is not a diffusers directory")):
        with pytest.raises(JobInvalid) as e:
            load_job(_job(tmp_path / "job.yaml", model, data))
        assert words in str(e.value), model
