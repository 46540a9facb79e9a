"""Shared pieces of the Flux tests: the tiny random pipeline (built once per session), images, job files.

Import the fixtures into a test module with
`from tests.helpers.images import tiny_flux  # noqa: F401` (pytest finds fixtures by name there).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from tests.helpers.jobs import deep_update

IMAGES = [
    ("wide-0.png", 96, 48, "a red square on grass"),
    ("wide-1.png", 90, 44, "a blue circle in the sky"),
    ("tall-0.png", 40, 80, "a green tower"),
    ("tall-1.png", 44, 90, None),
    ("square-0.png", 64, 64, "a yellow sun"),
]


@pytest.fixture(scope="session")
def tiny_flux(tmp_path_factory) -> Path:
    """A tiny random FLUX.1-dev-shaped diffusers directory (transformer, VAE, CLIP, T5, tokenizers, scheduler)."""
    from engine.builtin.tiny_flux import build_tiny_flux

    dest = tmp_path_factory.mktemp("models") / "tiny-flux"
    build_tiny_flux(dest)
    return dest


def make_images(folder: Path, images=IMAGES, seed: int = 0) -> Path:
    """Procedural RGB images (smooth gradients plus a block, so the VAE sees structure) with captions."""
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for name, w, h, caption in images:
        yy, xx = np.mgrid[0:h, 0:w]
        base = rng.integers(0, 255, size=3)
        arr = np.stack([(base[c] + xx * (c + 1) + yy * (3 - c)) % 256 for c in range(3)], axis=-1).astype(np.uint8)
        arr[h // 4 : h // 2, w // 4 : w // 2] = rng.integers(0, 255, size=3)
        Image.fromarray(arr).save(folder / name)
        if caption is not None:
            (folder / name).with_suffix(".txt").write_text(caption + "\n")
    return folder


def flux_job_dict(model_path: Path | str, data_path: Path | str, **over: Any) -> dict[str, Any]:
    """A small Flux job on the tiny pipeline; `over` updates sections (e.g. train={"steps": 4})."""
    d = {
        "name": "tiny-flux",
        "model": {"family": "flux", "path": str(model_path), "dtype": "float32"},
        "lora": {"rank": 4, "alpha": 8, "dropout": 0.1},
        "data": {"path": str(data_path), "resolution": [48, 64], "trigger": "sks", "caption_dropout": 0.2,
                 "flip": True, "repeats": 2},
        "train": {"steps": 10, "batch_size": 2, "lr": 0.002, "schedule": "constant", "optimizer": "adamw",
                  "seed": 3, "timestep_sampling": "shift", "guidance": 1.0, "max_grad_norm": 1.0},
        "checkpoint": {"every_steps": 3, "every_seconds": None, "keep": 2},
        "output": {"formats": ["diffusers", "comfyui"]},
    }
    return deep_update(d, over)


def write_flux_job(path: Path, model_path: Path | str, data_path: Path | str, **over: Any) -> Path:
    path.write_text(yaml.safe_dump(flux_job_dict(model_path, data_path, **over), sort_keys=False))
    return path


@pytest.fixture(scope="session")
def flux_job(tmp_path_factory, tiny_flux) -> Path:
    """The job every subprocess Flux run shares: two resolutions, flips, dropout, repeats, samples at step 4."""
    root = tmp_path_factory.mktemp("flux-job")
    data = make_images(root / "data")
    return write_flux_job(root / "job.yaml", tiny_flux, data, train={"steps": 12},
                          sample={"every_steps": 4, "prompts": ["sks, a tower at night"], "steps": 2,
                                  "width": 48, "height": 32, "seed": 5})


def tensor_bytes(path: Path) -> dict[str, bytes]:
    """A safetensors file's tensors, by name, as raw bytes (for bit-exact comparison)."""
    import torch
    from safetensors.torch import load_file

    return {k: v.contiguous().view(-1).view(torch.uint8).numpy().tobytes() for k, v in load_file(str(path)).items()}


def with_last_checkpoint(model, workdir: Path):
    """`model` (LoRA-wrapped) with the newest checkpoint's adapter in its trainable parameters, in eval mode."""
    import torch
    from safetensors.torch import load_file

    ckpt = sorted((Path(workdir) / "checkpoints").glob("step-*"))[-1]
    state = load_file(str(ckpt / "adapter.safetensors"))
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert sorted(params) == sorted(state)
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(state[n])
    return model.eval()


# The families on the shared ImageFamily (engine/families/image/base.py): the one tuple the per-family feature
# tests are parametrized over (new ImageModel families join here).
IMAGE_FAMILIES = ("flux2", "qwen_image", "z_image", "chroma", "flux3", "krea2", "ideogram4", "qwen_image_21", "hidream")


@pytest.fixture(scope="session")
def tiny_image_model(tmp_path_factory):
    """tiny_image_model(family) -> the family's tiny builtin pipeline, built once per session on first use."""
    from engine.builtin.models import BUILTIN_MODELS, materialise

    root = tmp_path_factory.mktemp("image-models")

    def build(family: str) -> Path:
        name = next(n for n, m in BUILTIN_MODELS.items() if m.family == family)
        return materialise(name, root)

    return build
