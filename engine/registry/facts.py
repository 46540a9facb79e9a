"""What a model family declares about itself, once, in its own package's `__init__.py` (`FAMILY = Facts(...)`).

Plain data, importable without torch: job validation (engine/config/) reads it to build the `model.family` choices,
the family tables and the built-in models, and engine/registry/families.py finds every package that declares one.
A family's training code lives beside the declaration, in the same package, and is imported only to train.
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

Kind = Literal["text", "image", "video", "edit"]


@dataclass(frozen=True)
class Offline:
    """A `builtin:NAME` model: built offline with random weights by `build` ("module:function", called with the
    destination directory and `kwargs`), complete when `marker` exists in it."""

    name: str
    description: str
    build: str
    marker: str = "model_index.json"
    kwargs: tuple[tuple[str, object], ...] = ()
    pipeline: str | None = None  # its model_index.json's pipeline class, where job validation needs it (edit bases)
    spatial_multiple: int | None = None  # where it differs from the family's (Wan 2.2 TI2V-5B's 16x VAE)


@dataclass(frozen=True)
class Facts:
    """One model family.

    name: its `model.family`; display: how docs, messages and model cards name it; kind: what it trains on (text,
    image, video; edit: an image family that trains on control pairs only); joined: its place in lists and messages
    (the order families joined lorad); trainer: "module:callable" returning its Family (engine/families/base.py).
    edits: an image family that also trains edit LoRAs on an edit base (data.control_path).
    adapter_types: the lora.type values whose files its loaders apply as trained; why_not_others: the line that
    says why a type outside them is refused.
    spatial_multiple: pixels per latent token side (VAE factor × patch) of its reference base, that every bucket
    side is a multiple of; spatial_rule: "module:function" reading a model directory's configs (torch-free) for
    the multiple of a base that differs. temporal: the VAE's temporal factor t of a video family (windows of
    t·k + 1 frames).
    offline: its built-in models; export_keys: "module:attribute" of its ComfyUI key rules (the function or table
    that turns a diffusers module name into the key ComfyUI's loader maps), None where it writes no ComfyUI file.
    denoiser: the subfolder of a diffusers directory that holds the network LoRA trains (a job's path is checked for it).
    comfyui_checked: whether its ComfyUI file's names were read from ComfyUI's own sources (False: unverified).
    """

    name: str
    display: str
    kind: Kind
    joined: int
    trainer: str
    adapter_types: tuple[str, ...] = ("lora",)
    why_not_others: str = "its exports are not yet checked against diffusers' and ComfyUI's loaders"
    edits: bool = False
    spatial_multiple: int = 1
    spatial_rule: str | None = None
    temporal: int | None = None
    offline: tuple[Offline, ...] = field(default=())
    export_keys: str | None = None
    denoiser: str = "transformer"  # the model directory's folder of the trained network (SDXL: unet)
    # "module:function" checking a single-file .safetensors checkpoint given as model.path (JobInvalid naming what
    # is wrong), for a family whose trainer converts one (SDXL); None: refused (engine/config/paths.py)
    single_file: str | None = None
    comfyui_checked: bool = True  # False: ComfyUI's key rules for it could not be read (the model card says so)


def training_code(package: str, module: str = "family"):
    """A package `__getattr__` that hands out its training code's names (`from engine.families.image.flux import
    Flux`) while importing the package itself stays torch-free: the module is imported at the first such name."""

    def __getattr__(name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        code = importlib.import_module(f"{package}.{module}")
        return code if name == module else getattr(code, name)

    return __getattr__


def read_config(path: Path) -> dict[str, Any]:
    """A model directory's JSON config, or {} where it has none (for a family's spatial_rule)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
