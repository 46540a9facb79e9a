"""The job file: strict validation with pydantic.

Every error names the key and, where there is a closed set, the allowed
values; all errors are collected and reported together. Relative paths are
resolved against the job file's directory so the normalised job (written to
jobs/ID/job.yaml) is self-contained.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Annotated, Any, Literal, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from engine.builtin.models import BUILTIN_MODELS, BUILTIN_PREFIX
from engine.config.policy import JobPolicy
from engine.errors import JobInvalid  # daemon/ imports it from here too, until the daemon rework is merged

MAX_JOB_FILE_BYTES = 256 * 1024
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(Strict):
    family: Literal["causal_lm", "flux", "flux2", "qwen_image"] = "causal_lm"
    path: str = Field(description="local directory, hub id (org/name) or builtin:NAME")
    revision: str | None = None
    dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    # Deprecated: the older spelling of base_precision: nf4. Kept as written (not rewritten into base_precision)
    # because the identity hash covers the keys as written: checkpoints of old job files must still resume.
    quantize: Literal["nf4"] | None = None
    base_precision: Literal["auto", "bf16", "fp8", "nf4", "int8"] = "auto"
    trust_remote_code: bool = False

    @property
    def effective_base_precision(self) -> str:
        """base_precision, with the deprecated quantize: nf4 mapped onto it: what the families load."""
        return "nf4" if self.quantize == "nf4" else self.base_precision


class LoraConfig(Strict):
    rank: int = Field(16, ge=1, le=1024)
    alpha: float = Field(16.0, gt=0)
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    # The adapter weights' storage dtype (engine/training/adapters.py): fp32 keeps small updates a bf16 weight would lose.
    dtype: Literal["float32", "bfloat16"] = "float32"
    # The peft tuner (engine/training/adapters.py); factor and decompose_both shape LoKr's Kronecker factors.
    type: Literal["lora", "dora", "lokr", "loha"] = "lora"
    factor: int = Field(-1, ge=-1, le=1024)
    decompose_both: bool = False

    @model_validator(mode="after")
    def _type_keys(self):
        if self.type != "lokr":
            # by value, not by presence: the normalised job file (dump_job) writes every key at its default
            wrong = [f"lora.{k}" for k, default in (("factor", -1), ("decompose_both", False))
                     if getattr(self, k) != default]
            if wrong:
                raise ValueError(f"{', '.join(wrong)}: only for lora.type lokr (this job's lora.type is {self.type})")
        if self.type in ("lokr", "loha") and self.dropout:
            raise ValueError(f"lora.dropout: {self.type} has no input dropout in peft; set lora.dropout: 0")
        if self.factor == 0:
            raise ValueError("lora.factor: must be -1 (as square as possible) or a positive factor size")
        return self
    # A list of module-name suffixes, or one regular expression matched against the full module path.
    # None (the default) means the family's own default list (engine/families/*.py: DEFAULT_TARGETS).
    targets: Union[list[str], str, None] = None

    @field_validator("targets")
    @classmethod
    def _targets_ok(cls, v):
        if isinstance(v, str):
            try:
                re.compile(v)
            except re.error as e:
                raise ValueError(f"not a valid regular expression: {e}") from None
        elif v is not None and not v:  # None (written out as null) = the family's defaults
            raise ValueError("must name at least one module")
        return v


class MaskConfig(Strict):
    """flux only: a per-image loss mask (engine/data/masks.py): a folder of same-name masks, or the alpha channel."""

    path: str | None = None
    alpha: bool = False

    @model_validator(mode="after")
    def _one_source(self):
        if (self.path is None) == (not self.alpha):
            raise ValueError("give exactly one of path (a folder of masks named like the images) or alpha: true")
        return self


class RegularisationConfig(Strict):
    """flux only: a second image folder (class images, own captions) mixed into the order with its own loss weight."""

    path: str
    weight: float = Field(1.0, gt=0.0, le=100.0)
    repeats: int = Field(1, ge=1, le=10000)


class ValidationConfig(Strict):
    """A fixed validation set, its loss reported every_steps (engine/training/heldout.py)."""

    path: str | None = None  # a separate dataset in data.path's format
    fraction: float | None = Field(None, gt=0.0, lt=1.0)  # or this share of data.path, held out by train.seed
    every_steps: int = Field(100, ge=1, le=10_000_000)
    batches: int | None = Field(None, ge=1)  # batches of train.batch_size samples per evaluation; null = the whole set

    @model_validator(mode="after")
    def _one_source(self):
        if (self.path is None) == (self.fraction is None):
            raise ValueError("give exactly one of path (a separate dataset) or fraction (held out of data.path)")
        return self


class DataConfig(Strict):
    path: str = Field(description="a .jsonl file, a .txt file, or a directory of .txt files (causal_lm); a folder of images (flux)")
    # causal_lm only
    text_field: str = "text"
    seq_len: int = Field(256, ge=8, le=131072)
    packing: bool = True
    # Which tokens carry the loss: completions = the assistant turns of chat data (its default), all = every token
    # (the only choice, and the default, for plain text). Unset = by the data's format.
    train_on: Literal["completions", "all"] | None = None
    # flux only (engine/data/images.py): aspect-ratio buckets around each resolution, captions from IMAGE.<caption_ext>
    resolution: list[Annotated[int, Field(ge=32, le=4096)]] = Field(default_factory=lambda: [512], min_length=1)
    trigger: str | None = Field(None, max_length=200)
    caption_ext: str = Field("txt", pattern=r"^[A-Za-z0-9_]{1,16}$")
    caption_dropout: float = Field(0.0, ge=0.0, le=1.0)
    flip: bool = False
    repeats: int = Field(1, ge=1, le=10000)
    masks: MaskConfig | None = None
    regularisation: RegularisationConfig | None = None
    validation: ValidationConfig | None = None


class TimestepBias(Strict):
    """flux only: reweight the σ sampling density toward a band of noise levels (engine/families/image/timestep_bias.py)."""

    strategy: Literal["balanced", "earlier", "later", "range"] = "balanced"
    multiplier: float = Field(2.0, gt=0.0, le=100.0)
    begin: float | None = Field(None, ge=0.0, le=1.0)
    end: float | None = Field(None, ge=0.0, le=1.0)

    @model_validator(mode="after")
    def _band_ok(self):
        # Raised here, these are reported as "train.timestep_bias: <message>".
        if self.strategy == "range":
            if self.begin is None or self.end is None:
                raise ValueError("strategy range needs both begin and end (σ from 0 to 1)")
            if self.begin >= self.end:
                raise ValueError(f"begin must be below end (got {self.begin} ≥ {self.end})")
        elif self.strategy == "later" and self.end is not None:
            raise ValueError("end: strategy later weights [begin, 1]; set begin, or use strategy range")
        elif self.strategy == "earlier" and self.begin is not None:
            raise ValueError("begin: strategy earlier weights [0, end]; set end, or use strategy range")
        elif self.strategy == "balanced" and (self.begin is not None or self.end is not None):
            raise ValueError("strategy balanced applies no bias; begin/end need earlier, later or range")
        return self


class DopConfig(Strict):
    """flux only: differential output preservation (engine/families/image/flux.py: Flux.loss)."""

    preservation_class: str = Field(min_length=1, max_length=200)
    weight: float = Field(1.0, gt=0.0, le=100.0)


class EmaConfig(Strict):
    """An exponential moving average of the adapter weights (engine/training/ema.py)."""

    decay: float = Field(0.999, gt=0.0, lt=1.0)
    every_steps: int = Field(1, ge=1, le=1_000_000)
    start_step: int = Field(0, ge=0)
    export_raw: bool = False  # also write the raw (last) weights to output/raw/


class TrainConfig(Strict):
    steps: int = Field(1000, ge=1, le=10_000_000)
    batch_size: int = Field(1, ge=1, le=4096)
    grad_accum: int = Field(1, ge=1, le=4096)
    lr: float = Field(1e-4, gt=0, le=1.0)
    schedule: Literal["constant", "linear", "cosine"] = "cosine"
    warmup_steps: int = Field(0, ge=0)
    weight_decay: float = Field(0.0, ge=0.0, le=1.0)
    optimizer: Literal["adamw8bit", "paged_adamw8bit", "adamw", "prodigy", "adamw_schedulefree", "scao"] = "adamw8bit"
    # Constructor arguments of the optimizer (OPTIMIZER_ARGS lists the ones each accepts).
    optimizer_args: dict[str, Union[bool, int, float, list[float]]] = Field(default_factory=dict)
    ema: EmaConfig | None = None
    seed: int = Field(0, ge=0, le=2**31 - 1)
    gradient_checkpointing: bool = False
    max_grad_norm: float | None = Field(1.0, gt=0)
    blocks_to_swap: int = Field(0, ge=0)
    compile: bool = False
    # causal_lm only: LM head + cross-entropy in chunks, never the full logits (engine/training/chunked_loss.py).
    # auto = on from a vocabulary of engine.training.chunked_loss.AUTO_MIN_VOCAB (65,536) tokens.
    chunked_loss: Literal["auto"] | bool = "auto"
    # flux only. sigmoid: sigma = sigmoid(N(0,1)) (logit-normal, mid-noise heavy); linear: sigma ~ U(0,1);
    # shift: U(0,1) moved toward high noise by the resolution-dependent shift of FLUX's scheduler.
    timestep_sampling: Literal["sigmoid", "linear", "shift"] = "sigmoid"
    # flux only: the guidance value fed to FLUX.1-dev's guidance embedding while training (ignored by schnell).
    guidance: float = Field(1.0, ge=0.0, le=100.0)
    # flux only: emphasise high or low noise levels (engine/families/image/timestep_bias.py).
    timestep_bias: TimestepBias = Field(default_factory=TimestepBias)
    # flux only: keep the class (train.dop.preservation_class) as the base model draws it; needs data.trigger.
    dop: DopConfig | None = None
    # How several processes hold the model: ddp, a whole copy each; fsdp, the base and adapter sharded over them
    # (FSDP2, engine/distributed/fsdp.py) for a base too big for one GPU.
    sharding: Literal["ddp", "fsdp"] = "ddp"


class SampleConfig(Strict):
    """Preview images rendered during training (flux): every_steps, with fixed seeds, into WORKDIR/samples/step-N/."""

    every_steps: int | None = Field(None, ge=1)
    prompts: list[Annotated[str, Field(min_length=1, max_length=2000)]] = Field(default_factory=list, max_length=64)
    seed: int = Field(42, ge=0, le=2**31 - 1)
    steps: int = Field(20, ge=1, le=200)
    guidance: float = Field(3.5, ge=0.0, le=100.0)
    width: int = Field(1024, ge=32, le=4096)
    height: int = Field(1024, ge=32, le=4096)


class CheckpointConfig(Strict):
    every_steps: int | None = Field(100, ge=1)
    every_seconds: float | None = Field(60.0, gt=0)
    keep: int = Field(3, ge=1, le=1000)

    @model_validator(mode="after")
    def _some_trigger(self):
        if self.every_steps is None and self.every_seconds is None:
            raise ValueError("every_steps and every_seconds are both null: nothing would be "
                             "saved before the end, and an outage would lose the whole run; set at least one")
        return self


class OutputConfig(Strict):
    formats: list[Literal["peft", "diffusers", "comfyui"]] = Field(default_factory=lambda: ["peft"])


class LoggingConfig(Strict):
    # TensorBoard event files in jobs/ID/tb/ (engine/report/tensorboard.py); null = on when the package is installed.
    tensorboard: bool | None = None


class PowerConfig(Strict):
    limit_w: Union[Annotated[int, Field(ge=1, le=2000)], Literal["auto"], None] = None
    max_slowdown: float = Field(0.10, gt=0.0, le=1.0)


class ResourcesConfig(Strict):
    """The devices one job trains on (engine/distributed/ddp.py, docs/distributed.md)."""

    # Processes per machine, one per GPU (on a machine without a GPU, CPU processes through gloo).
    gpus: int = Field(1, ge=1, le=64)
    # Machines the job spans (torchrun's rendezvous joins them; docs/distributed.md, "Several machines").
    nodes: int = Field(1, ge=1, le=64)
    # The fewest machines it may go on with when one is lost (torchrun --nnodes MIN:MAX); null = nodes.
    min_nodes: int | None = Field(None, ge=1, le=64)


class JobConfig(Strict):
    name: str
    model: ModelConfig
    lora: LoraConfig = Field(default_factory=LoraConfig)
    data: DataConfig
    train: TrainConfig = Field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    output: OutputConfig = Field(default_factory=OutputConfig)
    power: PowerConfig = Field(default_factory=PowerConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    priority: int = Field(0, ge=-1000, le=1000)
    sample: SampleConfig = Field(default_factory=SampleConfig)
    resources: ResourcesConfig = Field(default_factory=ResourcesConfig)

    @field_validator("name")
    @classmethod
    def _name_ok(cls, v: str) -> str:
        if not NAME_RE.match(v):
            raise ValueError("must be 1-64 characters of letters, digits, '.', '_' or '-', starting with a letter or digit")
        return v

    @model_validator(mode="after")
    def _cross_checks(self):
        if self.train.warmup_steps > self.train.steps:
            raise ValueError(f"train.warmup_steps ({self.train.warmup_steps}) exceeds train.steps ({self.train.steps})")
        if self.model.quantize is not None and self.model.base_precision not in ("auto", self.model.quantize):
            raise ValueError(f"model.quantize: {self.model.quantize} contradicts model.base_precision: "
                             f"{self.model.base_precision}; model.quantize is deprecated, set only "
                             f"model.base_precision")
        quantized = self.model.effective_base_precision
        if self.train.blocks_to_swap and quantized in ("nf4", "int8"):
            # bitsandbytes places nf4/int8 weights on the GPU itself while loading, with state tied to that
            # placement; streaming them is untested territory, so say so instead of failing mid-run.
            raise ValueError(f"train.blocks_to_swap: block swapping streams bf16 or fp8 base weights, not "
                             f"bitsandbytes {quantized}; use model.base_precision: fp8 with it, or set "
                             f"train.blocks_to_swap: 0")
        _family_keys_check(self)
        _optimizer_check(self.train)
        _sharding_check(self)
        _nodes_check(self)
        return self

    def deprecated_keys(self) -> list[tuple[str, str]]:
        """(key, what to write instead) for every deprecated key this job sets; the engine warns about each."""
        if self.model.quantize is not None:
            return [("model.quantize", f"model.base_precision: {self.model.quantize}")]
        return []

    def identity_hash(self) -> str:
        """Hash of everything that decides the trained weights.

        The step count, checkpoint cadence, outputs, power and priority may
        change between attempts without invalidating a checkpoint.
        Keys at their default value are left out, so a lorad upgrade that adds
        a key (with a default that keeps the old behaviour) does not strand
        every checkpoint written before it.
        """
        return hashlib.sha256(json.dumps(self.identity(), sort_keys=True).encode()).hexdigest()[:16]

    def identity(self) -> dict[str, Any]:
        """The settings identity_hash covers, as a dict (checkpoints keep it to say what changed)."""
        d = self.model_dump(mode="json", exclude_defaults=True)
        # blocks_to_swap and compile trade speed for memory; a job may resume with more swapping after an OOM.
        for k in ("steps", "blocks_to_swap", "compile"):
            d.get("train", {}).pop(k, None)
        (d.get("train", {}).get("ema") or {}).pop("export_raw", None)  # what is exported, not what is trained
        # Validation only reads the weights; a held-out fraction changes the training set, so it stays.
        if (val := d.get("data", {}).pop("validation", None)) and "fraction" in val:
            d["data"]["validation"] = {"fraction": val["fraction"]}
        for k in ("checkpoint", "output", "power", "priority", "sample", "logging", "resources"):
            d.pop(k, None)
        # What decides the weights is the global batch, not how it is split: a job may resume on another number of
        # GPUs with grad_accum re-planned (engine/distributed/ddp.py), or with both changed and the product kept.
        d.get("train", {}).pop("grad_accum", None)
        if (g := self.global_batch()) != self.train.batch_size:
            d.setdefault("train", {})["global_batch"] = g
        return d

    def processes(self) -> int:
        """The world size the job is written for: resources.gpus × resources.nodes."""
        return self.resources.gpus * self.resources.nodes

    def global_batch(self) -> int:
        """Samples per optimizer step: batch_size × grad_accum × resources.gpus × resources.nodes."""
        return self.train.batch_size * self.train.grad_accum * self.processes()


# Keys that only mean something for one family; setting them on the other is a mistake worth naming.
IMAGE_DATA_KEYS = ("resolution", "trigger", "caption_ext", "caption_dropout", "flip", "repeats", "masks",
                   "regularisation")
TEXT_DATA_KEYS = ("text_field", "seq_len", "packing", "train_on")
FLUX_TRAIN_KEYS = ("timestep_sampling", "guidance", "timestep_bias", "dop")
LM_TRAIN_KEYS = ("chunked_loss",)
# The families that train on images (engine/families/image/flux.py and image_base.py); FLUX.1's keys that the others
# do not read yet.
IMAGE_FAMILIES = ("flux", "flux2", "qwen_image")
FLUX1_ONLY_KEYS = ("data.masks", "data.regularisation", "data.validation", "train.dop")


# The constructor arguments train.optimizer_args may set, per optimizer. Left out on purpose: lr and
# weight_decay (train.lr, train.weight_decay), schedule-free's own warm-up (train.warmup_steps does it),
# and scao's features whose state scao does not checkpoint (lookahead, dynamic sparsity, adaptive rank).
_ADAM_ARGS = ("betas", "eps")
OPTIMIZER_ARGS: dict[str, tuple[str, ...]] = {
    "adamw8bit": _ADAM_ARGS,
    "paged_adamw8bit": _ADAM_ARGS,
    "adamw": (*_ADAM_ARGS, "amsgrad"),
    "prodigy": (*_ADAM_ARGS, "beta3", "d0", "d_coef", "growth_rate", "use_bias_correction", "safeguard_warmup",
                "slice_p"),
    "adamw_schedulefree": (*_ADAM_ARGS, "r", "weight_lr_power"),
    "scao": (*_ADAM_ARGS, "precond_freq", "warmup_steps", "blend_steps", "k_min", "k_max", "rho", "tau",
             "epsilon_sparse", "min_precond_updates", "max_precond_dim", "use_int8_ema"),
}


def _optimizer_check(train: TrainConfig) -> None:
    name = train.optimizer
    unknown = [k for k in train.optimizer_args if k not in OPTIMIZER_ARGS[name]]
    if unknown:
        raise ValueError(f"{', '.join(f'train.optimizer_args.{k}' for k in unknown)}: not an argument lorad passes "
                         f"to {name} (allowed: {', '.join(OPTIMIZER_ARGS[name])})")
    betas = train.optimizer_args.get("betas")
    if betas is not None and (not isinstance(betas, list) or len(betas) != 2 or not all(0 <= b < 1 for b in betas)):
        raise ValueError(f"train.optimizer_args.betas: must be two numbers in [0, 1) (got {betas!r})")
    if name == "prodigy" and "lr" not in train.model_fields_set:
        train.lr = 1.0  # Prodigy's lr scales its own step-size estimate: 1.0 is its default
    if name == "adamw_schedulefree":
        if train.ema is not None:
            raise ValueError("train.ema: adamw_schedulefree already averages its iterates (its evaluation weights "
                             "are what is exported); leave train.ema out with it")
        if "schedule" not in train.model_fields_set:
            train.schedule = "constant"
        elif train.schedule != "constant":
            raise ValueError(f"train.schedule: adamw_schedulefree replaces the decaying schedule with iterate "
                             f"averaging; use constant (the default with it) instead of {train.schedule} "
                             "(train.warmup_steps still applies)")


# With train.sharding: fsdp the parameters are sharded tensors (DTensor) on every rank; what needs a whole
# parameter on one process, or bitsandbytes' own tensor types, cannot go with it.
FSDP_OPTIMIZERS = ("adamw",)  # plain torch: its state shards with the parameters (bitsandbytes' 8-bit states do not)


def _sharding_check(cfg: JobConfig) -> None:
    if cfg.train.sharding != "fsdp":
        return
    if cfg.train.optimizer not in FSDP_OPTIMIZERS:
        raise ValueError(f"train.optimizer, train.sharding: {cfg.train.optimizer} is not verified on sharded "
                         f"(fsdp) parameters; use train.optimizer: {' or '.join(FSDP_OPTIMIZERS)} with "
                         "train.sharding: fsdp")
    quantized = cfg.model.effective_base_precision
    if quantized in ("fp8", "nf4", "int8"):
        raise ValueError(f"model.base_precision, train.sharding: a {quantized} base is held in quantized tensor "
                         "types that FSDP cannot shard; use model.base_precision: auto or bf16 with train.sharding: "
                         "fsdp (sharding is what makes a big base fit)")
    for key, bad in (("train.blocks_to_swap", bool(cfg.train.blocks_to_swap)), ("train.ema", cfg.train.ema is not None),
                     ("sample.every_steps", cfg.sample.every_steps is not None)):
        if bad:
            why = {"train.blocks_to_swap": "block swapping moves whole blocks, which fsdp keeps sharded",
                   "train.ema": "the average would need the whole adapter on one process at every update",
                   "sample.every_steps": "samples render on rank 0 alone, which needs the whole model"}[key]
            raise ValueError(f"{key}, train.sharding: not with train.sharding: fsdp ({why}); leave {key} out or "
                             "use train.sharding: ddp")


def _nodes_check(cfg: JobConfig) -> None:
    res = cfg.resources
    if res.min_nodes is None:
        return
    if res.min_nodes > res.nodes:
        raise ValueError(f"resources.min_nodes: {res.min_nodes} is more than resources.nodes ({res.nodes})")
    for n in range(res.min_nodes, res.nodes):  # on fewer machines grad_accum is re-planned: it must stay whole
        if cfg.global_batch() % (cfg.train.batch_size * res.gpus * n):
            raise ValueError(f"resources.min_nodes: on {n} machine(s) of {res.gpus} process(es) the global batch "
                             f"({cfg.global_batch()} samples) cannot be kept with train.batch_size "
                             f"{cfg.train.batch_size}; raise resources.min_nodes or train.grad_accum")


def _family_keys_check(cfg: JobConfig) -> None:
    family = cfg.model.family
    builtin = BUILTIN_MODELS.get(cfg.model.path.removeprefix(BUILTIN_PREFIX))
    builtin_family = builtin.family if builtin is not None else "causal_lm"  # an unknown name: _check_paths says so
    if cfg.model.path.startswith(BUILTIN_PREFIX) and builtin_family != family:
        raise ValueError(f"model.path: {cfg.model.path} is a {builtin_family} model, but model.family is {family}")
    if family == "causal_lm":
        wrong = [f"data.{k}" for k in IMAGE_DATA_KEYS if k in cfg.data.model_fields_set]
        wrong += [f"train.{k}" for k in FLUX_TRAIN_KEYS if k in cfg.train.model_fields_set]
        wrong += ["sample"] if "sample" in cfg.model_fields_set else []
        if wrong:
            others = "" if set(wrong) <= set(FLUX1_ONLY_KEYS) else \
                f" or another image family ({', '.join(IMAGE_FAMILIES[1:])})"
            raise ValueError(f"{', '.join(wrong)}: only for model.family flux{others}; this job is causal_lm")
    elif family in IMAGE_FAMILIES:
        wrong = [f"data.{k}" for k in TEXT_DATA_KEYS if k in cfg.data.model_fields_set]
        wrong += [f"train.{k}" for k in LM_TRAIN_KEYS if k in cfg.train.model_fields_set]
        if wrong:
            raise ValueError(f"{', '.join(wrong)}: only for model.family causal_lm ({family} reads images and captions)")
        if cfg.model.quantize is not None:
            raise ValueError(f"model.quantize: nf4 is for causal_lm; for {family} use model.base_precision")
        if "formats" not in cfg.output.model_fields_set:
            # the family-aware default; diffusers' load_lora_weights reads LoRA and DoRA only
            cfg.output.formats = ["comfyui"] if cfg.lora.type in ("lokr", "loha") else ["diffusers"]
        if "peft" in cfg.output.formats:
            raise ValueError(f"output.formats: 'peft' is for causal_lm; {family} writes 'diffusers' and/or 'comfyui'")
        set_ = (cfg.data.masks, cfg.data.regularisation, cfg.data.validation, cfg.train.dop)
        flux_only = [k for k, v in zip(FLUX1_ONLY_KEYS, set_, strict=True) if v is not None]
        if family != "flux" and flux_only:
            raise ValueError(f"{', '.join(flux_only)}: only for model.family flux so far (this job is {family})")
        if family != "flux" and cfg.lora.type != "lora":
            raise ValueError(f"lora.type: {cfg.lora.type} is not supported for model.family {family} yet (only lora: "
                             "its exports are checked against diffusers' and ComfyUI's loaders)")
        if cfg.lora.type in ("lokr", "loha") and "diffusers" in cfg.output.formats:
            raise ValueError(f"output.formats, lora.type: diffusers' load_lora_weights cannot read a {cfg.lora.type} "
                             "adapter; write output.formats: [comfyui] (LyCORIS keys ComfyUI loads)")
        if cfg.lora.type == "dora" and "comfyui" in cfg.output.formats:
            raise ValueError("output.formats, lora.type: ComfyUI applies a DoRA magnitude with its own (LyCORIS) "
                             "weight-norm convention, not peft's, so the file would not reproduce the trained "
                             "model; write output.formats: [diffusers] for dora")
        if cfg.train.dop is not None and not cfg.data.trigger:
            raise ValueError("train.dop: differential output preservation replaces data.trigger with the class word "
                             "in each caption; set data.trigger")
        if cfg.sample.every_steps is not None and not cfg.sample.prompts:
            raise ValueError("sample.prompts: sample.every_steps is set but there are no prompts to render")
        for k in ("width", "height"):
            if getattr(cfg.sample, k) % 16:
                raise ValueError(f"sample.{k}: must be a multiple of 16 (got {getattr(cfg.sample, k)})")


def _loc(loc: tuple) -> str:
    return ".".join(str(p) for p in loc if not str(p).startswith("function-")) or "(top level)"


def _describe(err: dict, models: dict[str, type[BaseModel]]) -> str:
    # pydantic reports union members as extra path parts; drop them for a readable key.
    key_parts = [str(p) for p in err["loc"] if not re.match(r"^(list\[.*\]|literal\[.*\]|int|str|float|bool|function-.*|constrained-.*)$", str(p))]
    key = ".".join(key_parts) or "(top level)"
    typ = err["type"]
    got = err.get("input")
    if typ == "extra_forbidden":
        parent = ".".join(key_parts[:-1])
        model = models.get(parent)
        if not model:
            return f"{key}: unknown key"
        import difflib

        close = difflib.get_close_matches(key_parts[-1], list(model.model_fields), n=1, cutoff=0.6)
        hint = f"did you mean {'.'.join([*key_parts[:-1], close[0]])}? " if close else ""
        return f"{key}: unknown key ({hint}allowed here: {', '.join(model.model_fields)})"
    if typ == "missing":
        return f"{key}: required key is missing"
    if typ == "value_error" and not key_parts:
        # Cross-section checks raise at the top level and name their keys in the message themselves.
        return err["msg"].replace("Value error, ", "")
    if typ == "literal_error":
        return f"{key}: {err['msg'].replace('Input should be', 'must be')} (got {got!r})"
    msg = err["msg"].replace("Value error, ", "").replace("Input should be", "must be")
    if got is not None and not isinstance(got, dict):
        return f"{key}: {msg} (got {got!r})"
    return f"{key}: {msg}"


def describe_errors(e: ValidationError, models: dict[str, type[BaseModel]]) -> str:
    """Every problem pydantic found, one line, each naming its key (`did you mean` for a misspelt one).

    models: dotted section path ("" for the top) → its model, where an unknown key's neighbours are looked up.
    The daemon config's errors are worded by this too (daemon/config/daemon.py).
    """
    problems = [_describe(err, models) for err in e.errors()]
    # Several union branches may fail for one key; keep the distinct messages, in order.
    return "; ".join(dict.fromkeys(problems))


def _section_models() -> dict[str, type[BaseModel]]:
    out: dict[str, type[BaseModel]] = {"": JobConfig}
    for name, field in JobConfig.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            out[name] = ann
    return out


def parse_job(raw: Any, base_dir: Path, source: str = "job", check_paths: bool = True) -> JobConfig:
    """Validate a parsed YAML document and resolve its paths; raise JobInvalid naming every problem.

    check_paths=False validates the schema only (documentation jobs whose model lives on another machine).
    """
    if raw is None:
        raise JobInvalid(f"{source}: the job file is empty (it needs at least name, model and data)")
    if not isinstance(raw, dict):
        raise JobInvalid(f"{source}: the job file must be a YAML mapping of sections (name, model, data, ...), got {type(raw).__name__}")
    try:
        cfg = JobConfig.model_validate(raw)
    except ValidationError as e:
        raise JobInvalid(f"{source}: {describe_errors(e, _section_models())}") from None
    _resolve_paths(cfg, base_dir)
    if check_paths:
        _check_paths(cfg)
    return cfg


def _resolve(p: str, base_dir: Path) -> str:
    path = Path(p).expanduser()
    if not path.is_absolute():
        path = (base_dir / path).resolve()
    return str(path)


def looks_like_hub_id(p: str) -> bool:
    return bool(HUB_ID.match(p)) and not p.startswith((".", "/", "~"))


def _resolve_paths(cfg: JobConfig, base_dir: Path) -> None:
    mp = cfg.model.path
    if not mp.startswith(BUILTIN_PREFIX):
        local = Path(_resolve(mp, base_dir))
        if local.exists() or not looks_like_hub_id(mp):
            cfg.model.path = str(local)
    cfg.data.path = _resolve(cfg.data.path, base_dir)
    if cfg.data.masks is not None and cfg.data.masks.path is not None:
        cfg.data.masks.path = _resolve(cfg.data.masks.path, base_dir)
    if cfg.data.regularisation is not None:
        cfg.data.regularisation.path = _resolve(cfg.data.regularisation.path, base_dir)
    if cfg.data.validation is not None and cfg.data.validation.path is not None:
        cfg.data.validation.path = _resolve(cfg.data.validation.path, base_dir)


def _check_paths(cfg: JobConfig) -> None:
    mp = cfg.model.path
    if mp.startswith(BUILTIN_PREFIX):
        name = mp[len(BUILTIN_PREFIX):]
        if name not in BUILTIN_MODELS:
            raise JobInvalid(f"model.path: unknown built-in model {name!r} (available: {', '.join(BUILTIN_MODELS)})")
    elif Path(mp).is_absolute():
        if not Path(mp).exists():
            raise JobInvalid(f"model.path: {mp} does not exist (give a local model directory or a hub id like org/name)")
        if not Path(mp).is_dir():
            raise JobInvalid(f"model.path: {mp} is not a directory")
    dp = Path(cfg.data.path)
    if not dp.exists():
        raise JobInvalid(f"data.path: {dp} does not exist")
    val_path = Path(cfg.data.validation.path) if cfg.data.validation and cfg.data.validation.path else None
    if val_path is not None and not val_path.exists():
        raise JobInvalid(f"data.validation.path: {val_path} does not exist")
    if cfg.model.family == "causal_lm":
        from engine.data.text import check_text_source

        if Path(mp).is_absolute() and not (Path(mp) / "config.json").is_file():
            raise JobInvalid(f"model.path: {mp} holds no transformers model (no config.json)")
        check_text_source(dp, cfg.data.text_field, cfg.data.train_on)
        if val_path is not None:
            check_text_source(val_path, cfg.data.text_field, cfg.data.train_on, key="data.validation.path")
    elif cfg.model.family in IMAGE_FAMILIES:
        from engine.data.images import check_image_folder

        if Path(mp).is_absolute() and not (Path(mp) / "transformer" / "config.json").is_file():
            what = {"flux": "FLUX.1", "flux2": "FLUX.2", "qwen_image": "Qwen-Image"}[cfg.model.family]
            raise JobInvalid(f"model.path: {mp} is not a {what} diffusers directory (no transformer/config.json)")
        check_image_folder(dp)
        if cfg.data.masks is not None and cfg.data.masks.path is not None and not Path(cfg.data.masks.path).is_dir():
            raise JobInvalid(f"data.masks.path: {cfg.data.masks.path} is not a folder of masks")
        if cfg.data.regularisation is not None:
            check_image_folder(Path(cfg.data.regularisation.path), key="data.regularisation.path")
        if val_path is not None:
            check_image_folder(val_path, key="data.validation.path")


def load_yaml_text(text: str, source: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise JobInvalid(f"{source}: not valid YAML{where}: {problem}") from None


def decode_job_bytes(data: bytes, display: str) -> str:
    """A job file's text; binary or non-UTF-8 content is refused in the same words wherever a job is read."""
    if b"\x00" in data:
        raise JobInvalid(f"{display}: job file is binary (contains NUL bytes), not YAML text")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise JobInvalid(f"{display}: job file is not UTF-8 text") from None


