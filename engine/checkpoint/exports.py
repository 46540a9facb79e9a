"""A usable LoRA at every save: each checkpoint also holds the user-format files (`step-N/export/`), committed
with it (engine/checkpoint/store.py lists and checksums them in the manifest), or not at all.

The files are the family's own export (diffusers / ComfyUI / peft, as output.formats says), written by the
background writer from the snapshot's host copies, never from the live weights: training goes on meanwhile.
The export code reads an adapter from a module tree (peft's state dict, each LoRA layer's A and B, the base
layers' shapes), so the writer hands it a twin of the model: the module tree copied shallowly once, its
frozen weights and buffers as meta tensors (shapes and dtypes, no memory), and at each save its trainable
parameters set to that save's host copies. One save is in flight at a time, so one twin serves them all.

Which weights are exported follows the final export's rule (engine/checkpoint/output.py): the EMA when
train.ema averages (the raw weights in `export/raw/` with export_raw), schedule-free's evaluation point x
(computed from the saved y and z as its optimizer.eval() does), else the weights as trained. A sharded
(fsdp) checkpoint holds no adapter of its own and gets no export.
"""

from __future__ import annotations

import copy
import os
from functools import partial
from pathlib import Path
from typing import Any

import torch

from engine.checkpoint.store import Snapshot
from engine.report import model_card as card
from engine.storage.fsio import normal_file_mode
from engine.version import lorad_version


def export_meta(cfg, step: int, dataset_size: int) -> dict[str, Any]:
    """What every exported file says about itself (the final output's and each checkpoint's alike)."""
    return {"steps": step, "lorad_version": lorad_version(), "base_model": cfg.model.path, "rank": cfg.lora.rank,
            "alpha": cfg.lora.alpha, "config_hash": cfg.identity_hash(), "dataset_size": dataset_size}


class CheckpointExports:
    """Gives each snapshot the export its writer runs (`Snapshot.export`)."""

    def __init__(self, family, model: torch.nn.Module, cfg, dataset_size: int):
        self.family, self.model, self.cfg, self.dataset_size = family, model, cfg, dataset_size
        self._twin: _Twin | None = None  # built by the first writer, then reused (one save at a time)

    def attach(self, snap: Snapshot, optimizer: torch.optim.Optimizer, params: dict[str, Any]) -> Snapshot:
        """On the training thread: only which optimizer tensors make schedule-free's x; the writer does the rest."""
        if not snap.sharded:
            snap.export = partial(self._write, snap, eval_point(optimizer, params))
        return snap

    def _write(self, snap: Snapshot, evals: dict[str, tuple[str, float]], out: Path) -> list[str]:
        """On the writer's thread, after the host copies are complete: the export files under `out`; their names."""
        if self._twin is None:
            self._twin = _Twin(self.model)
        try:
            return self._export(snap, evals, out)
        finally:
            self._twin.unload()  # holds no host copy (pinned memory on a GPU) between saves

    def _export(self, snap: Snapshot, evals: dict[str, tuple[str, float]], out: Path) -> list[str]:
        trained = dict(snap.adapter)
        for name, (z, weight) in evals.items():  # schedule-free: p.lerp_(z, 1 - 1/beta1), as its eval() does
            trained[name] = trained[name].clone().lerp_(snap.optimizer_tensors[z], weight)
        cfg, meta = self.cfg, export_meta(self.cfg, snap.step, self.dataset_size)
        out.mkdir()
        raw: list[str] = []
        if cfg.train.ema is not None and cfg.train.ema.export_raw:
            (out / "raw").mkdir()
            raw = [f"raw/{n}" for n in self.family.export(self._twin.load(trained), cfg, out / "raw", meta)]
        ema = snap.extra.get("ema") if cfg.train.ema is not None else None
        if ema:  # the average is what the output holds (cast as AdapterEMA.swapped_in's copy_ casts it)
            trained = {n: ema[n].to(t.dtype) for n, t in trained.items()}
        names = self.family.export(self._twin.load(trained), cfg, out, meta)
        about = card.facts(cfg, meta, names, [], self.dataset_size)
        (out / "README.md").write_bytes(card.model_card(cfg, about).encode())  # over peft's empty template
        names = list(dict.fromkeys([*names, *raw, "README.md"]))
        mode = normal_file_mode()
        for p in out.rglob("*"):
            if p.is_file():  # safetensors creates 0600; as readable as the output (engine/checkpoint/output.py)
                os.chmod(p, mode)
        return names


def eval_point(optimizer: torch.optim.Optimizer, params: dict[str, Any]) -> dict[str, tuple[str, float]]:
    """Schedule-free in training mode: parameter name -> (its `z` in the snapshot's optimizer tensors, the lerp
    weight 1 - 1/beta1 its eval() moves y by); empty for any other optimizer."""
    names = {id(p): n for n, p in params.items()}
    out, i = {}, 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            if group.get("train_mode") and "z" in optimizer.state.get(p, {}) and id(p) in names:
                out[names[id(p)]] = (f"state/{i}/z", 1 - 1 / group["betas"][0])
            i += 1
    return out


class _Twin:
    """The model's module tree without its weights, for the family's export to read an adapter from."""

    def __init__(self, model: torch.nn.Module):
        self.root = _shallow(model, {})
        self.loaded: list[str] = []  # the parameters that hold a save's host copies now

    def load(self, tensors: dict[str, torch.Tensor]) -> torch.nn.Module:
        for name, t in tensors.items():
            path, _, leaf = name.rpartition(".")
            self.root.get_submodule(path)._parameters[leaf] = torch.nn.Parameter(t, requires_grad=False)
        self.loaded = list(tensors)
        return self.root

    def unload(self) -> None:
        for name in self.loaded:
            path, _, leaf = name.rpartition(".")
            mod = self.root.get_submodule(path)
            mod._parameters[leaf] = torch.nn.Parameter(_meta(mod._parameters[leaf]), requires_grad=False)
        self.loaded = []


def _meta(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype, device="meta")


def _shallow(mod: torch.nn.Module, memo: dict[int, torch.nn.Module]) -> torch.nn.Module:
    """A copy of `mod` sharing its attributes (configs, peft's settings) but with submodules copied the same
    way and parameters and buffers on the meta device; a module reached twice is copied once."""
    if id(mod) in memo:
        return memo[id(mod)]
    twin = copy.copy(mod)
    memo[id(mod)] = twin
    d = twin.__dict__
    d["_parameters"] = {n: None if p is None else torch.nn.Parameter(_meta(p), requires_grad=False)
                        for n, p in mod._parameters.items()}
    d["_buffers"] = {n: None if b is None else _meta(b) for n, b in mod._buffers.items()}
    d["_modules"] = {n: None if c is None else _shallow(c, memo) for n, c in mod._modules.items()}
    return twin
