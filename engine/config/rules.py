"""The rules across sections: named functions that read a validated job and return its problems.

Each rule returns a list of Problem (the dotted key or keys it is about, and the line that says what is wrong and
what to do); none changes a value (defaults that depend on other keys are resolved before, in defaults.py).
parse_job runs every rule and reports every problem together. A rule that is about one family returns nothing for
the others.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

from engine.builtin.models import BUILTIN_MODELS, BUILTIN_PREFIX
from engine.config.buckets import bucket_step, buckets_for
from engine.config.declare import (
    IMAGE_FAMILIES,
    LM,
    VIDEO_FAMILIES,
    declared,
    keys_not_read_by,
    keys_set_but_not_for,
    read_only_by,
    section_type,
)
from engine.config.describe import shown
from engine.config.train import FSDP_OPTIMIZERS, OPTIMIZER_ARGS
from engine.registry.families import families, spatial_multiple

if TYPE_CHECKING:
    from engine.config.schema import JobConfig


class Problem(NamedTuple):
    key: str  # the dotted key, or several joined by ", "
    message: str  # one line, naming the key


def warmup_within_steps(cfg: JobConfig) -> list[Problem]:
    t = cfg.train
    if t.warmup_steps > t.steps:
        return [Problem("train.warmup_steps", f"train.warmup_steps ({t.warmup_steps}) exceeds train.steps ({t.steps})")]
    return []


def quantize_agrees_with_base_precision(cfg: JobConfig) -> list[Problem]:
    m = cfg.model
    if m.quantize is not None and m.base_precision not in ("auto", m.quantize):
        return [Problem("model.quantize", f"model.quantize: {m.quantize} contradicts model.base_precision: "
                                          f"{m.base_precision}; model.quantize is deprecated, set only "
                                          "model.base_precision")]
    return []


def block_swap_needs_unquantized_base(cfg: JobConfig) -> list[Problem]:
    quantized = cfg.model.effective_base_precision
    if cfg.train.blocks_to_swap and quantized in ("nf4", "int8"):
        # bitsandbytes places nf4/int8 weights on the GPU itself while loading, with state tied to that
        # placement; streaming them is untested territory, so say so instead of failing mid-run.
        return [Problem("train.blocks_to_swap", f"train.blocks_to_swap: block swapping streams bf16 or fp8 base "
                                                f"weights, not bitsandbytes {quantized}; use model.base_precision: "
                                                "fp8 with it, or set train.blocks_to_swap: 0")]
    return []


def builtin_model_is_of_the_family(cfg: JobConfig) -> list[Problem]:
    path, family = cfg.model.path, cfg.model.family
    builtin = BUILTIN_MODELS.get(path.removeprefix(BUILTIN_PREFIX))
    builtin_family = builtin.family if builtin is not None else "causal_lm"  # an unknown name: check_paths says so
    if path.startswith(BUILTIN_PREFIX) and builtin_family != family:
        return [Problem("model.path", f"model.path: {path} is a {builtin_family} model, but model.family is {family}")]
    return []


def keys_are_for_the_family(cfg: JobConfig) -> list[Problem]:
    """A key the job file sets that is declared for other families only (key(families=...))."""
    family = cfg.model.family
    wrong = keys_set_but_not_for(cfg, family)
    if not wrong:
        return []
    keys = ", ".join(wrong)
    owners = {f for k in wrong for f in _families_of(type(cfg), k)}
    if len(owners) < len(IMAGE_FAMILIES) - 1 and not owners & set(LM):
        # keys of a few image families (SDXL's model.prediction, lora.text_encoder; Wan's model.expert)
        return [Problem(keys, f"{keys}: only for model.family {' or '.join(sorted(owners))}; this job is {family}")]
    if family == "causal_lm":
        others = "" if all(read_only_by(type(cfg), k) == ("flux",) for k in wrong) else \
            f" or another image family ({', '.join(IMAGE_FAMILIES[1:])})"
        return [Problem(keys, f"{keys}: only for model.family flux{others}; this job is causal_lm")]
    return [Problem(keys, f"{keys}: only for model.family causal_lm ({family} reads images and captions)")]


def _families_of(section, dotted: str) -> tuple[str, ...]:
    """The families declaration (key(families=...)) of a dotted key."""
    for part in dotted.split("."):
        field = section.model_fields[part]
        section = section_type(field)
    return declared(field, "families")


def image_family_has_no_quantize(cfg: JobConfig) -> list[Problem]:
    family = cfg.model.family
    if family in IMAGE_FAMILIES and cfg.model.quantize is not None:
        return [Problem("model.quantize", f"model.quantize: nf4 is for causal_lm; for {family} use "
                                          "model.base_precision")]
    return []


def image_output_formats(cfg: JobConfig) -> list[Problem]:
    family, formats, lora_type = cfg.model.family, cfg.output.formats, cfg.lora.type
    if family not in IMAGE_FAMILIES:
        return []
    out = []
    if "peft" in formats:
        out.append(Problem("output.formats", f"output.formats: 'peft' is for causal_lm; {family} writes "
                                             "'diffusers' and/or 'comfyui'"))
    if lora_type in ("lokr", "loha") and "diffusers" in formats:
        out.append(Problem("output.formats, lora.type",
                           f"output.formats, lora.type: diffusers' load_lora_weights cannot read a {lora_type} "
                           "adapter; write output.formats: [comfyui] (LyCORIS keys ComfyUI loads)"))
    if lora_type == "dora" and "comfyui" in formats:
        out.append(Problem("output.formats, lora.type",
                           "output.formats, lora.type: ComfyUI applies a DoRA magnitude with its own (LyCORIS) "
                           "weight-norm convention, not peft's, so the file would not reproduce the trained "
                           "model; write output.formats: [diffusers] for dora"))
    return out


# lora.type per image family: the types whose files lorad writes so that the loaders apply them as trained (the format
# rules in image_output_formats: DoRA in the diffusers file, LoKr and LoHa in the ComfyUI file), and why the others
# are refused. Derived from the family packages' declarations (engine/registry/families.py).
IMAGE_LORA_TYPES = {name: families()[name].adapter_types for name in IMAGE_FAMILIES}
_WHY_NOT = {name: families()[name].why_not_others for name in IMAGE_FAMILIES}


def keys_are_read_by_the_family(cfg: JobConfig) -> list[Problem]:
    """Keys of the image families that some family's trainer does not read yet (key(read_by=...)), and lora.type."""
    family = cfg.model.family
    if family not in IMAGE_FAMILIES:
        return []
    out = []
    if unread := keys_not_read_by(cfg, family):
        keys = ", ".join(unread)
        out.append(Problem(keys, f"{keys}: not read by model.family {family} yet"))
    types = IMAGE_LORA_TYPES[family]
    if cfg.lora.type not in types:
        why = _WHY_NOT[family]
        out.append(Problem("lora.type", f"lora.type: {cfg.lora.type} is not supported for model.family {family} "
                                        f"(it trains {', '.join(types)}): {why}"))
    return out


