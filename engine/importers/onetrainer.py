"""Nerogar/OneTrainer: a preset or saved config JSON (only the keys that differ from its defaults are needed), with
the concepts (`concept_file_name`, or `concepts` inline) and samples (`sample_definition_file_name`, `samples`) it
names. Keys are the JSON's (`optimizer.*` nested); a concept's are `concepts[].*`, a sample's `samples[].*`.
"""

from __future__ import annotations

import json
from pathlib import Path
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

NAME = "onetrainer"
# modules/util/enum/ModelType.py's names → family. FLUX_FILL_DEV_1 and STABLE_DIFFUSION_XL_10_BASE_INPAINTING (an
# inpainting input of their own) are not one.
MODEL_TYPES = {"FLUX_DEV_1": "flux", "FLUX_2": "flux2", "CHROMA_1": "chroma", "QWEN": "qwen_image",
               "Z_IMAGE": "z_image", "KREA_2": "krea2", "STABLE_DIFFUSION_XL_10_BASE": "sdxl",
               "IDEOGRAM_4": "ideogram4", "HI_DREAM_FULL": "hidream"}
# a model part's weight_dtype (modules/util/enum/DataType.py) → model.base_precision; the others: lorad's auto.
WEIGHT_DTYPES = {"FLOAT_8": "fp8", "FLOAT_W8A8": "fp8", "INT_8": "int8", "INT_W8A8": "int8", "NFLOAT_4": "nf4"}


DTYPES = {"BFLOAT_16": "bf16", "FLOAT_16": "fp16", "FLOAT_32": "fp32"}


def detect(doc: Any) -> bool:
    return isinstance(doc, dict) and "model_type" in doc and ("training_method" in doc or "__version" in doc
                                                              or "concept_file_name" in doc)


def _model_type(v: Any, ctx: Context) -> str:
    fam = MODEL_TYPES.get(str(v).upper())
    if fam is None:
        raise c.unsupported("model_type", str(v))
    return fam


def _method(v: Any, ctx: Context) -> None:
    if str(v).upper() != "LORA":
        raise Problem(f"{v}: lorad trains LoRA adapters only (training_method LORA)")
    raise CarriedIn("lora.type")


def _peft(v: Any, ctx: Context) -> str:
    t = str(v).upper()
    if t in ("LORA", "LOHA", "LOKR"):
        return t.lower()
    raise NotCarried(f"{NO_FEATURE} (peft_type {v}; lora.type: lora, dora, lokr, loha)")


def _dora(v: Any, ctx: Context) -> str | None:
    return "dora" if v else None


def _on_off(v: Any, ctx: Context) -> bool:
    return str(v).upper() not in ("OFF", "FALSE", "0", "NONE")


def _ema(v: Any, ctx: Context) -> dict | None:
    return {} if str(v).upper() != "OFF" else None


def _ema_part(v: Any, ctx: Context) -> Any:
    if str(ctx.source.get("ema", "OFF")).upper() == "OFF":
        raise NotCarried(other_way("train.ema", "ema is OFF there"))
    return c.number(v, ctx) if isinstance(v, (int, float, str)) else v


def _unit(key: str, unit_key: str, what: str):
    """save_every / sample_after with their _unit: STEP as is, EPOCH through the dataset's size, NEVER: off."""
    def conv(v: Any, ctx: Context) -> int | None:
        unit = str(ctx.source.get(unit_key, "NEVER")).upper()
        n = c.integer(v, ctx)
        if unit == "NEVER" or n <= 0:
            raise NotCarried(other_way(what, f"{unit_key} is NEVER there"))
        if unit == "STEP":
            return n
        if unit == "EPOCH":
            return n * c.steps_from_epochs(1, ctx, key)
        raise NotCarried(f"{NO_FEATURE} (a cadence in {unit}; give {what} in steps)")
    return conv