def load_job(path: str | Path, check_paths: bool = True, policy: JobPolicy | None = None) -> JobConfig:
    """Read, size-check, safely parse and validate a job file; with a policy (a daemon's trainer), check it first."""
    path = Path(path)
    try:
        size = path.stat().st_size
    except OSError as e:
        raise JobInvalid(f"{path}: cannot read the job file: {e.strerror}") from None
    if size > MAX_JOB_FILE_BYTES:
        raise JobInvalid(f"{path}: job file is {size} bytes, larger than the {MAX_JOB_FILE_BYTES}-byte limit")
    text = decode_job_bytes(path.read_bytes(), path.name)
    raw = load_yaml_text(text, str(path.name))
    if policy is not None and isinstance(raw, dict):
        policy.check(raw, path.parent.resolve())
    return parse_job(raw, path.parent.resolve(), source=path.name, check_paths=check_paths)


def dump_job(cfg: JobConfig) -> str:
    """The normalised job (absolute paths, defaults filled in) as YAML; load_job reads it back unchanged."""
    d = cfg.model_dump(mode="json")
    # The other family's keys stay out: they only hold defaults here, and written out they would
    # be refused by _family_keys_check when the trainer reads jobs/ID/job.yaml back.
    if cfg.model.family == "causal_lm":
        for k in IMAGE_DATA_KEYS:
            d["data"].pop(k, None)
        for k in FLUX_TRAIN_KEYS:
            d["train"].pop(k, None)
        d.pop("sample", None)
    else:
        for k in TEXT_DATA_KEYS:
            d["data"].pop(k, None)
        for k in LM_TRAIN_KEYS:
            d["train"].pop(k, None)
    return yaml.safe_dump(d, sort_keys=False)