def chroma_batches_keep_their_mask(cfg: JobConfig) -> list[Problem]:
    t = cfg.train
    if cfg.model.family == "chroma" and t.gradient_checkpointing and t.batch_size > 1:
        # A batch pads captions to its longest with a mask; diffusers' ChromaTransformer2DModel does not pass the
        # mask to its single blocks when checkpointing, so padding would be attended to (batch 1 has no padding).
        return [Problem("train.batch_size, train.gradient_checkpointing",
                        "train.batch_size, train.gradient_checkpointing: diffusers' Chroma drops the caption "
                        "mask in its single blocks under gradient checkpointing; use train.batch_size: 1 with "
                        "train.grad_accum for a larger batch, or turn gradient_checkpointing off")]
    return []


def dop_needs_trigger(cfg: JobConfig) -> list[Problem]:
    if cfg.model.family in IMAGE_FAMILIES and cfg.train.dop is not None and not cfg.data.trigger:
        return [Problem("train.dop", "train.dop: differential output preservation replaces data.trigger with the "
                                     "class word in each caption; set data.trigger")]
    return []


def samples_can_render(cfg: JobConfig) -> list[Problem]:
    s = cfg.sample
    if cfg.model.family not in IMAGE_FAMILIES:
        return []
    out = []
    if cfg.model.family == "flux" and any(neg for _p, neg, _s in s.entries()):
        out.append(Problem("sample.prompts", "sample.prompts: FLUX.1-dev samples with its distilled guidance and "
                                             "takes no negative prompt; remove each prompt's `negative`"))
    if s.every_steps is not None and not s.prompts:
        out.append(Problem("sample.prompts", "sample.prompts: sample.every_steps is set but there are no prompts "
                                             "to render"))
    for i, files in enumerate(s.controls()):
        if files and cfg.data.control_path is None:
            out.append(Problem(f"sample.prompts[{i}].control", f"sample.prompts[{i}].control: control images are "
                                                               "for edit jobs (data.control_path)"))
        elif files and len(files) != len(cfg.data.control_paths()):
            out.append(Problem(f"sample.prompts[{i}].control", f"sample.prompts[{i}].control: one image per "
                                                               f"data.control_path folder ({len(cfg.data.control_paths())})"))
    step = math.lcm(16, spatial_multiple(cfg.model.family, cfg.model.path))
    for k in ("width", "height"):
        if getattr(s, k) % step:
            out.append(Problem(f"sample.{k}", f"sample.{k}: must be a multiple of {step} (got {getattr(s, k)})"))
    return out


