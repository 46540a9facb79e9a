"""tdrussell/diffusion-pipe: the main TOML (`[model]`, `[adapter]`, `[optimizer]` tables) and the dataset TOML it
names (`dataset = '...'`: `resolutions`, buckets, `[[directory]]` folders). Keys are the TOML's, dotted; the
dataset file's are `dataset.*` and `dataset.directory[].*`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engine.importers import common as c
from engine.importers.table import (
    NO_FEATURE,
    CarriedIn,
    Context,
    Imported,
    Key,
    NotCarried,
    apply,
    carried_in,
    flatten,
    not_applicable,
    other_way,
)

NAME = "diffusion-pipe"
# [model] type (train.py's model_type branches) → family; hunyuan-video is HunyuanVideo 1.0 (refused),
# hunyuan_video_15 the 1.5 lorad trains.
TYPES = {"flux": "flux", "chroma": "chroma", "qwen_image": "qwen_image", "z_image": "z_image", "wan": "wan",
         "flux2": "flux2", "krea2": "krea2", "hunyuan_video_15": "hunyuan_video",
         "ideogram4": "ideogram4", "hidream": "hidream"}


def detect(doc: Any) -> bool:
    return isinstance(doc, dict) and isinstance(doc.get("model"), dict) and "type" in doc["model"] and (
        "dataset" in doc or "adapter" in doc or "optimizer" in doc)


def is_dataset(doc: Any) -> bool:
    return isinstance(doc, dict) and isinstance(doc.get("directory"), list)


def _type(v: Any, ctx: Context) -> str:
    fam = TYPES.get(str(v).lower())
    if fam is None:
        raise c.unsupported("model.type", str(v))
    return fam


def _adapter(v: Any, ctx: Context) -> str:
    if str(v).lower() not in ("lora", "lokr"):
        raise NotCarried(f"{NO_FEATURE} (adapter {v})")
    return str(v).lower()


def _alpha(v: Any, ctx: Context) -> None:
    raise NotCarried(other_way("lora.alpha", "diffusion-pipe refuses this key and trains at alpha = rank, as "
                               "written"))


def _factor(v: Any, ctx: Context) -> int | None:
    n = c.integer(v, ctx)
    return n if n > 0 else None  # -1: LyCORIS picks the factor; lora.factor's own default


def _expert(v: Any, ctx: Context) -> str | None:
    """Wan 2.2 A14B: [model] min_t / max_t keep one expert's side of the boundary (the docs' 0–0.875 for the
    low-noise T2V expert, 0.875–1 for the high-noise one) → model.expert."""
    lo, hi = float(ctx.source.get("model.min_t", 0.0)), float(ctx.source.get("model.max_t", 1.0))
    if ctx.job.get("model", {}).get("family") != "wan":
        raise NotCarried(other_way("train.timestep_bias", f"a timestep range {lo}–{hi}"))
    if lo <= 0.0 and hi < 1.0:
        return "low"
    if lo > 0.0 and hi >= 1.0:
        return "high"
    raise NotCarried(f"{NO_FEATURE} (a timestep range {lo}–{hi} inside one expert's)")


def _expert_max(v: Any, ctx: Context) -> str | None:
    if "model.min_t" in ctx.source:
        raise CarriedIn("model.expert")  # read with min_t
    return _expert(v, ctx)


def _betas(v: Any, ctx: Context) -> list[float]:
    return [float(x) for x in v]


def _minutes(v: Any, ctx: Context) -> float | None:
    n = c.number(v, ctx)
    return n * 60 if n > 0 else None


def _timesteps(v: Any, ctx: Context) -> str:
    return c.timestep_sampling(v, ctx)


def _steps(v: Any, ctx: Context) -> int:
    n = c.steps_from_epochs(c.integer(v, ctx), ctx, "epochs")
    return min(n, c.integer(ctx.source["max_steps"], ctx)) if "max_steps" in ctx.source else n  # stops there


def _examples(v: Any, ctx: Context) -> int | None:
    train = ctx.job.get("train", {})
    batch = int(train.get("batch_size", 1)) * int(train.get("grad_accum", 1))
    n = c.integer(v, ctx) // batch
    return n if n > 0 else None


def _epochs_every(v: Any, ctx: Context) -> int:
    return c.integer(v, ctx) * c.steps_from_epochs(1, ctx, "save_every_n_epochs")


OUTPUT = not_applicable("diffusion-pipe's own output and logs; lorad writes to jobs/ID/")
CACHE = other_way("the cache", "lorad always caches latents and text embeddings, once, in its home")
BUCKETS = other_way("data.resolution", "lorad's buckets: aspect within 2:1 at the resolution's area, always on")
PARTS = other_way("model.path", "lorad reads the VAE and text encoders from the model's diffusers directory")
DEEPSPEED = not_applicable("diffusion-pipe's DeepSpeed pipeline; lorad spreads a job with resources.gpus")

TABLE: list[Key] = [
    Key("model.type", "model.family", _type, doc=", ".join(TYPES) + "; others refused"),
    Key("model.transformer_path", "model.path", c.model_path, doc="it overrides the transformer, so it names the "
        "model: a known single file becomes its hub id, others are refused"),
    Key("model.diffusion_model", "model.path", c.model_path, doc="a ComfyUI file: a known one becomes its hub id"),
    Key("model.diffusers_path", "model.path", c.model_path),
    Key("model.ckpt_path", "model.path", c.model_path),
    Key("model.vae_path", None, why=PARTS), Key("model.vae", None, why=PARTS),
    Key("model.text_encoder_path", None, why=PARTS), Key("model.llm_path", None, why=PARTS),
    Key("model.clip_path", None, why=PARTS), Key("model.text_encoders", None, why=PARTS),
    Key("model.merge_adapters", None, why=f"{NO_FEATURE} (LoRAs merged into the base before training)"),
    Key("model.min_t", "model.expert", _expert, doc="Wan 2.2 A14B: min_t 0, max_t < 1 → low; min_t > 0, max_t 1 "
        "→ high"),
    Key("model.max_t", "model.expert", _expert_max),
    Key("model.dtype", "model.dtype", c.dtype),
    Key("model.transformer_dtype", "model.base_precision", lambda v, ctx: "fp8" if "float8" in str(v) else
        "nf4" if str(v) == "nf4" else None, doc="float8 → fp8, nf4"),
    Key("model.diffusion_model_dtype", "model.base_precision", lambda v, ctx: "fp8" if "float8" in str(v) else None,
        doc="float8 → fp8"),
    Key("model.shift", None, why=other_way("train.timestep_sampling", "shift uses the model's own shift")),
    Key("model.timestep_sample_method", "train.timestep_sampling", _timesteps, doc="logit_normal → sigmoid; "
        "uniform → linear"),
    Key("model.flux_shift", "train.timestep_sampling", lambda v, ctx: "shift" if v else None),
    Key("model.guidance", "train.guidance", c.number),
    Key("adapter.type", "lora.type", _adapter, doc="lora, lokr"),
    Key("adapter.rank", "lora.rank", c.integer),
    Key("adapter.alpha", None, _alpha, doc="refused by diffusion-pipe (alpha = rank): not carried"),
    Key("adapter.decompose_factor", "lora.factor", _factor, doc="lokr; -1 (its default) → lorad's"),
    Key("_alpha", "lora.alpha", c.number, doc="alpha = rank, as diffusion-pipe trains"),
    Key("adapter.dropout", "lora.dropout", c.number),
    Key("adapter.dtype", "lora.dtype", lambda v, ctx: "bfloat16" if "bf" in str(v) else "float32"),
    Key("adapter.init_from_existing", None, why=f"{NO_FEATURE} (starting from a trained LoRA)"),
    Key("dataset.directory[].path", "data.path", c.local_path, doc="the first folder"),
    Key("dataset.directory[].num_repeats", "data.repeats", c.positive_int),
    Key("dataset.directory[].resolutions", "data.resolution", c.resolutions),
    Key("dataset.directory[].mask_path", "data.masks.path", c.local_path),
    Key("dataset.directory[].ar_buckets", None, why=BUCKETS),
    Key("dataset.directory[].frame_buckets", None, why=other_way("data.frames")),
    Key("dataset.resolutions", "data.resolution", c.resolutions, doc="each size, [w, h] as a square's side"),
    Key("dataset.enable_ar_bucket", None, why=BUCKETS), Key("dataset.min_ar", None, why=BUCKETS),
    Key("dataset.max_ar", None, why=BUCKETS), Key("dataset.num_ar_buckets", None, why=BUCKETS),
    Key("dataset.ar_buckets", None, why=BUCKETS),
    Key("dataset.frame_buckets", None, why=other_way("data.frames")),
    Key("micro_batch_size_per_gpu", "train.batch_size", c.integer),
    Key("gradient_accumulation_steps", "train.grad_accum", c.positive_int),
    Key("optimizer.type", "train.optimizer", c.optimizer),
    Key("optimizer.lr", "train.lr", c.number),
    Key("optimizer.betas", "train.optimizer_args.betas", _betas),
    Key("optimizer.weight_decay", "train.weight_decay", c.number),
    Key("optimizer.eps", "train.optimizer_args.eps", c.number),
    Key("lr_scheduler", "train.schedule", c.schedule),
    Key("warmup_steps", "train.warmup_steps", c.integer),
    Key("gradient_clipping", "train.max_grad_norm", c.number),
    Key("activation_checkpointing", "train.gradient_checkpointing", lambda v, ctx: bool(v)),
    Key("blocks_to_swap", "train.blocks_to_swap", c.integer),
    Key("epochs", "train.steps", _steps, doc="epochs × ceil(images × repeats × resolutions ÷ batch), at most "
        "max_steps"),
    Key("max_steps", None, carried_in("train.steps")),
    Key("save_every_n_epochs", "checkpoint.every_steps", _epochs_every),
    Key("save_every_n_steps", "checkpoint.every_steps", c.positive_int),
    Key("save_every_n_examples", "checkpoint.every_steps", _examples, doc="÷ the global batch, as there"),
    Key("checkpoint_every_n_minutes", "checkpoint.every_seconds", _minutes),
    Key("checkpoint_every_n_epochs", None, why=other_way("checkpoint.every_steps")),
    Key("save_dtype", None, why=other_way("lora.dtype")),
    Key("dataset", None, why=other_way("data.path", "the dataset TOML is read with the config")),
    Key("output_dir", None, why=OUTPUT),
    Key("pipeline_stages", None, why=DEEPSPEED), Key("partition_method", None, why=DEEPSPEED),
    Key("caching_batch_size", None, why=CACHE), Key("map_num_proc", None, why=CACHE),
    Key("steps_per_print", None, why=OUTPUT),
    Key("eval_every_n_epochs", None, why=other_way("data.validation")),
    Key("eval_before_first_step", None, why=other_way("data.validation")),
    Key("eval_micro_batch_size_per_gpu", None, why=other_way("data.validation")),
    Key("eval_gradient_accumulation_steps", None, why=other_way("data.validation")),
    Key("video_clip_mode", None, why=other_way("data.frames", "every clip is cut into consecutive windows")),
    Key("disable_block_swap_for_eval", None, why=other_way("data.validation")),
    Key("eval_datasets", None, why=other_way("data.validation")),
    Key("eval_every_n_steps", None, why=other_way("data.validation")),
    Key("monitoring.enable_wandb", None, why=OUTPUT), Key("monitoring.wandb_api_key", None, why=OUTPUT),
    Key("monitoring.wandb_tracker_name", None, why=OUTPUT), Key("monitoring.wandb_run_name", None, why=OUTPUT),
]


def dataset_path(doc: dict[str, Any]) -> str | None:
    v = doc.get("dataset")
    return str(v) if isinstance(v, str) else None


def read(doc: dict[str, Any], ctx: Context, out: Imported, dataset: dict[str, Any] | None = None) -> None:
    if dataset is None and dataset_path(doc):
        name = dataset_path(doc)
        tried = [Path(c.local_path(name, ctx)), (ctx.base_dir.parent / name).resolve()]
        p = next((t for t in tried if t.is_file()), None)
        if p is None:
            out.problems.append(f"dataset: {name} not found (give it with --dataset)")
        else:
            import tomllib

            try:
                dataset = tomllib.loads(ctx.read(p))
            except (OSError, ValueError) as e:
                out.problems.append(f"dataset: {name} could not be read ({e})")
    flat = flatten(doc)
    if dataset is not None:
        dirs = [d for d in dataset.get("directory", []) if isinstance(d, dict)]
        for i, d in enumerate(dirs[1:], 1):
            out.drop(f"dataset.directory[{i}]", d.get("path"), other_way("data.path", "one image folder per job"))
        body = {k: v for k, v in dataset.items() if k != "directory"}
        flat.update({f"dataset.{k}": v for k, v in flatten(body).items()})
        if dirs:
            flat.update({f"dataset.directory[0].{k}": v for k, v in flatten(dirs[0]).items()})
            ctx.images = len(c.images_in(Path(c.local_path(dirs[0].get("path", ""), ctx)))) or None
    if "adapter.rank" in flat:  # diffusion-pipe trains at alpha = rank (train.py sets it; an alpha is refused)
        flat["_alpha"] = flat["adapter.rank"]
        out.notes.append(f"lora.alpha: diffusion-pipe's alpha = rank ({flat['adapter.rank']}) written")
    if "lr_scheduler" not in flat:
        flat["lr_scheduler"] = "constant"
        out.notes.append("lr_scheduler not set there: diffusion-pipe's constant written")
    ctx.source = flat
    apply(TABLE, flat, ctx, out)
