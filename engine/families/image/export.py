"""What every image family's export shares: the metadata every file carries, the trained LoRA factors
(lora_modules), the kohya/ComfyUI layout over BFL module names (bfl_target by a family's rules,
comfyui_state_dict; FLUX.1's rules and the layout's explanation: flux_export.py), and the diffusers LoRA file of the
FLUX.2 and Qwen-Image families.

`pytorch_lora_weights.safetensors` (output.formats: diffusers) is the layout
the pipelines' `save_lora_weights` writes and `load_lora_weights` reads:

    transformer.<module path>.lora_A.weight   [r, in]
    transformer.<module path>.lora_B.weight   [out, r]   × alpha / r (folded)
    metadata "lora_adapter_metadata"          JSON of the peft LoraConfig with lora_alpha = r, keys prefixed "transformer."

The FLUX.2, Qwen-Image and Z-Image loaders pass no network alphas (`.alpha`
tensors would be refused by FLUX.2's), and ComfyUI reads no adapter metadata:
it applied an unfolded file at scale 1 instead of alpha / r. So the scale is
folded into lora_B and the metadata says lora_alpha = r: diffusers (scale 1
on the folded weights), ComfyUI (scale 1 for a key without `.alpha`) and
anything reading plain A/B apply the trained strength. B'·A equals
(alpha / r)·B·A; for a power-of-two alpha / r the loaded layer's output is
bit-identical to the trained one's, otherwise equal up to one rounding. The
metadata also writes dropout as 0, a training-only setting that would
otherwise stay active in the loaded pipeline. The file is written here rather
than through `save_lora_weights` only so that lorad's own metadata (base
model, steps, trigger, dataset hash) sits beside diffusers' key.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

DIFFUSERS_FILE = "pytorch_lora_weights.safetensors"

_BLOCK = re.compile(r"^(transformer_blocks|single_transformer_blocks)\.(\d+)\.(.+)$")


def metadata(cfg, meta: dict[str, Any]) -> dict[str, str]:
    """lorad's safetensors metadata for an exported adapter (all values strings, as safetensors requires)."""
    return {
        "format": "pt",
        "lorad_version": str(meta.get("lorad_version", "")),
        "base_model": str(meta.get("base_model", cfg.model.path)),
        "rank": str(cfg.lora.rank),
        "alpha": str(cfg.lora.alpha),
        "steps": str(meta.get("steps", "")),
        "trigger": str(meta.get("trigger", "")),
        "dataset_hash": str(meta.get("dataset_hash", "")),
        "lorad_config_hash": str(meta.get("config_hash", "")),
        "lorad_targets": (json.dumps(cfg.lora.targets) if cfg.lora.targets is not None
                          else f"{cfg.model.family}-default"),
        "lorad_adapter_type": cfg.lora.type,
    }


def save(sd: dict[str, torch.Tensor], path: Path, md: dict[str, str]) -> str:
    """Write one safetensors file (tensors on the CPU, contiguous); return its name."""
    save_file({k: v.detach().to("cpu").contiguous() for k, v in sd.items()}, str(path), metadata=md)
    return Path(path).name


def diffusers_lora_file(transformer: torch.nn.Module, out_dir: Path, md: dict[str, str]) -> str:
    """pytorch_lora_weights.safetensors: alpha / r folded into lora_B, lora_alpha = r in diffusers' metadata key
    (see the module docstring)."""
    from diffusers.loaders.lora_base import LORA_ADAPTER_METADATA_KEY
    from peft.utils import get_peft_model_state_dict

    conf = transformer.peft_config["default"].to_dict()
    scale = conf["lora_alpha"] / conf["r"]
    sd = {f"transformer.{k}": v * scale if k.endswith(".lora_B.weight") else v
          for k, v in get_peft_model_state_dict(transformer, adapter_name="default").items()}
    # Dropout is a training setting. diffusers builds the loaded adapter's dropout modules in training mode and
    # pipelines never call eval(), so a trained lora.dropout would randomly drop activations at inference.
    conf.update(lora_alpha=conf["r"], lora_dropout=0.0)
    conf = {f"transformer.{k}": sorted(v) if isinstance(v, set) else v for k, v in conf.items()}
    md = {**md, LORA_ADAPTER_METADATA_KEY: json.dumps(conf, indent=2, sort_keys=True), "lorad_alpha_folded": "true"}
    return save(sd, Path(out_dir) / DIFFUSERS_FILE, md)