def frames_fit_the_family(cfg: JobConfig) -> list[Problem]:
    """A video family's windows are t·k + 1 frames, t its VAE's temporal factor (declared in its package); data.py
    checks 4k + 1 for every job, this the family's own factor."""
    family = cfg.model.family
    t = families()[family].temporal
    if family not in VIDEO_FAMILIES or t is None:
        return []
    if bad := [f for f in cfg.data.frames if f % t != 1 % t]:
        return [Problem("data.frames", f"data.frames: {', '.join(map(str, bad))} not {t}k + 1, the windows "
                                       f"model.family {family}'s VAE encodes (temporal factor {t})")]
    return []


def resolutions_have_buckets(cfg: JobConfig) -> list[Problem]:
    """Every bucket side is a multiple of the family's spatial multiple (VAE factor × patch; engine/config/buckets.py):
    a resolution below it has no bucket to train at."""
    if cfg.model.family not in IMAGE_FAMILIES:
        return []
    multiple = spatial_multiple(cfg.model.family, cfg.model.path)
    if small := [r for r in cfg.data.resolution if not buckets_for(r, multiple)]:
        return [Problem("data.resolution", f"data.resolution: {', '.join(map(str, small))} is below the smallest "
                                           f"bucket of model.family {cfg.model.family} at {cfg.model.path}: every "
                                           f"side is a multiple of {multiple} px (its VAE factor × patch); use "
                                           f"at least {bucket_step(min(small), multiple)}")]
    return []


def video_jobs_read_what_they_can(cfg: JobConfig) -> list[Problem]:
    """Wan's `expert: both` routes each sample to one of two transformers, which block swapping (one block order)
    and DDP (every parameter used in every step) do not expect yet; LTX-2 runs on one process."""
    if cfg.model.family not in VIDEO_FAMILIES:
        return []
    out = []
    if cfg.model.expert == "both" and cfg.train.blocks_to_swap:
        out.append(Problem("model.expert, train.blocks_to_swap",
                           "model.expert, train.blocks_to_swap: block swapping streams one transformer's blocks in "
                           "order; with expert: both, train each expert in a job of its own (high, low)"))
    if cfg.model.expert == "both" and cfg.resources.gpus * cfg.resources.nodes > 1:
        out.append(Problem("model.expert, resources.gpus",
                           "model.expert, resources.gpus: expert: both runs one expert per sample, which DDP "
                           "reads as unused parameters; use one process, or one job per expert"))
    if cfg.model.family == "ltx2" and cfg.resources.gpus * cfg.resources.nodes > 1:
        out.append(Problem("model.family, resources.gpus",
                           "model.family, resources.gpus: an LTX-2 window without sound leaves the audio branch's "
                           "LoRA without gradients, which DDP reads as unused parameters; use one process"))
    return out


def edit_jobs_pair_every_image(cfg: JobConfig) -> list[Problem]:
    """data.control_path pairs data.path's images; the other image sets have no controls to pair (yet)."""
    d = cfg.data
    if d.control_path is None:
        return []
    out = []
    if d.regularisation is not None:
        out.append(Problem("data.regularisation, data.control_path", "data.regularisation, data.control_path: "
                           "regularisation images have no control images; leave one of them out"))
    if d.validation is not None and d.validation.path is not None:
        out.append(Problem("data.validation.path, data.control_path", "data.validation.path, data.control_path: "
                           "an edit job holds out validation pairs of data.path with data.validation.fraction"))
    # Qwen-Image-Edit encodes every text with a control image: samples and DOP's class prompts have none yet.
    if cfg.model.family == "qwen_image":
        for key, on in (("sample.prompts", cfg.sample.prompts), ("train.dop", cfg.train.dop)):
            if on:
                out.append(Problem(f"{key}, data.control_path", f"{key}, data.control_path: Qwen-Image-Edit reads "
                                   "every prompt with a control image, which this key's prompts do not have yet"))
    return out


def optimizer_args_are_known(cfg: JobConfig) -> list[Problem]:
    name, args = cfg.train.optimizer, cfg.train.optimizer_args
    out = []
    if unknown := [f"train.optimizer_args.{k}" for k in args if k not in OPTIMIZER_ARGS[name]]:
        keys = ", ".join(unknown)
        out.append(Problem(keys, f"{keys}: not an argument lorad passes to {name} (allowed: "
                                 f"{', '.join(OPTIMIZER_ARGS[name])})"))
    betas = args.get("betas")
    if betas is not None and (not isinstance(betas, list) or len(betas) != 2 or not all(0 <= b < 1 for b in betas)):
        out.append(Problem("train.optimizer_args.betas",
                           f"train.optimizer_args.betas: must be two numbers in [0, 1) (got {shown(betas)})"))
    return out


