"""kohya-ss sd-scripts' and musubi-tuner's names and argument shapes: which training script (or network_module)
trains which family, a config TOML's sections, a saved command line's arguments."""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

from engine.importers.table import Problem

# The training script → family (None: a model lorad does not train), as the scripts are named in
# kohya-ss/sd-scripts (top level) and kohya-ss/musubi-tuner (src/musubi_tuner/*_train_network.py).
SCRIPTS = {"flux_train_network": "flux", "train_network": None, "sdxl_train_network": "sdxl", "sd3_train_network": None,
           "lumina_train_network": None, "anima_train_network": None, "hunyuan_image_train_network": None,
           "wan_train_network": "wan", "qwen_image_train_network": "qwen_image", "flux_kontext_train_network": "flux",
           "zimage_train_network": "z_image", "hv_1_5_train_network": "hunyuan_video", "hv_train_network": None,
           "flux_2_train_network": "flux2", "krea2_train_network": "krea2", "fpack_train_network": None,
           "kandinsky5_train_network": None, "hidream_o1_train_network": None, "ideogram4_train_network": "ideogram4",
           "ernie_image_train_network": None}
MUSUBI_SCRIPTS = ("wan_train_network", "qwen_image_train_network", "flux_kontext_train_network", "hv_train_network",
                  "zimage_train_network", "hv_1_5_train_network", "fpack_train_network", "flux_2_train_network",
                  "krea2_train_network", "kandinsky5_train_network", "hidream_o1_train_network",
                  "ideogram4_train_network", "ernie_image_train_network")
# network_module → family, for a config TOML that does not say its script (musubi-tuner's docs name these).
MODULES = {"networks.lora_flux": "flux", "networks.lora_wan": "wan", "networks.lora_qwen_image": "qwen_image",
           "networks.lora_zimage": "z_image", "networks.lora_flux_2": "flux2", "networks.lora_hv_1_5": "hunyuan_video",
           "networks.lora_krea2": "krea2", "networks.lora": None, "networks.lora_sd3": None,
           "networks.lora_lumina": None, "networks.lora_framepack": None, "networks.lora_kandinsky": None,
           "networks.lora_hidream_o1": None, "networks.lora_ideogram4": "ideogram4"}
TRAINING_KEYS = ("pretrained_model_name_or_path", "network_module", "network_dim", "dit", "max_train_steps",
                 "learning_rate", "output_dir", "dataset_config")


def is_config_toml(doc: Any) -> bool:
    flat = config_flat(doc) if isinstance(doc, dict) else {}
    return any(k in flat for k in TRAINING_KEYS)


def config_flat(doc: dict) -> dict[str, Any]:
    """sd-scripts reads a config TOML's sections as if their keys were at the top."""
    out: dict[str, Any] = {}
    for k, v in doc.items():
        if isinstance(v, dict):
            out.update(v)
        else:
            out[k] = v
    return out


def parse_command_line(text: str) -> tuple[str | None, dict[str, Any]]:
    """(the script's name, {argument: value}) of a saved `accelerate launch ... X_train_network.py --a 1 --b` line.

    Continuations (`\\`, `^`, a backtick) join lines; a flag without a value is true; several values are a list."""
    joined = re.sub(r"[\\^`]\s*\n", " ", text)
    try:
        tokens = shlex.split(joined, comments=True)
    except ValueError as e:
        raise Problem(f"the command line does not parse: {e}") from None
    script, args, key = None, {}, None
    for t in tokens:
        if script is None:
            if t.endswith(".py"):
                script = Path(t).stem
            continue
        if t.startswith("--"):
            name, eq, val = t[2:].partition("=")
            key = name.replace("-", "_")
            args[key] = val if eq else True
            continue
        if key is None:
            continue
        cur = args[key]
        args[key] = t if cur is True else ([*cur, t] if isinstance(cur, list) else [cur, t])
    return script, args


def _kv_list(v: Any) -> dict[str, str]:
    items = v if isinstance(v, list) else [v] if v not in (None, True) else []
    out = {}
    for it in items:
        k, eq, val = str(it).partition("=")
        if eq:
            out[k.strip()] = val.strip()
    return out