def _warmup(v: Any, ctx: Context) -> int | None:
    w = c.number(v, ctx)
    accum = c.integer(ctx.source.get("gradient_accumulation_steps", 1), ctx)
    total = c.steps_from_epochs(c.integer(ctx.source.get("epochs", 100), ctx), ctx, "epochs") if ctx.images else None
    n = int(w / accum) if w > 1 else int(w * total) if 0 < w <= 1 and total else 0
    return min(n, total) if total else n


def _timesteps(v: Any, ctx: Context) -> str:
    return c.timestep_sampling({"UNIFORM": "uniform", "LOGIT_NORMAL": "logit_normal", "SIGMOID": "sigmoid"}
                               .get(str(v).upper(), v), ctx)


def _concept_path(v: Any, ctx: Context) -> str:
    return c.local_path(v, ctx)


def _concept_trigger(v: Any, ctx: Context) -> str | None:
    if not v:
        return None  # no prompt file: nothing to carry
    # a concept's prompt_source "concept": its one prompt file for every image, not a trigger word
    raise NotCarried(other_way("data.trigger", "a caption for all images is data.trigger with no caption files"))


def _prompt_source(v: Any, ctx: Context) -> str | None:
    if str(v) == "sample":
        raise CarriedIn("data.caption_ext")  # IMAGE.txt beside each image: lorad's own layout
    raise NotCarried(other_way("data.caption_ext", f"captions from {v}; lorad reads IMAGE.{{caption_ext}}"))


def _repeats(v: Any, ctx: Context) -> int | None:
    if str(ctx.source.get("concepts[0].balancing_strategy", "REPEATS")).upper() != "REPEATS":
        raise NotCarried(f"{NO_FEATURE} (balancing by samples)")
    n = c.number(v, ctx)
    if n != int(n) or n < 1:
        raise NotCarried(f"{NO_FEATURE} (fractional repeats {v}; data.repeats is a whole number)")
    return int(n)


def _weight_dtype(v: Any, ctx: Context) -> str | None:
    t = str(v).upper()
    if t in WEIGHT_DTYPES:
        return WEIGHT_DTYPES[t]
    if t in ("FLOAT_32", "FLOAT_16", "BFLOAT_16", "TFLOAT_32", "NONE"):
        return None  # not quantized: lorad's auto
    raise NotCarried(f"{NO_FEATURE} (weight_dtype {v}; model.base_precision: fp8, int8, nf4)")


def _transformer_train(v: Any, ctx: Context) -> None:
    if not v:
        raise Problem("false: the transformer does not train, and lorad trains the transformer's LoRA")
    raise CarriedIn("lora.type")


PARTS = ("text_encoder", "text_encoder_2", "text_encoder_3", "text_encoder_4", "vae", "unet", "prior")


def _dynamic_shift(v: Any, ctx: Context) -> str | None:
    if not v:
        return None
    if str(ctx.source.get("timestep_distribution", "UNIFORM")).upper() == "UNIFORM":
        return "shift"  # U(0,1) moved by the resolution-dependent shift: lorad's shift
    raise NotCarried(f"{NO_FEATURE} (a resolution-dependent shift on {ctx.source.get('timestep_distribution')})")


def _concept_type(v: Any, ctx: Context) -> None:
    if str(v).upper() != "STANDARD":
        raise NotCarried(f"{NO_FEATURE} (concept type {v})")
    return None


SAMPLE_KEYS = {"height": "sample.height", "width": "sample.width", "diffusion_steps": "sample.steps",
               "cfg_scale": "sample.guidance"}


