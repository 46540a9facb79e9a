"""ostris/ai-toolkit: a YAML (or JSON) `job: extension` file whose `config.process[0]` holds the training.

Keys below are those of `config.process[0]` (plus the top-level `job`, `config.name` and `meta.*`).
"""

from __future__ import annotations

import re
from typing import Any

from engine.importers import common as c
from engine.importers import text_encoders as te
from engine.importers.table import (
    NO_FEATURE,
    CarriedIn,
    Context,
    Imported,
    Key,
    NotCarried,
    Problem,
    apply,
    carried_in,
    flatten,
    not_applicable,
    other_way,
)

NAME = "ai-toolkit"
# model.arch (the `arch` of each model class under extensions_built_in/diffusion_models/ and toolkit/; a
# `NAME:variant` suffix is dropped as ai-toolkit drops it) → family. flex1 is ai-toolkit's alias of flux; flex2,
# wan21_i2v and wan22_14b_i2v take an image input of their own that lorad's families do not. ltx2 is LTX-2
# (extensions_built_in/diffusion_models/ltx2/); its ltx2.3 and ltx2.5 variants are refused by name (common.py).
ARCH = {"flux": "flux", "flux_kontext": "flux", "flex1": "flux", "flux2": "flux2", "flux2_klein_4b": "flux2",
        "flux2_klein_9b": "flux2", "chroma": "chroma", "qwen_image": "qwen_image", "qwen_image_edit": "qwen_image",
        "qwen_image_edit_plus": "qwen_image", "zimage": "z_image", "wan22_5b": "wan", "wan22_14b": "wan",
        "wan21": "wan", "krea2": "krea2", "sdxl": "sdxl", "ideogram4": "ideogram4",
        "hidream": "hidream", "ltx2": "ltx2"}


def detect(doc: Any) -> bool:
    return isinstance(doc, dict) and doc.get("job") in ("extension", "train") and isinstance(
        (doc.get("config") or {}).get("process"), list)


def _family(v: Any, ctx: Context) -> str | None:
    arch = str(v).lower().split(":")[0]
    if arch in ARCH:
        return ARCH[arch]
    raise c.unsupported("model.arch", arch)


def _is_flux(v: Any, ctx: Context) -> str | None:
    if not v:
        return None
    return "flux"


QTYPES = {"qfloat8": "fp8", "float8": "fp8", "qint8": "int8", "uint8": "int8"}