def diffusion_model_comfyui_file(model: torch.nn.Module, cfg, out_dir: Path, md: dict[str, str], file_name: str,
                                 base_version: str) -> str:
    """A ComfyUI file that keeps diffusers' module paths (Qwen-Image, Z-Image; the key rules are in each family's
    docstring): diffusion_model.<path>.lora_A.weight / .lora_B.weight / .alpha, scale alpha / r. LoKr and LoHa
    (lora.type) are LyCORIS tensors under the same keys, which ComfyUI's LoKr and LoHa loaders read from every key
    its LoRA loader maps (diffusion_model.<path>.lokr_w1, ..., .alpha; the scale rules: flux_export.py)."""
    kohya = {"ss_network_dim": str(cfg.lora.rank), "ss_network_alpha": str(cfg.lora.alpha),
             "ss_base_model_version": base_version}
    if cfg.lora.type in ("lokr", "loha"):
        sd = lycoris_state_dict(model, lambda name: f"diffusion_model.{name}")
        kohya.update(ss_network_module="lycoris.kohya", ss_network_args=json.dumps({"algo": cfg.lora.type}))
        return save(sd, Path(out_dir) / file_name, {**md, **kohya})
    sd = {}
    for name, (a, b, _base) in lora_modules(model).items():
        sd[f"diffusion_model.{name}.lora_A.weight"] = a
        sd[f"diffusion_model.{name}.lora_B.weight"] = b
        sd[f"diffusion_model.{name}.alpha"] = torch.tensor(float(cfg.lora.alpha))
    return save(sd, Path(out_dir) / file_name, {**md, **kohya})


def output_files(model: torch.nn.Module, cfg, out_dir: Path, meta: dict[str, Any],
                 comfyui: Callable[[dict[str, str]], str]) -> list[str]:
    """The files output.formats names: the diffusers file (alpha / r folded) and the family's ComfyUI file."""
    md = metadata(cfg, meta)
    names = []
    if "diffusers" in cfg.output.formats:
        names.append(diffusers_lora_file(model, out_dir, md))
    if "comfyui" in cfg.output.formats:
        names.append(comfyui(md))
    return names


def folded_comfyui_file(model: torch.nn.Module, cfg, out_dir: Path, md: dict[str, str], file_name: str,
                        base_model: str, name: Callable[[str], str]) -> str:
    """diffusion_model.<name(module)>.lora_A / lora_B with alpha / r folded into B and no `.alpha` keys: the
    layout for models whose diffusers converter refuses `.alpha` keys (FLUX.3, Krea 2); ComfyUI's generic rule,
    with no alpha, applies scale 1, the trained strength. LoKr and LoHa (lora.type) are LyCORIS tensors under the
    same keys, with their `.alpha`: ComfyUI's LoKr and LoHa loaders read `<key>.lokr_w1`, ... from every key its
    LoRA loader maps, and diffusers reads neither type, so no converter sees them."""
    if cfg.lora.type in ("lokr", "loha"):
        sd = lycoris_state_dict(model, lambda module: f"diffusion_model.{name(module)}")
        return save(sd, Path(out_dir) / file_name, {**md, "ss_network_dim": str(cfg.lora.rank),
                                                    "ss_network_alpha": str(cfg.lora.alpha),
                                                    "ss_base_model_version": base_model,
                                                    "ss_network_module": "lycoris.kohya",
                                                    "ss_network_args": json.dumps({"algo": cfg.lora.type})})
    scale = cfg.lora.alpha / cfg.lora.rank
    sd = {}
    for module, (a, b, _base) in lora_modules(model).items():
        key = f"diffusion_model.{name(module)}"
        sd[f"{key}.lora_A.weight"], sd[f"{key}.lora_B.weight"] = a, b * scale
    return save(sd, Path(out_dir) / file_name, {**md, "ss_network_dim": str(cfg.lora.rank),
                                                "ss_network_alpha": str(cfg.lora.rank),
                                                "ss_base_model_version": base_model, "lorad_alpha_folded": "true"})


def bfl_target(module: str, block_rules: dict, top_rules: dict) -> tuple[str, tuple[str, ...] | None]:
    """(BFL module name, the diffusers sub-paths fused into it in row order, or None) for a diffusers module, by a
    family's rules (flux_export.py's for FLUX.1, flux2.py's for FLUX.2)."""
    m = _BLOCK.match(module)
    if m:
        kind, i, rest = m.groups()
        rule = block_rules[kind].get(rest)
        if rule is not None:
            name, parts = rule
            return name.format(i=i), parts
    elif module in top_rules:
        return top_rules[module], None
    raise ValueError(f"no ComfyUI/BFL name for module {module!r}")


