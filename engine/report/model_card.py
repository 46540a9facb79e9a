"""What an exported adapter is, said in output/README.md (for people and the Hub) and lorad-output.json (for scripts).

peft's `save_pretrained` leaves a template README ("[More Information Needed]"), and nothing in output/ said
whether the weights are the EMA, the schedule-free average or the last step's. The card is written from the job
file and the run's facts only, so it is the same for the same job: base model, family, trigger, LoRA settings,
steps, dataset size, which weights, a few of the last samples, and how to load each file that was written.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engine.registry.families import families, names

# Derived from the family packages' declarations (engine/registry/families.py).
FAMILY_NAMES = {name: facts.display for name, facts in families().items()}
VIDEO = names("video")
# Wan 2.2 A14B's per-expert files (engine/families/video/wan/family.py): diffusers file -> (expert model, pipeline argument)
EXPERT_FILES = {"wan22_high_noise_lora.safetensors": ("high-noise", ""),
                "wan22_low_noise_lora.safetensors": ("low-noise", ", load_into_transformer_2=True")}
DIFFUSERS_FILE = "pytorch_lora_weights.safetensors"  # engine/families/image/export.py writes it
PEFT_FILE = "adapter_model.safetensors"
MAX_SAMPLES = 4


def which_weights(cfg) -> tuple[str, str]:
    """(key, sentence): which adapter weights the output holds."""
    if cfg.train.ema is not None:
        raw = " The raw last-step weights are in raw/." if cfg.train.ema.export_raw else ""
        return "ema", f"the exponential moving average of the adapter (decay {cfg.train.ema.decay}).{raw}"
    if cfg.train.optimizer == "adamw_schedulefree":
        return "schedule_free_average", "schedule-free AdamW's averaged weights (the point it evaluates, not the " \
                                        "one it trained on)."
    return "trained", "the adapter as trained, at the last step."


def facts(cfg, meta: dict[str, Any], files: list[str], samples: list[str], dataset_size: int | None) -> dict[str, Any]:
    """What lorad-output.json records beside the step and identity the resume logic reads."""
    weights, _ = which_weights(cfg)
    return {
        "family": cfg.model.family,
        "base_model": cfg.model.path,
        "revision": cfg.model.revision,
        "trigger": getattr(cfg.data, "trigger", None),
        "lora": {"type": cfg.lora.type, "rank": cfg.lora.rank, "alpha": cfg.lora.alpha,
                 "targets": cfg.lora.targets if cfg.lora.targets is not None else f"{cfg.model.family} defaults"},
        "steps": meta["steps"],
        "dataset": {"path": str(cfg.data.path), "size": dataset_size},
        "weights": weights,
        "files": sorted(set(files) - {"README.md"}),  # the adapter's files (peft's export lists its template)
        "samples": samples,
        "lorad_version": str(meta.get("lorad_version", "")),
    }


def model_card(cfg, f: dict[str, Any]) -> str:
    """output/README.md: Hub front matter, the facts as a table, samples, and how to load every file written."""
    family = FAMILY_NAMES.get(f["family"], f["family"])
    image = f["family"] != "causal_lm"
    lines = ["---", f"base_model: {f['base_model']}", f"library_name: {'diffusers' if image else 'peft'}",
             "tags:", "- lora", "- lorad", f"- {f['family']}",
             f"- {'text-to-video' if f['family'] in VIDEO else 'text-to-image' if image else 'text-generation'}"]
    if f["trigger"]:
        lines.append(f"instance_prompt: {f['trigger']}")
    revision = f" (revision {f['revision']})" if f["revision"] else ""
    trigger = f"`{f['trigger']}`" if f["trigger"] else "none"
    lines += ["---", "", f"# {cfg.name}: a {family} LoRA", "",
              f"Trained with lorad {f['lorad_version']} on `{f['base_model']}`.", "", "| | |", "|---|---|",
              f"| base model | `{f['base_model']}`{revision} |",
              f"| family | {family} (`{f['family']}`) |",
              f"| trigger word | {trigger} |",
              f"| adapter | {f['lora']['type']}, rank {f['lora']['rank']}, alpha {f['lora']['alpha']}{_scale(f['lora'])} |",
              f"| targets | {_targets(f['lora']['targets'])} |",
              f"| steps | {f['steps']} |",
              f"| dataset | {_dataset(f['dataset'], image, f['family'] in VIDEO)} |",
              f"| weights | {which_weights(cfg)[1]} |", ""]
    if f["samples"]:
        lines += ["## Samples", "", f"From the last samples rendered during training ({cfg.name}, the job's "
                  "`sample.prompts`):", ""]
        mute = "" if f["family"] == "ltx2" else " muted"  # LTX-2's sample clips carry their sound
        lines += [f'<video src="{s}" controls loop{mute}></video>' if s.endswith(".mp4") else f"![sample {i}]({s})"
                  for i, s in enumerate(f["samples"])] + [""]
    lines += ["## Use it", ""] + _loading(f) + ["Written by lorad from the job file; `lorad-output.json` holds the same "
                                                 "facts for scripts.", ""]
    return "\n".join(lines)


def _scale(lora: dict[str, Any]) -> str:
    # alpha / rank is the scale of lora and dora; lokr and loha scale by their own factorisation
    return f" (scale alpha / rank = {lora['alpha'] / lora['rank']:g})" if lora["type"] in ("lora", "dora") else ""


def newest_samples(workdir: Path, step: int) -> list[Path]:
    """Up to MAX_SAMPLES images of the newest samples/step-N/ at or before `step` (engine/families/image/sample.py)."""
    dirs = []
    for d in (workdir / "samples").glob("step-*"):
        try:
            n = int(d.name.removeprefix("step-"))
        except ValueError:
            continue
        if n <= step and d.is_dir() and not d.is_symlink():
            dirs.append((n, d))
    if not dirs:
        return []
    found = [p for p in max(dirs)[1].iterdir() if p.suffix in (".png", ".mp4")]  # images; the video families' clips
    return sorted(p for p in found if p.is_file() and not p.is_symlink())[:MAX_SAMPLES]


def _targets(targets) -> str:
    return targets if isinstance(targets, str) else ", ".join(f"`{t}`" for t in targets)


def _dataset(d: dict[str, Any], image: bool, video: bool = False) -> str:
    unit = "clip windows and stills" if video else "images" if image else "examples"
    size = f"{d['size']} {unit}" if d["size"] is not None else "size not recorded"
    return f"{size} from `{Path(d['path']).name}`"


def _loading(f: dict[str, Any]) -> list[str]:
    out = []
    files = set(f["files"])
    for name, (model, arg) in EXPERT_FILES.items():
        if name in files:
            out += [f"**diffusers**, the {model} expert's LoRA (the scale is in the file):", "", "```python",
                    f'pipe.load_lora_weights("path/to/this/folder", weight_name="{name}"{arg})', "```", ""]
    if DIFFUSERS_FILE in files and f["family"] == "hunyuan_video":  # its pipeline has no load_lora_weights
        out += ["**diffusers** (the scale is in the file):", "", "```python",
                f'pipe.transformer.load_lora_adapter("path/to/this/folder/{DIFFUSERS_FILE}", prefix="transformer")',
                "```", ""]
    elif DIFFUSERS_FILE in files:
        load = [f'pipe = DiffusionPipeline.from_pretrained("{f["base_model"]}", torch_dtype=torch.bfloat16)']
        if f["family"] == "flux3":  # diffusers has FLUX.3's pipelines as modular pipelines only
            load = [f'pipe = ModularPipeline.from_pretrained("{f["base_model"]}")',
                    "pipe.load_components(dtype=torch.bfloat16)"]
        out += ["**diffusers** (the scale is in the file; load it at strength 1):", "", "```python", "import torch",
                f"from diffusers import {'ModularPipeline' if f['family'] == 'flux3' else 'DiffusionPipeline'}", "",
                *load, f'pipe.load_lora_weights("path/to/this/folder", weight_name="{DIFFUSERS_FILE}")', "```", ""]
    for name in sorted(n for n in files if n.endswith("_comfyui.safetensors")):
        expert = next((m for k, (m, _a) in EXPERT_FILES.items() if name.startswith(k.removesuffix(".safetensors"))),
                      None)
        on = f"the {expert} model" if expert else "the base model"
        out += [f"**ComfyUI**: copy `{name}` into `ComfyUI/models/loras/` and load it with *LoraLoaderModelOnly* "
                f"on {on} (strength 1 is the trained strength)."
                + ("" if families()[f["family"]].comfyui_checked
                   else f" ComfyUI's {FAMILY_NAMES[f['family']]} key rules were not available to check."), ""]
    if PEFT_FILE in files:
        loader = "AutoModelForCausalLM" if f["family"] == "causal_lm" else "the base model's transformer class"
        out += [f"**peft** (`{PEFT_FILE}` with `adapter_config.json`):", "", "```python",
                "from peft import PeftModel", "from transformers import AutoModelForCausalLM", "",
                f'base = AutoModelForCausalLM.from_pretrained("{f["base_model"]}")' if f["family"] == "causal_lm"
                else f"base = ...  # {loader}, loaded from {f['base_model']}",
                'model = PeftModel.from_pretrained(base, "path/to/this/folder")', "```", ""]
    return out