def _assistant(v: Any, ctx: Context) -> str | None:
    s = str(v) if v else None  # ai-toolkit's training adapter: one .safetensors file, or a hub repository
    if s is None or (re.match(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$", s) and not (ctx.base_dir / s).exists()):
        return s
    return c.local_path(s, ctx)


def _quantize(v: Any, ctx: Context) -> str | None:
    """quantize: true quantizes the transformer to model.qtype (ai-toolkit's default qfloat8 → fp8, qint8 → int8);
    other qtypes (uint4 with an accuracy-recovery adapter, ...) have no lorad twin."""
    if not v:
        return None
    qtype = str(ctx.source.get("model.qtype", "qfloat8")).split("|")[0].lower()
    if qtype not in QTYPES:
        raise NotCarried(f"{NO_FEATURE} (qtype {qtype}; model.base_precision: fp8, int8, nf4)")
    return QTYPES[qtype]


def _experts(v: Any, ctx: Context) -> str | None:
    """wan22_14b's model_kwargs.train_high_noise / train_low_noise → model.expert (high, low or both)."""
    high = bool(ctx.source.get("model.model_kwargs.train_high_noise", True))
    low = bool(ctx.source.get("model.model_kwargs.train_low_noise", True))
    if high and low:
        return "both"
    if high or low:
        return "high" if high else "low"
    raise Problem("both experts are off: nothing would train")


def _do_audio(v: Any, ctx: Context) -> None:
    """Not carried over: lorad's ltx2 learns the sound of every clip that has an audio track (true's twin); false,
    the picture alone of such clips, it has not."""
    if v:
        raise NotCarried(other_way("data.path", "LTX-2 learns the sound of each clip that has an audio track"))
    raise NotCarried(f"{NO_FEATURE} (LTX-2 without the sound of clips that have it)")


def _audio_loss(v: Any, ctx: Context) -> None:
    """Not carried over: LTX-2's audio loss is added at weight 1 (1.0's twin); another weight lorad has not."""
    if c.number(v, ctx) == 1.0:
        raise NotCarried(other_way("the loss", "LTX-2's audio loss is added at weight 1, as here"))
    raise NotCarried(f"{NO_FEATURE} (an audio loss weight; LTX-2's is added at weight 1)")


def _network_type(v: Any, ctx: Context) -> str:
    t = str(v).lower()
    if t in ("lora", "locon"):
        return "lora"  # LoCon's extra is conv layers; the transformers lorad trains have none
    if t in ("lokr", "loha", "dora"):
        return t
    raise NotCarried(f"{NO_FEATURE} (network type {v}; lora.type: lora, dora, lokr, loha)")


def _ema_decay(v: Any, ctx: Context) -> float:
    if not ctx.source.get("train.ema_config.use_ema"):
        raise NotCarried(other_way("train.ema", "use_ema is off there"))
    return c.number(v, ctx)


def _use_ema(v: Any, ctx: Context) -> dict | None:
    return {} if v else None


def _dop(v: Any, ctx: Context) -> dict | None:
    return {} if v else None


def _dop_part(v: Any, ctx: Context) -> Any:
    if not ctx.source.get("train.diff_output_preservation"):
        raise NotCarried(other_way("train.dop", "diff_output_preservation is off there"))
    return v


def _prompt(p: str, trigger: str | None) -> str:
    # ai-toolkit's own markers: [trigger] is the trigger word; `--w 512 --seed 3` style flags end the prompt
    p = re.split(r"\s--\w", p, maxsplit=1)[0].strip()
    return p.replace("[trigger]", trigger or "").strip()


def _prompts(v: Any, ctx: Context) -> list:
    if not isinstance(v, list):
        raise Problem("must be a list of prompts")
    trig = ctx.source.get("trigger_word")
    neg = ctx.source.get("sample.neg") or ""
    out = []
    for p in v:
        text = _prompt(str(p.get("prompt", "")) if isinstance(p, dict) else str(p), trig)
        out.append({"prompt": text, "negative": neg} if neg else text)
    return out


def _neg(v: Any, ctx: Context) -> None:
    if v:
        raise CarriedIn("sample.prompts")
    return None


def _walk_seed(v: Any, ctx: Context) -> None:
    if v:
        raise CarriedIn("sample.seed")  # lorad's prompt i is drawn with sample.seed + i: the walk
    raise NotCarried(other_way("sample.prompts[].seed", "one seed for every prompt: give each prompt its seed"))


def _sample_every(v: Any, ctx: Context) -> int | None:
    if ctx.source.get("train.disable_sampling"):
        raise NotCarried(other_way("sample.every_steps", "disable_sampling is on there"))
    return c.positive_int(v, ctx)


def _push(v: Any, ctx: Context) -> str | None:
    if not ctx.source.get("save.push_to_hub"):
        raise NotCarried(other_way("output.push_to_hub", "push_to_hub is off there"))
    return str(v)


def _name(v: Any, ctx: Context) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", str(v)).strip("-._")[:64] or "imported"


OUTPUT = not_applicable("ai-toolkit's own output folder and logs; lorad writes to jobs/ID/")
CACHE = other_way("the cache", "lorad always caches latents and text embeddings, once, in its home")

TABLE: list[Key] = [
    Key("job", None, why=not_applicable("ai-toolkit's job kind")),
    Key("config.name", "name", _name),
    Key("type", None, why=not_applicable("ai-toolkit's process kind")),
    Key("training_folder", None, why=OUTPUT),
    Key("sqlite_db_path", None, why=OUTPUT),
    Key("performance_log_every", None, why=OUTPUT),
    Key("device", None, why=other_way("resources.gpus", "the daemon gives the job its GPU")),
    Key("model.arch", "model.family", _family, doc="flux, flux_kontext, flex1 → flux; flux2, flux2_klein_* → flux2; "
        "chroma; qwen_image*; zimage → z_image; wan21, wan22_5b, wan22_14b → wan; krea2; sdxl; ideogram4; hidream (I1; hidream_e1 "
        "is refused); ltx2; others refused"),
    Key("model.is_flux", "model.family", _is_flux, doc="true → flux"),
    Key("model.is_xl", "model.family", lambda v, ctx: "sdxl" if v else None, doc="true → sdxl"),
    Key("model.is_v_pred", "model.prediction", c.when_true("v"), doc="SDXL: true → v; false: unset (the base's "
        "scheduler decides)"),
    Key("model.name_or_path", "model.path", c.model_path, doc="hub id as is, a local path made absolute"),
    Key("model.quantize", "model.base_precision", _quantize, doc="true → fp8"),
    Key("model.qtype", None, carried_in("model.base_precision")),
    Key("model.qtype_te", None, why=CACHE),
    Key("_experts", "model.expert", _experts, doc="wan22_14b's experts (model_kwargs.train_high_noise, "
        "train_low_noise, both on by default)"),
    Key("model.model_kwargs.train_high_noise", None, carried_in("model.expert")),
    Key("model.model_kwargs.train_low_noise", None, carried_in("model.expert")),
    Key("model.quantize_te", None, why=CACHE),
    Key("model.low_vram", None, why=other_way("train.blocks_to_swap", "and the memory plan")),
    Key("model.assistant_lora_path", "model.assistant_lora", _assistant, doc="a LoRA file made absolute, a hub id "
        "as is"),
    Key("trigger_word", "data.trigger"),
    Key("network.type", "lora.type", _network_type, doc="lora, locon → lora; lokr, loha, dora"),
    Key("network.linear", "lora.rank", c.integer),
    Key("network.rank", "lora.rank", c.integer, doc="the older spelling of linear"),
    Key("network.linear_alpha", "lora.alpha", c.number),
    Key("network.alpha", "lora.alpha", c.number, doc="linear_alpha's default"),
    Key("network.dropout", "lora.dropout", c.number),
    Key("network.lokr_factor", "lora.factor", c.integer),
    Key("network.conv", None, why=f"{NO_FEATURE} (conv layers: lorad's transformers have none)"),
    Key("network.conv_alpha", None, why=f"{NO_FEATURE} (conv layers: lorad's transformers have none)"),
    Key("save.dtype", None, why=other_way("lora.dtype", "the adapter is kept and exported in it")),
    Key("save.save_every", "checkpoint.every_steps", c.positive_int),
    Key("save.max_step_saves_to_keep", "checkpoint.keep", c.positive_int),
    Key("save.hf_repo_id", "output.push_to_hub", _push),
    Key("save.push_to_hub", None, why=other_way("output.push_to_hub")),
    Key("save.hf_private", None, why=other_way("output.push_to_hub", "a new repository is made private")),
    Key("datasets[].folder_path", "data.path", c.local_path, doc="the first dataset; a folder of images"),
    Key("datasets[].caption_ext", "data.caption_ext", c.caption_ext),
    Key("datasets[].default_caption", "data.trigger", doc="lorad captions an image without a caption file with "
        "data.trigger alone"),
    Key("datasets[].caption_dropout_rate", "data.caption_dropout", c.number),
    Key("datasets[].resolution", "data.resolution", c.resolutions),
    Key("datasets[].num_repeats", "data.repeats", c.positive_int),
    Key("datasets[].flip_x", "data.flip"),
    Key("datasets[].mask_path", "data.masks.path", c.local_path),
    Key("datasets[].alpha_mask", "data.masks.alpha"),
    Key("datasets[].control_path", "data.control_path", c.local_path),
    Key("datasets[].shuffle_tokens", None, why=NO_FEATURE),
    Key("datasets[].cache_latents", None, why=CACHE),
    Key("datasets[].cache_latents_to_disk", None, why=CACHE),
    Key("datasets[].is_reg", None, why=other_way("data.regularisation")),
    Key("datasets[].num_frames", "data.frames", c.ltx2_frames, doc="LTX-2: [num_frames] (8k + 1; default 1, "
        "stills); other families not carried"),
    Key("datasets[].fps", "data.fps", c.ltx2_fps, doc="LTX-2 (default 24)"),
    Key("datasets[].shrink_video_to_frames", None, why=other_way("data.frames", "every clip is cut into windows "
        "of data.frames at data.fps, never squeezed into one")),
    Key("datasets[].do_audio", None, _do_audio),
    Key("train.audio_loss_multiplier", None, _audio_loss),
    Key("train.batch_size", "train.batch_size", c.integer),
    Key("train.gradient_accumulation_steps", "train.grad_accum", c.positive_int),
    Key("train.gradient_accumulation", "train.grad_accum", c.positive_int),
    Key("train.steps", "train.steps", c.integer),
    Key("train.lr", "train.lr", c.number),
    Key("train.optimizer", "train.optimizer", c.optimizer),
    Key("train.optimizer_params.weight_decay", "train.weight_decay", c.number),
    Key("train.optimizer_params.betas", "train.optimizer_args.betas"),
    Key("train.optimizer_params.eps", "train.optimizer_args.eps", c.number),
    Key("train.lr_scheduler", "train.schedule", c.schedule),
    Key("train.lr_warmup_steps", "train.warmup_steps", c.integer),
    Key("train.max_grad_norm", "train.max_grad_norm", c.number),
    Key("train.seed", "train.seed", c.integer),
    Key("train.dtype", "model.dtype", c.dtype),
    Key("train.gradient_checkpointing", "train.gradient_checkpointing"),
    Key("train.timestep_type", "train.timestep_sampling", c.timestep_sampling),
    Key("train.content_or_style", None, why=other_way("train.timestep_bias")),
    Key("train.switch_boundary_every", None, why=other_way("model.expert", "each sample goes to the expert "
        "owning its σ; no switching by steps")),
    Key("train.noise_scheduler", None, why=not_applicable("each family has its own noise scheduler")),
    Key("train.train_unet", None, why=not_applicable("lorad always trains the transformer's LoRA")),
    Key("train.train_text_encoder", "lora.text_encoder", te.switch, doc="SDXL: both CLIP encoders' LoRA"),
    Key("train.train_unet", None, te.unet_trains, doc="false: refused (lorad always trains the UNet)"),
    Key("train.unet_lr", None, why=not_applicable("its LoRA network trains at train.lr; this is its full "
        "fine-tune's")),
    Key("train.text_encoder_lr", None, why=not_applicable("its LoRA network trains the text encoders at train.lr; "
        "this is its full fine-tune's")),
    Key("train.skip_first_sample", None, why=other_way("sample.every_steps", "samples come every N steps")),
    Key("train.disable_sampling", None, why=other_way("sample.every_steps", "left unset: no samples")),
    Key("train.cache_text_embeddings", None, why=CACHE),
    Key("train.unload_text_encoder", None, why=CACHE),
    Key("train.ema_config.use_ema", "train.ema", _use_ema),
    Key("train.ema_config.ema_decay", "train.ema.decay", _ema_decay),
    Key("train.diff_output_preservation", "train.dop", _dop),
    Key("train.diff_output_preservation_class", "train.dop.preservation_class", _dop_part),
    Key("train.diff_output_preservation_multiplier", "train.dop.weight", _dop_part),
    Key("sample.sample_every", "sample.every_steps", _sample_every),
    Key("sample.prompts", "sample.prompts", _prompts, doc="[trigger] replaced by the trigger word; `--` flags "
        "after a prompt dropped"),
    Key("sample.neg", "sample.prompts", _neg, doc="each prompt's negative"),
    Key("sample.seed", "sample.seed", c.integer),
    Key("sample.walk_seed", "sample.seed", _walk_seed, doc="true: lorad's prompt i uses sample.seed + i"),
    Key("sample.width", "sample.width", c.integer),
    Key("sample.height", "sample.height", c.integer),
    Key("sample.guidance_scale", "sample.guidance", c.number),
    Key("sample.sample_steps", "sample.steps", c.integer),
    Key("sample.sampler", None, why=not_applicable("each family samples with its own scheduler")),
    Key("sample.sample_start_step", None, why=other_way("sample.every_steps")),
    Key("sample.num_frames", None, why=other_way("data.frames", "samples are as long as the clips trained")),
    Key("sample.fps", None, why=not_applicable("the sample video's frame rate")),
    Key("logging.log_every", None, why=OUTPUT),
    Key("logging.use_wandb", None, why=OUTPUT),
    Key("logging.verbose", None, why=OUTPUT),
    Key("meta.name", None, why=not_applicable("ai-toolkit's metadata")),
    Key("meta.version", None, why=not_applicable("ai-toolkit's metadata")),
]
# ai-toolkit's defaults (toolkit/config_modules.py: TrainConfig, NetworkConfig) where lorad's differ and the run
# would change: written out as if the file said them. The network's are written only where neither spelling is set.
DEFAULTS = {"train.lr_scheduler": "constant", "train.optimizer": "adamw", "train.lr": 1e-6, "train.dtype": "fp32",
            "train.gradient_checkpointing": True}
# DatasetConfig's num_frames (1: stills) and fps (24, LTX-2's rate); lorad's video defaults are 33 frames at 16.
LTX2_DATASET_DEFAULTS = {"datasets[0].num_frames": 1, "datasets[0].fps": 24}
NETWORK_DEFAULTS = (("network.linear", "network.rank", 4), ("network.linear_alpha", "network.alpha", 1.0))


def read(doc: dict[str, Any], ctx: Context, out: Imported) -> None:
    procs = doc["config"]["process"]
    proc = procs[0] if isinstance(procs[0], dict) else {}
    for i, extra in enumerate(procs[1:], 1):
        out.drop(f"config.process[{i}]", (extra or {}).get("type", "?"), f"{NO_FEATURE} (one training per job)")
    datasets = proc.get("datasets") or []
    first, rest = (datasets[:1], datasets[1:]) if isinstance(datasets, list) else ([], [])
    for i, d in enumerate(rest, 1):
        if isinstance(d, dict) and d.get("is_reg") and "regularisation" not in out.job.get("data", {}):
            out.set("data.regularisation.path", c.local_path(d.get("folder_path", ""), ctx),
                    f"datasets[{i}].folder_path = {d.get('folder_path')} (is_reg)")
            if d.get("num_repeats"):
                out.set("data.regularisation.repeats", int(d["num_repeats"]), f"datasets[{i}].num_repeats")
            for k, val in d.items():
                if k not in ("folder_path", "num_repeats", "is_reg"):
                    out.drop(f"datasets[{i}].{k}", val, f"{NO_FEATURE} (for a regularisation folder: lorad reads its "
                             "images with their own captions)")
        else:
            out.drop(f"datasets[{i}]", (d or {}).get("folder_path", "?") if isinstance(d, dict) else d,
                     other_way("data.path", "one image folder per job: put the folders under one, as sub-folders"))
    top = {k: v for k, v in doc.items() if k not in ("config",)}
    top["config"] = {k: v for k, v in doc["config"].items() if k != "process"}
    body = {k: v for k, v in proc.items() if k != "datasets"}
    if first:
        body["datasets"] = first
    flat = {**flatten(top), **flatten(body)}
    net = [(k, v) for k, alias, v in NETWORK_DEFAULTS if k not in flat and alias not in flat]
    for k, v in [*DEFAULTS.items(), *net]:
        if k not in flat:
            flat[k] = v
            out.notes.append(f"{k} not set there: ai-toolkit's default {v} written")
    if str(flat.get("model.arch", "")).lower().split(":")[0] == "wan22_14b":
        flat["_experts"] = True
    if str(flat.get("model.arch", "")).lower().split(":")[0] == "ltx2" and first:
        for k, v in LTX2_DATASET_DEFAULTS.items():
            if k not in flat:
                flat[k] = v
                out.notes.append(f"{k} not set there: ai-toolkit's default {v} written")
    ctx.source = flat
    apply(TABLE, flat, ctx, out)
