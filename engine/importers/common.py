"""Conversions several tools share: model names to families, optimizers, schedules, timestep sampling, sizes,
and the dataset facts (images, captions, kohya's `N_name` repeat folders) an import needs."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

from engine.importers.table import (
    NO_FEATURE,
    CarriedIn,
    Context,
    NotCarried,
    Problem,
    not_applicable,
    other_way,
)
from engine.registry import families as registry

# What another trainer's config can be imported to: every image, edit and video family (the registry's; a family
# that joins is named here without an edit).
LORAD_FAMILIES = registry.names("image", "edit", "video")

# Substrings of a model name or path (lower case, '-', '_', '.' and ' ' removed) → family; first match wins, so the
# more specific come first. What lorad cannot train is named so that the refusal says which model it is.
_NAME_FAMILIES = (
    # LTX-2's later variants (2.3, 2.5) are not the LTX-2 lorad's ltx2 trains: None, refused by name below
    ("ltx2.3", None), ("ltx23", None), ("ltx2.5", None), ("ltx25", None), ("ltx2", "ltx2"),
    ("flux2", "flux2"), ("flux.2", "flux2"), ("flux3", "flux3"), ("krea2", "krea2"), ("ideogram4", "ideogram4"),
    ("ideogramv4", "ideogram4"), ("chroma", "chroma"),
    ("qwenimage2.1", "qwen_image_21"), ("qwenimage21", "qwen_image_21"),  # Qwen-Image 2.1 is not Qwen-Image
    ("qwenimage", "qwen_image"), ("zimage", "z_image"), ("wan2", "wan"), ("wanai", "wan"),
    ("hunyuanvideo15", "hunyuan_video"), ("hunyuanvideo1.5", "hunyuan_video"), ("flux1", "flux"), ("flux", "flux"),
    # SDXL and its fine-tunes' names (Illustrious, NoobAI, Pony), after every other family's
    ("stablediffusionxl", "sdxl"), ("sdxl", "sdxl"), ("illustriousxl", "sdxl"), ("noobaixl", "sdxl"),
    ("ponydiffusion", "sdxl"),
    ("hidreami1", "hidream"),  # HiDream-I1 only: HiDream-O1 and -E1 are other models (UNSUPPORTED)
)
_LTX2_LATER_NAMES = ("ltx2.3", "ltx23", "ltx2.5", "ltx25")
_LTX2_LATER = "LTX-{}; lorad's ltx2 trains LTX-2 itself, not its later variants"
UNSUPPORTED = {
    "sd3": "Stable Diffusion 3", "stablediffusion3": "Stable Diffusion 3",
    "sd15": "Stable Diffusion 1.5", "stablediffusionv15": "Stable Diffusion 1.5", "sd2": "Stable Diffusion 2",
    "ltx2.3": _LTX2_LATER.format("2.3"), "ltx23": _LTX2_LATER.format("2.3"), "ltx2.5": _LTX2_LATER.format("2.5"),
    "ltx25": _LTX2_LATER.format("2.5"),
    "ltxv": "LTX-Video, the older model before LTX-2",
    "pixart": "PixArt", "hidream": "HiDream-O1 or -E1", "lumina": "Lumina", "framepack": "FramePack",
    "cosmos": "Cosmos", "hunyuanvideo": "HunyuanVideo 1.0", "auraflow": "AuraFlow", "sana": "Sana",
    "omnigen": "OmniGen", "kandinsky": "Kandinsky", "wuerstchen": "Würstchen", "stablecascade": "Stable Cascade",
    "sd1": "Stable Diffusion 1.5",
}


def _squash(s: str) -> str:
    return re.sub(r"[-_ ]", "", s.lower())


def family_of_name(name: str) -> str | None:
    """The lorad family a model name, hub id or path names; None when it names none lorad knows."""
    if name.startswith("builtin:"):
        from engine.builtin.models import BUILTIN_MODELS

        m = BUILTIN_MODELS.get(name.removeprefix("builtin:"))
        return m.family if m is not None else None
    s = _squash(name)
    for needle, fam in _NAME_FAMILIES:  # a later variant's None ends the search
        if needle in s:
            return fam
    return None


def unsupported(what: str, name: str, known: str | None = None) -> Problem:
    """The refusal for a model lorad cannot train, naming it (known: the tool's own word for what it is) and what
    lorad trains."""
    s = _squash(name)
    known = known or next((v for k, v in UNSUPPORTED.items() if k in s), None)
    said = f"{name!r} ({known})" if known else repr(name)
    return Problem(f"unsupported model family: {said}; lorad trains {', '.join(LORAD_FAMILIES)}")


# ---------------------------------------------------------------- SDXL's prediction type (model.prediction)
def _sdxl_only(v: Any, ctx: Context) -> bool:
    """True for an SDXL job; for another family a prediction setting that is on does not apply, one off is nothing."""
    if ctx.job.get("model", {}).get("family") == "sdxl":
        return True
    if v and str(v).lower() not in ("false", "0", "none"):
        raise NotCarried(not_applicable("each family predicts what its model was trained to"))
    return False


def v_or_epsilon(v: Any, ctx: Context) -> str | None:
    """A v-prediction switch whose off is epsilon (kohya's --v_parameterization): true → v, false → epsilon."""
    return ("v" if v else "epsilon") if _sdxl_only(v, ctx) else None


def when_true(prediction: str) -> Any:
    """A switch that forces one prediction when on (OneTrainer's force_v_prediction, ai-toolkit's is_v_pred); off
    leaves model.prediction unset: the base's scheduler config decides, as there."""
    def conv(v: Any, ctx: Context) -> str | None:
        return prediction if _sdxl_only(v, ctx) and v else None
    return conv


def prediction_type(v: Any, ctx: Context) -> str | None:
    """A prediction type by name (SimpleTuner's --prediction_type): epsilon, v_prediction → v."""
    if not _sdxl_only(v, ctx) or v is None:
        return None
    got = {"epsilon": "epsilon", "v_prediction": "v", "v": "v"}.get(str(v).lower())
    if got is None:
        raise Problem(f"{v}: lorad's SDXL predicts epsilon or v (model.prediction)")
    return got


def zero_snr(v: Any, ctx: Context) -> None:
    """Zero terminal SNR: lorad's v-prediction rescales the betas to it always, its epsilon never."""
    if not v:
        return None
    if ctx.job.get("model", {}).get("prediction") == "v":
        raise CarriedIn("model.prediction")
    raise NotCarried(f"{NO_FEATURE} (zero terminal SNR without v-prediction; lorad rescales for model.prediction: v)")


OPTIMIZERS = {
    "adamw8bit": "adamw8bit", "adamw_8bit": "adamw8bit", "bnb_adamw8bit": "adamw8bit", "bnbadamw8bit": "adamw8bit",
    "pagedadamw8bit": "paged_adamw8bit", "paged_adamw8bit": "paged_adamw8bit",
    "adamw": "adamw", "torch_adamw": "adamw", "adamw_optimi": "adamw", "optimiadamw": "adamw", "optimi_adamw": "adamw",
    "adamw_bf16": "adamw", "adamwbf16": "adamw", "bnb_adamw": "adamw", "ao_adamw8bit": "adamw8bit",
    "bnb_adamw8bit_paged": "paged_adamw8bit", "bnb_adamw_paged": None,
    "prodigy": "prodigy", "prodigyopt": "prodigy", "prodigy_8bit": None,
    "adamwschedulefree": "adamw_schedulefree", "adamw_schedulefree": "adamw_schedulefree",
    "adamw_schedule_free": "adamw_schedulefree", "schedulefreeadamw": "adamw_schedulefree",
}


def optimizer(v: Any, ctx: Context) -> str:
    """A tool's optimizer name (any case, with `bitsandbytes.optim.` and the like) → train.optimizer."""
    name = str(v).rsplit(".", 1)[-1].lower().replace("-", "_")
    got = OPTIMIZERS.get(name) or OPTIMIZERS.get(name.replace("_", ""))
    if got is None:
        raise NotCarried(f"lorad has no such feature (optimizer {v}; lorad's train.optimizer: adamw8bit, "
                         "paged_adamw8bit, adamw, prodigy, adamw_schedulefree, scao; the default adamw8bit is used)")
    return got


SCHEDULES = {"constant": "constant", "constant_with_warmup": "constant", "linear": "linear", "cosine": "cosine",
             "cosine_with_min_lr": None, "cosine_with_restarts": None, "polynomial": None, "rex": None,
             "adafactor": None, "inverse_sqrt": None, "warmup_stable_decay": None, "piecewise_constant": None}


def schedule(v: Any, ctx: Context) -> str:
    name = str(v).lower().replace("-", "_")
    got = SCHEDULES.get(name)
    if got is None:
        raise NotCarried(f"lorad has no such feature (schedule {v}; lorad's train.schedule: constant, linear, "
                         "cosine; the default cosine is used)")
    return got


TIMESTEPS = {"sigmoid": "sigmoid", "logit_normal": "sigmoid", "lognorm": "sigmoid", "linear": "linear",
             "uniform": "linear", "sigma": "linear", "shift": "shift", "flux_shift": "shift"}


def timestep_sampling(v: Any, ctx: Context) -> str:
    got = TIMESTEPS.get(str(v).lower())
    if got is None:
        raise NotCarried(f"lorad has no such feature (timestep sampling {v}; lorad's train.timestep_sampling: "
                         "sigmoid, linear, shift)")
    return got


def number(v: Any, ctx: Context) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        raise Problem(f"{v!r} is not a number") from None


def integer(v: Any, ctx: Context) -> int:
    try:
        f = float(v)
    except (TypeError, ValueError):
        raise Problem(f"{v!r} is not a whole number") from None
    if f != int(f):
        raise Problem(f"{v!r} is not a whole number")
    return int(f)


def positive_int(v: Any, ctx: Context) -> int | None:
    """A count where 0 or less means "off" in the other tool: nothing to write (lorad's own default stays)."""
    n = integer(v, ctx)
    if n <= 0:
        raise NotCarried(other_way("its default", "0 means off there"))
    return n


def dtype(v: Any, ctx: Context) -> str:
    s = str(v).lower()
    for names, out in ((("bf16", "bfloat16"), "bfloat16"), (("fp16", "float16", "half"), "float16"),
                       (("fp32", "float32", "float", "no"), "float32")):
        if s in names:
            return out
    raise NotCarried(f"lorad has no such feature (dtype {v}; model.dtype: float32, bfloat16, float16)")


def side(w: int, h: int) -> int:
    """A w×h training size as lorad's data.resolution: the side of the square of the same area (buckets keep the
    area, engine/config/buckets.py)."""
    return int(round(math.sqrt(w * h)))


def resolutions(v: Any, ctx: Context) -> list[int]:
    """512, "512", "512,768", [512, 768] (several sizes, as ai-toolkit and diffusion-pipe list them), [[w, h]]."""
    if isinstance(v, str):
        parts = [p for p in re.split(r"[,x ]+", v.strip()) if p]
        nums = [integer(p, ctx) for p in parts]
        return [side(nums[0], nums[1])] if len(nums) == 2 else [nums[0]]
    if isinstance(v, (int, float)):
        return [integer(v, ctx)]
    if isinstance(v, list) and v:
        out = []
        for x in v:
            if isinstance(x, list) and len(x) == 2:
                out.append(side(integer(x[0], ctx), integer(x[1], ctx)))
            else:
                out.append(integer(x, ctx))
        return list(dict.fromkeys(out))
    raise Problem(f"{v!r} is not a resolution")


def caption_ext(v: Any, ctx: Context) -> str:
    return str(v).lstrip(".")


def local_path(v: Any, ctx: Context) -> str:
    """A path of the source, made absolute against the source file's folder (the job then reads from anywhere)."""
    p = Path(str(v)).expanduser()
    return str(p if p.is_absolute() else (ctx.base_dir / p).resolve())


# The official single-file checkpoints other trainers load, and the hub repository of the same weights in the
# diffusers layout lorad loads.
SINGLE_FILES = (("flux1-dev", "black-forest-labs/FLUX.1-dev"), ("flux1-schnell", "black-forest-labs/FLUX.1-schnell"),
                ("qwen_image_edit", "Qwen/Qwen-Image-Edit"), ("qwen_image", "Qwen/Qwen-Image"),
                ("wan2.2_ti2v_5b", "Wan-AI/Wan2.2-TI2V-5B-Diffusers"), ("chroma", "lodestones/Chroma"),
                # the ComfyUI files musubi-tuner's and diffusion-pipe's docs train from
                ("wan2.2_t2v_low_noise_14b", "Wan-AI/Wan2.2-T2V-A14B-Diffusers"),
                ("wan2.2_t2v_high_noise_14b", "Wan-AI/Wan2.2-T2V-A14B-Diffusers"),
                ("z_image_turbo", "Tongyi-MAI/Z-Image-Turbo"), ("krea2_raw", "krea/Krea-2-Raw"),
                # LTX-2's own files (-fp8, -fp4 too; SimpleTuner's ltxvideo2 flavours load them from that repository)
                ("ltx-2-19b-dev", "Lightricks/LTX-2"))


def model_path(v: Any, ctx: Context) -> str:
    """A hub id or builtin name as is, a local path made absolute; a single-file checkpoint is refused with the
    validator's own line, except the official FLUX.1 files, whose hub repository lorad reads instead."""
    # (and except an SDXL job's own: the SDXL trainer converts it; the docs tables keep the line above)
    s = str(v)
    if ctx.job.get("model", {}).get("family") == "ltx2" and any(k in _squash(s) for k in _LTX2_LATER_NAMES):
        raise unsupported("model path", s)  # LTX-2.3 or 2.5 weights under a tool's LTX-2 name
    if s.startswith("builtin:") or (re.match(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$", s) and not Path(s).exists()):
        return s
    p = Path(local_path(s, ctx))
    if p.suffix in (".safetensors", ".ckpt", ".pt", ".sft", ".gguf"):
        stem = p.stem.lower()
        for known, repo in SINGLE_FILES:
            if stem.startswith(known):
                ctx.notes.append(f"model: {p.name} is a single-file checkpoint; lorad reads the same model's "
                                 f"diffusers layout, {repo}")
                return repo
        from engine.config.paths import single_file_problem, single_file_refusal

        family = ctx.job.get("model", {}).get("family")
        if p.suffix == ".safetensors" and (why := single_file_problem(str(p), family)) != "refused":
            if why is not None:
                raise Problem(why)  # the validator's own line: not a checkpoint this family reads
            return str(p)  # a family whose trainer converts it (SDXL)
        raise Problem(single_file_refusal(str(p)))  # lorad's validator's own line (exit 65), word for word
    return str(p)


# ---------------------------------------------------------------- LTX-2's windows (data.frames, data.fps)
def _ltx2_only(what: str, ctx: Context) -> None:
    """Frames and frame rate are carried for LTX-2 (the family whose import asked for them); another video family
    keeps them as before: not carried, lorad's own keys named."""
    if ctx.job.get("model", {}).get("family") != "ltx2":
        raise NotCarried(other_way(what))


def ltx2_frames(v: Any, ctx: Context) -> list[int]:
    """A clip length in frames → data.frames [n]: LTX-2's VAE encodes 8k + 1 frames, so another count is cut to the
    8k + 1 below it (as SimpleTuner trims clips and ai-toolkit its samples), with a note."""
    _ltx2_only("data.frames", ctx)
    n = integer(v, ctx)
    if n < 1:
        raise Problem(f"{v}: a clip of at least one frame")
    k = (n - 1) // 8 * 8 + 1
    if k != n:
        ctx.notes.append(f"data.frames: {n} is not 8k + 1, the windows LTX-2's VAE encodes; {k} written")
    return [k]


def ltx2_fps(v: Any, ctx: Context) -> float:
    _ltx2_only("data.fps", ctx)
    return number(v, ctx)


# ---------------------------------------------------------------- datasets
REPEAT_DIR = re.compile(r"^(\d+)_(.+)$")


def images_in(folder: Path) -> list[Path]:
    """The images under folder as lorad reads them (engine/config/sources.py: sub-folders too); [] if absent."""
    from engine.config.sources import list_images

    try:
        return list_images(folder) if folder.is_dir() else []
    except OSError:
        return []


def repeat_folders(folder: Path) -> list[tuple[int, str, Path]]:
    """kohya's `N_name` sub-folders of a train_data_dir: (repeats N, name, path)."""
    try:
        subs = sorted(p for p in folder.iterdir() if p.is_dir())
    except OSError:
        return []
    return [(int(m.group(1)), m.group(2), p) for p in subs if (m := REPEAT_DIR.match(p.name))]


def captions_missing(images: list[Path], ext: str) -> int:
    return sum(1 for p in images if not p.with_suffix("." + ext.lstrip(".")).is_file())


def steps_from_epochs(epochs: int, ctx: Context, what: str) -> int:
    """Optimizer steps for `epochs` passes over the dataset (images × repeats × resolutions, by the global batch),
    as lorad would count them; a Problem when the dataset cannot be counted."""
    if not ctx.images:
        raise Problem(f"{epochs} epochs cannot be turned into train.steps without counting the dataset's images "
                      f"(not found); set {what} in steps, or give the dataset")
    repeats = int(ctx.job.get("data", {}).get("repeats", 1))
    sizes = len(ctx.job.get("data", {}).get("resolution", [512]))
    batch = int(ctx.job.get("train", {}).get("batch_size", 1)) * int(ctx.job.get("train", {}).get("grad_accum", 1))
    return max(1, epochs * math.ceil(ctx.images * repeats * sizes / batch))