def _samples(v: Any, ctx: Context) -> list:
    out = []
    # FLUX.1's guidance is distilled: it samples without a negative prompt (lorad refuses one there)
    negatives = ctx.job.get("model", {}).get("family") != "flux"
    for i, s in enumerate(v if isinstance(v, list) else []):
        if not isinstance(s, dict) or not s.get("enabled", True) or not s.get("prompt"):
            ctx.dropped.append((f"samples[{i}]", s.get("prompt") if isinstance(s, dict) else s,
                                not_applicable("a sample that is disabled there, or has no prompt")))
            continue
        for k, val in s.items():  # SampleConfig's other settings: lorad's are one for every prompt (sample.*)
            if k not in ("enabled", "prompt", "negative_prompt", "seed", "random_seed"):
                ctx.dropped.append((f"samples[{i}].{k}", val, other_way(SAMPLE_KEYS.get(k, "sample"),
                                                                       "one value for every prompt")))
        e: dict[str, Any] = {"prompt": str(s["prompt"])}
        if s.get("negative_prompt") and negatives:
            e["negative"] = str(s["negative_prompt"])
        elif s.get("negative_prompt"):
            ctx.dropped.append((f"samples[{i}].negative_prompt", s["negative_prompt"],
                                "does not apply (FLUX.1 samples with distilled guidance, without a negative prompt)"))
        if "seed" in s and not s.get("random_seed"):
            e["seed"] = int(s["seed"])
        out.append(e if len(e) > 1 else e["prompt"])
    return out[:64]


OUTPUT = not_applicable("OneTrainer's own output, workspace and logs; lorad writes to jobs/ID/")
CACHE = other_way("the cache", "lorad always caches latents and text embeddings, once, in its home")