def cpu_f32(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", torch.float32).contiguous()


def lora_modules(model: torch.nn.Module) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.nn.Module]]:
    """Diffusers module path -> (A [r, in], B [out, r], the base linear) for every LoRA layer, on the CPU."""
    out = {}
    for name, mod in model.named_modules():
        if hasattr(mod, "lora_A") and "default" in getattr(mod, "lora_A", {}):
            out[name] = (cpu_f32(mod.lora_A["default"].weight), cpu_f32(mod.lora_B["default"].weight), mod.get_base_layer())
    return out


def _factor(layer, name: str) -> torch.Tensor | None:
    params = getattr(layer, name)
    return cpu_f32(params["default"]) if "default" in params else None


def lycoris_state_dict(model: torch.nn.Module, key: Callable[[str], str]) -> dict[str, torch.Tensor]:
    """LoKr/LoHa layers as LyCORIS tensors under `key(diffusers module path)`, scaled for ComfyUI's LoKr and LoHa
    loaders (the rules: flux_export.py's docstring); `key` is the family's ComfyUI key of a module."""
    from engine.training.adapters import adapter_layers

    sd: dict[str, torch.Tensor] = {}
    for name, layer in adapter_layers(model).items():
        prefix = key(name)
        scale = float(layer.scaling["default"])
        if hasattr(layer, "hada_w1_a"):
            parts = {p: _factor(layer, p) for p in ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b")}
            dim = parts["hada_w1_b"].shape[0]
        else:
            parts = {p: t for p in ("lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b")
                     if (t := _factor(layer, p)) is not None}
            dim = next((parts[p].shape[0] for p in ("lokr_w2_b", "lokr_w1_b") if p in parts), None)
            if dim is None:  # neither factor is low-rank: ComfyUI ignores alpha, so the scale goes into w1
                parts["lokr_w1"] = parts["lokr_w1"] * scale
        sd.update({f"{prefix}.{p}": t for p, t in parts.items()})
        if dim is not None:
            sd[f"{prefix}.alpha"] = torch.tensor(scale * dim)
    return sd


def _out_features(model: torch.nn.Module, path: str) -> int:
    mod = model.get_submodule(path)
    return (mod.get_base_layer() if hasattr(mod, "get_base_layer") else mod).out_features


def comfyui_state_dict(model: torch.nn.Module, mods, rank: int, alpha: float, target: Callable,
                       swap_halves: set[str], key: Callable[[str], str] = lambda bfl: "lora_unet_" + bfl.replace(".", "_"),
                       suffixes: tuple[str, str] = ("lora_down.weight", "lora_up.weight")) -> dict[str, torch.Tensor]:
    """kohya/ComfyUI keys over BFL names; fused linears get stacked downs and block-diagonal ups (the layout:
    engine/families/image/flux_export.py's docstring).

    `target` maps a diffusers module to its BFL name and fused parts (the family's bfl_target),
    `swap_halves` names the BFL linears whose output halves are in the other order; `key` and `suffixes` the
    file's layout (kohya's by default; HunyuanVideo 1.5: diffusion_model.<name>.lora_A.weight / .lora_B.weight).
    """
    groups: dict[str, tuple[str, tuple[str, ...] | None]] = {}
    for name in mods:
        bfl, parts = target(name)
        prefix = name
        if parts is not None:
            prefix = name[: -len(next(p for p in parts if name.endswith("." + p)))]
        groups[bfl] = (prefix, parts)
    sd: dict[str, torch.Tensor] = {}
    for bfl, (prefix, parts) in sorted(groups.items()):
        name = key(bfl)
        if parts is None:
            a, b, _ = mods[prefix]
            up = b
            if bfl in swap_halves:
                half = b.shape[0] // 2
                up = torch.cat([b[half:], b[:half]])
            down, k = a, 1
        else:
            present = [p for p in parts if prefix + p in mods]
            k = len(present)
            down = torch.cat([mods[prefix + p][0] for p in present])
            # Row offsets come from every part of the fused linear, trained or not.
            sizes = [_out_features(model, prefix + p) for p in parts]
            up = torch.zeros(sum(sizes), k * rank)
            row, col = 0, 0
            for p, size in zip(parts, sizes, strict=True):
                if prefix + p in mods:
                    up[row : row + size, col : col + rank] = mods[prefix + p][1]
                    col += rank
                row += size
        sd[f"{name}.{suffixes[0]}"] = down.contiguous()
        sd[f"{name}.{suffixes[1]}"] = up.contiguous()
        sd[f"{name}.alpha"] = torch.tensor(float(alpha) * k)
    return sd
