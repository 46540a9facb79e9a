"""A single-file SDXL checkpoint as the base (`model.path: /models/noobai-xl.safetensors`), what SDXL fine-tunes ship
as: the original (SGM/ldm) layout, UNet, VAE and both CLIP encoders in one file.

The trainer converts it once, before anything else reads the model, into a diffusers directory in the job's
workdir (WORKDIR/single-file-base), and everything after reads that directory as it reads any other:

- diffusers' `StableDiffusionXLPipeline.from_single_file` does the conversion (its ldm -> diffusers key rules,
  loaders/single_file_utils.py). It needs the model's diffusers config (model_index.json, each part's
  config.json, both tokenizers, the scheduler): `model.single_file_config` names it, a local diffusers directory
  or a hub id; unset, diffusers infers the base from the file's keys (stabilityai/stable-diffusion-xl-base-1.0
  for an SDXL base) and reads that config from the Hugging Face Hub (the configs only, a few MB: no weights).
- The weights are read in the job's model.dtype, which is what training reads them in anyway.
- The directory is written to a temporary name, synced, and renamed into place (engine/builtin/models.py's
  materialise): a trainer killed while converting leaves no half directory, and the next attempt converts again;
  a resumed job finds the directory and reads it as it is.
- A v-prediction fine-tune's file does not say it is one: set model.prediction: v (docs/families/sdxl.md).

The copy costs the base's size again on the job's disk (about 7 GB in bf16) for the job's life.
"""

from __future__ import annotations

import functools
from pathlib import Path

CONVERTED = "single-file-base"


# keys only an SDXL base's original layout has: its UNet, and bigG under the second conditioner
SDXL_KEYS = ("model.diffusion_model.", "conditioner.embedders.1.model.")
MAX_HEADER = 16 << 20  # a real SDXL file's header is ~0.2 MB


def check_file(path: str) -> None:
    """At submit: `path` is a safetensors file whose header names an SDXL checkpoint's parts (torch-free: the
    header only). JobInvalid otherwise."""
    import json
    import struct

    from engine.errors import JobInvalid

    with open(path, "rb") as f:
        head = f.read(8)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
        try:
            keys = json.loads(f.read(n)) if 0 < n <= MAX_HEADER else {}
        except ValueError:
            keys = {}
    if not isinstance(keys, dict) or not keys:
        raise JobInvalid(f"model.path: {path} is not a safetensors checkpoint (no readable header)")
    missing = [p for p in SDXL_KEYS if not any(k.startswith(p) for k in keys)]
    if missing:
        raise JobInvalid(f"model.path: {path} is not an SDXL single-file checkpoint (no {', '.join(missing)} keys): "
                         "model.family sdxl reads SDXL's original layout, UNet, VAE and both CLIP encoders in one file")


def is_single_file(path: str) -> bool:
    return path.endswith(".safetensors") and Path(path).is_file()


def convert(src: Path, config: str | None, dtype: str, dest: Path) -> None:
    """Write `src` (one SDXL checkpoint file) as a diffusers directory at `dest`."""
    from diffusers import StableDiffusionXLPipeline

    from engine.training.dtypes import torch_dtype

    pipe = StableDiffusionXLPipeline.from_single_file(str(src), config=config, torch_dtype=torch_dtype(dtype))
    pipe.save_pretrained(dest, safe_serialization=True)


def diffusers_dir(path: str, cfg, workdir: Path, log=None) -> str:
    """`path` itself, or for a single-file checkpoint its diffusers directory under `workdir` (converted once)."""
    if not is_single_file(path):
        return path
    from engine.builtin.models import BuiltinModel, materialise

    if log is not None and not (Path(workdir) / CONVERTED / "model_index.json").is_file():
        log.info("single_file_convert", path=path, config=cfg.model.single_file_config)
    build = functools.partial(convert, Path(path), cfg.model.single_file_config, cfg.model.dtype)
    own = {CONVERTED: BuiltinModel("sdxl", f"{path} as a diffusers directory", "model_index.json", build)}
    return str(materialise(CONVERTED, Path(workdir), own))