def schedulefree_keys(cfg: JobConfig) -> list[Problem]:
    t = cfg.train
    if t.optimizer != "adamw_schedulefree":
        return []
    out = []
    if t.ema is not None:
        out.append(Problem("train.ema", "train.ema: adamw_schedulefree already averages its iterates (its "
                                        "evaluation weights are what is exported); leave train.ema out with it"))
    if t.schedule != "constant":  # constant is its default (defaults.py): this schedule is written in the job
        out.append(Problem("train.schedule", f"train.schedule: adamw_schedulefree replaces the decaying schedule "
                                             f"with iterate averaging; use constant (the default with it) instead "
                                             f"of {t.schedule} (train.warmup_steps still applies)"))
    return out


_FSDP_EXCLUDES = {
    "train.blocks_to_swap": "block swapping moves whole blocks, which fsdp keeps sharded",
    "train.ema": "the average would need the whole adapter on one process at every update",
    "sample.every_steps": "samples render on rank 0 alone, which needs the whole model",
    # fully_shard swaps every parameter for a sharded one, and the encoders' optimizer group (their lr_scale
    # attribute, engine/training/optim.py) goes with the old one: they would train at train.lr unsaid
    "lora.text_encoder_lr": "the encoders' own learning rate would be lost in sharding, and they would train at "
                            "train.lr",
}


def fsdp_can_shard_it(cfg: JobConfig) -> list[Problem]:
    if cfg.train.sharding != "fsdp":
        return []
    out = []
    if cfg.train.optimizer not in FSDP_OPTIMIZERS:
        out.append(Problem("train.optimizer, train.sharding",
                           f"train.optimizer, train.sharding: {cfg.train.optimizer} is not verified on sharded "
                           f"(fsdp) parameters; use train.optimizer: {' or '.join(FSDP_OPTIMIZERS)} with "
                           "train.sharding: fsdp"))
    quantized = cfg.model.effective_base_precision
    if quantized in ("fp8", "nf4", "int8"):
        out.append(Problem("model.base_precision, train.sharding",
                           f"model.base_precision, train.sharding: a {quantized} base is held in quantized tensor "
                           "types that FSDP cannot shard; use model.base_precision: auto or bf16 with "
                           "train.sharding: fsdp (sharding is what makes a big base fit)"))
    setting = {"train.blocks_to_swap": bool(cfg.train.blocks_to_swap), "train.ema": cfg.train.ema is not None,
               "sample.every_steps": cfg.sample.every_steps is not None,
               "lora.text_encoder_lr": cfg.lora.text_encoder_lr is not None}
    for key, why in _FSDP_EXCLUDES.items():
        if setting[key]:
            out.append(Problem(f"{key}, train.sharding", f"{key}, train.sharding: not with train.sharding: fsdp "
                                                         f"({why}); leave {key} out or use train.sharding: ddp"))
    return out


def min_nodes_keep_the_batch(cfg: JobConfig) -> list[Problem]:
    res = cfg.resources
    if res.min_nodes is None:
        return []
    if res.min_nodes > res.nodes:
        return [Problem("resources.min_nodes",
                        f"resources.min_nodes: {res.min_nodes} is more than resources.nodes ({res.nodes})")]
    for n in range(res.min_nodes, res.nodes):  # on fewer machines grad_accum is re-planned: it must stay whole
        if cfg.global_batch() % (cfg.train.batch_size * res.gpus * n):
            return [Problem("resources.min_nodes",
                            f"resources.min_nodes: on {n} machine(s) of {res.gpus} process(es) the global batch "
                            f"({cfg.global_batch()} samples) cannot be kept with train.batch_size "
                            f"{cfg.train.batch_size}; raise resources.min_nodes or train.grad_accum")]
    return []


RULES: tuple[Callable[[JobConfig], list[Problem]], ...] = (
    warmup_within_steps, quantize_agrees_with_base_precision, block_swap_needs_unquantized_base,
    builtin_model_is_of_the_family, keys_are_for_the_family, image_family_has_no_quantize, image_output_formats,
    keys_are_read_by_the_family, dop_needs_trigger, samples_can_render, optimizer_args_are_known, schedulefree_keys,
    fsdp_can_shard_it, min_nodes_keep_the_batch, chroma_batches_keep_their_mask, video_jobs_read_what_they_can,
    edit_jobs_pair_every_image, resolutions_have_buckets, frames_fit_the_family,
)


def problems_of(cfg: JobConfig) -> list[Problem]:
    """Every rule's problems, in the order of RULES."""
    return [p for rule in RULES for p in rule(cfg)]