TABLE: list[Key] = [
    Key("model_type", "model.family", _model_type, doc=", ".join(f"{k} → {v}" for k, v in MODEL_TYPES.items())
        + "; others refused"),
    Key("force_v_prediction", "model.prediction", c.when_true("v"), doc="SDXL: true → v"),
    Key("force_epsilon_prediction", "model.prediction", c.when_true("epsilon"), doc="SDXL: true → epsilon"),
    Key("rescale_noise_scheduler_to_zero_terminal_snr", None, c.zero_snr, doc="carried in model.prediction: v"),
    Key("training_method", None, _method, doc="LORA only"),
    Key("base_model_name", "model.path", c.model_path),
    Key("peft_type", "lora.type", _peft),
    Key("lora_decompose", "lora.type", _dora, doc="true → dora"),
    Key("lora_rank", "lora.rank", c.integer),
    Key("lora_alpha", "lora.alpha", c.number),
    Key("dropout_probability", "lora.dropout", c.number),
    Key("concepts[].path", "data.path", _concept_path, doc="the first enabled concept"),
    Key("concepts[].balancing", "data.repeats", _repeats, doc="REPEATS balancing, whole numbers"),
    Key("concepts[].text.prompt_source", None, _prompt_source, doc="sample (IMAGE.txt) as lorad"),
    Key("concepts[].text.prompt_path", None, _concept_trigger),
    Key("concepts[].balancing_strategy", None, why=other_way("data.repeats")),
    Key("concepts[].type", None, _concept_type),
    Key("concepts[].name", None, why=not_applicable("a concept's display name")),
    Key("concepts[].enabled", None, why=not_applicable("only enabled concepts are read")),
    Key("concepts[].include_subdirectories", None, why=other_way("data.path", "sub-folders are always read")),
    Key("concepts[].image.enable_random_flip", "data.flip", _on_off),
    Key("concepts[].text.enable_tag_shuffling", None, why=NO_FEATURE),
    Key("concepts[].text.tag_dropout_enable", None, why=NO_FEATURE),
    Key("resolution", "data.resolution", c.resolutions),
    Key("batch_size", "train.batch_size", c.integer),
    Key("gradient_accumulation_steps", "train.grad_accum", c.positive_int),
    Key("learning_rate", "train.lr", c.number),
    Key("optimizer.optimizer", "train.optimizer", c.optimizer),
    Key("optimizer.weight_decay", "train.weight_decay", c.number),
    Key("optimizer.eps", "train.optimizer_args.eps", c.number),
    Key("learning_rate_scheduler", "train.schedule", c.schedule),
    Key("learning_rate_warmup_steps", "train.warmup_steps", _warmup, doc="above 1: micro-batches ÷ "
        "gradient_accumulation_steps; 0 to 1: a fraction of the run (as OneTrainer's create.py); at most the run"),
    Key("clip_grad_norm", "train.max_grad_norm", c.number),
    Key("seed", "train.seed", c.integer),
    Key("train_dtype", "model.dtype", lambda v, ctx: c.dtype(DTYPES.get(str(v).upper(), v), ctx)),
    Key("transformer.weight_dtype", "model.base_precision", _weight_dtype, doc="FLOAT_8 → fp8, INT_8 → int8, "
        "NFLOAT_4 → nf4; unquantized → lorad's auto; GGUF and others not carried"),
    Key("weight_dtype", "model.base_precision", _weight_dtype, doc="before config version 9: one dtype for every part"),
    Key("transformer.gradient_checkpointing", "train.gradient_checkpointing", _on_off),
    Key("gradient_checkpointing", "train.gradient_checkpointing", _on_off, doc="before config version 10: ON, "
        "CPU_OFFLOADED → true"),
    Key("transformer.train", None, _transformer_train),
    Key("unet.train", None, te.onetrainer_unet, doc="SDXL: false refused (lorad always trains the UNet)"),
    Key("text_encoder.train", "lora.text_encoder", te.onetrainer_train("text_encoder_2.train"), doc="SDXL (on by "
        "default there): either encoder → both"),
    Key("text_encoder_2.train", "lora.text_encoder", te.onetrainer_train("text_encoder.train"), doc="as "
        "text_encoder.train"),
    Key("text_encoder.learning_rate", "lora.text_encoder_lr", te.onetrainer_lr("text_encoder_2"), doc="SDXL; "
        "null: learning_rate; a second encoder's other rate is listed"),
    Key("text_encoder_2.learning_rate", "lora.text_encoder_lr", te.onetrainer_lr("text_encoder")),
    Key("text_encoder.stop_training_after", None, te.onetrainer_stop("text_encoder"), doc="a stop within the run "
        "is listed (lorad trains the encoders to the end)"),
    Key("text_encoder.stop_training_after_unit", None, te.onetrainer_stop("text_encoder")),
    Key("text_encoder_2.stop_training_after", None, te.onetrainer_stop("text_encoder_2")),
    Key("text_encoder_2.stop_training_after_unit", None, te.onetrainer_stop("text_encoder_2")),
    Key("dynamic_timestep_shifting", "train.timestep_sampling", _dynamic_shift, doc="true → shift (uniform) or "
        "not carried (with another distribution)"),
    Key("timestep_shift", None, why=NO_FEATURE),
    Key("backup_after", None, why=other_way("checkpoint.every_seconds", "every checkpoint is a backup")),
    Key("backup_after_unit", None, why=other_way("checkpoint.every_seconds")),
    Key("timestep_distribution", "train.timestep_sampling", _timesteps),
    Key("ema", "train.ema", _ema, doc="GPU or CPU → on"),
    Key("ema_decay", "train.ema.decay", _ema_part),
    Key("ema_update_step_interval", "train.ema.every_steps", lambda v, ctx: int(_ema_part(v, ctx))),
    Key("epochs", "train.steps", lambda v, ctx: c.steps_from_epochs(c.integer(v, ctx), ctx, "epochs"),
        doc="epochs × ceil(images × repeats ÷ batch)"),
    Key("save_every", "checkpoint.every_steps", _unit("save_every", "save_every_unit", "checkpoint.every_steps")),
    Key("save_every_unit", None, carried_in("checkpoint.every_steps")),
    Key("sample_after", "sample.every_steps", _unit("sample_after", "sample_after_unit", "sample.every_steps")),
    Key("sample_after_unit", None, carried_in("sample.every_steps")),
    Key("samples", "sample.prompts", _samples, doc="enabled samples; prompt, negative_prompt, seed"),
    Key("workspace_dir", None, why=OUTPUT), Key("cache_dir", None, why=CACHE),
    Key("output_model_destination", None, why=OUTPUT),
    Key("output_model_format", None, why=other_way("output.formats")),
    Key("output_dtype", None, why=other_way("lora.dtype")),
    Key("tensorboard", None, why=other_way("logging.tensorboard")),
    Key("concept_file_name", None, why=other_way("data.path", "the concepts file is read with the preset")),
    Key("sample_definition_file_name", None, why=other_way("sample.prompts", "the samples file is read too")),
    Key("latent_caching", None, why=CACHE),
    Key("__version", None, why=not_applicable("OneTrainer's config version")),
    Key("device", None, why=not_applicable("the daemon gives the job its GPU")),
    Key("train_device", None, why=not_applicable("the daemon gives the job its GPU")),
]
# OneTrainer's defaults (modules/util/config/TrainConfig.py default_values; the optimizer's in
# modules/util/optimizer_util.py) where lorad's differ and the run would change: a preset holds only the keys that
# differ from them, so these are written as if it said them (the header says which).
DEFAULTS = {"learning_rate_scheduler": "CONSTANT", "lora_alpha": 1.0, "optimizer.optimizer": "ADAMW",
            "learning_rate": 3e-6, "learning_rate_warmup_steps": 200, "epochs": 100, "train_dtype": "FLOAT_16",
            "timestep_distribution": "UNIFORM", "transformer.gradient_checkpointing": True}
ADAMW_WEIGHT_DECAY = 1e-2  # ADAMW's and ADAMW_8BIT's weight_decay when the preset leaves it unset


def _side_json(name: Any, ctx: Context) -> Any:
    p = Path(c.local_path(name, ctx))
    if not p.is_file():  # OneTrainer's paths are relative to its own folder: try beside the preset's parent too
        alt = (ctx.base_dir.parent / str(name)).resolve()
        p = alt if alt.is_file() else p
    return json.loads(ctx.read(p))


def read(doc: dict[str, Any], ctx: Context, out: Imported, concepts: Any = None, samples: Any = None) -> None:
    body = dict(doc)
    for key, given, field in (("concept_file_name", concepts, "concepts"),
                              ("sample_definition_file_name", samples, "samples")):
        if given is not None:
            body[field] = given
        elif field not in body and body.get(key):
            try:
                body[field] = _side_json(body[key], ctx)
            except (OSError, ValueError) as e:
                out.problems.append(f"{key}: {body[key]} could not be read ({e}); give it with --dataset")
    conc = [x for x in body.pop("concepts", None) or [] if isinstance(x, dict) and x.get("enabled", True)]
    for i, extra in enumerate(conc[1:], 1):
        out.drop(f"concepts[{i}]", extra.get("path"), other_way("data.path", "one image folder per job: put the "
                 "folders under one, as sub-folders"))
    samp = body.pop("samples", None)
    flat = flatten({k: v for k, v in body.items()})
    if conc:
        flat.update({f"concepts[0].{k}": v for k, v in flatten(conc[0]).items()})
    if samp is not None:
        flat["samples"] = samp
    if str(flat.get("model_type", "")).upper().startswith("STABLE_DIFFUSION_XL"):
        te.onetrainer_defaults(flat, out.notes)
    for part in PARTS:  # the frozen parts: lorad reads them from the model's folder, in its own precision
        for k in [k for k in flat if k.startswith(part + ".") and k not in te.ONETRAINER_ROWS]:
            out.drop(k, flat.pop(k), not_applicable("a frozen model part; lorad trains the transformer's LoRA"))
    defaults = dict(DEFAULTS)
    if "gradient_checkpointing" in flat:  # a config from before version 10 says it at the top
        defaults.pop("transformer.gradient_checkpointing")
    if str(flat.get("optimizer.optimizer", "ADAMW")).upper() in ("ADAMW", "ADAMW_8BIT") and \
            flat.get("optimizer.weight_decay") is None:
        flat.pop("optimizer.weight_decay", None)
        defaults["optimizer.weight_decay"] = ADAMW_WEIGHT_DECAY
    for k, v in defaults.items():
        if k not in flat:
            flat[k] = v
            out.notes.append(f"{k} not set there: OneTrainer's default {v} written")
    if conc:
        ctx.images = len(c.images_in(Path(c.local_path(conc[0].get("path", ""), ctx)))) or None
    ctx.source = flat
    apply(TABLE, flat, ctx, out)
