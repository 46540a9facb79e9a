"""train: the optimisation, and what each optimizer accepts."""

from __future__ import annotations

from typing import Literal, Union

from pydantic import Field, model_validator

from engine.config.declare import IMAGE_FAMILIES, LM, STILL_FAMILIES, Strict, key


class TimestepBias(Strict):
    """image families: reweight the σ sampling density toward a band of noise levels
    (engine/families/image/timestep_bias.py)."""

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
    """Image families: differential output preservation (engine/families/image/dop.py)."""

    preservation_class: str = Field(min_length=1, max_length=200)
    weight: float = Field(1.0, gt=0.0, le=100.0)


class EmaConfig(Strict):
    """An exponential moving average of the adapter weights (engine/training/ema.py)."""

    decay: float = Field(0.999, gt=0.0, lt=1.0)
    every_steps: int = Field(1, ge=1, le=1_000_000)
    start_step: int = Field(0, ge=0)
    # also write the raw (last) weights to output/raw/: what is exported, not what is trained
    export_raw: bool = key(False, identity=False)


class TrainConfig(Strict):
    # Not identity: a job may run longer than first written.
    steps: int = key(1000, ge=1, le=10_000_000, identity=False)
    batch_size: int = Field(1, ge=1, le=4096)
    # Not identity: what decides the weights is the global batch, not how it is split (JobConfig.identity adds it);
    # a job may resume on another number of GPUs with grad_accum re-planned (engine/distributed/ddp.py).
    grad_accum: int = key(1, ge=1, le=4096, identity=False)
    # Unset with prodigy: 1.0 (engine/config/defaults.py).
    lr: float = Field(1e-4, gt=0, le=1.0)
    # Unset with adamw_schedulefree: constant (engine/config/defaults.py).
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
    # Not identity (nor compile): they trade speed for memory; a job may resume with more swapping after an OOM.
    blocks_to_swap: int = key(0, ge=0, identity=False)
    # auto: regional torch.compile on CUDA, eager on the CPU (engine/frozen_base/compiling.py).
    compile: Literal["auto"] | bool = key("auto", identity=False)
    # causal_lm only: LM head + cross-entropy in chunks, never the full logits (engine/training/chunked_loss.py).
    # auto = on from a vocabulary of engine.training.chunked_loss.AUTO_MIN_VOCAB (65,536) tokens.
    chunked_loss: Literal["auto"] | bool = key("auto", families=LM)
    # image families only. sigmoid: sigma = sigmoid(N(0,1)) (logit-normal, mid-noise heavy); linear: sigma ~ U(0,1);
    # shift: U(0,1) moved toward high noise by the resolution-dependent shift of FLUX's scheduler.
    timestep_sampling: Literal["sigmoid", "linear", "shift"] = key("sigmoid", families=IMAGE_FAMILIES)
    # the guidance value fed to FLUX.1-dev's guidance embedding while training (ignored by schnell).
    guidance: float = key(1.0, ge=0.0, le=100.0, families=IMAGE_FAMILIES)
    # emphasise high or low noise levels (engine/families/image/timestep_bias.py).
    timestep_bias: TimestepBias = key(default_factory=TimestepBias, families=IMAGE_FAMILIES)
    # keep the class (train.dop.preservation_class) as the base model draws it; needs data.trigger.
    dop: DopConfig | None = key(None, families=IMAGE_FAMILIES, read_by=STILL_FAMILIES)
    # How several processes hold the model: ddp, a whole copy each; fsdp, the base and adapter sharded over them
    # (FSDP2, engine/distributed/fsdp.py) for a base too big for one GPU.
    sharding: Literal["ddp", "fsdp"] = "ddp"


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

# With train.sharding: fsdp the parameters are sharded tensors (DTensor) on every rank; what needs a whole
# parameter on one process, or bitsandbytes' own tensor types, cannot go with it.
FSDP_OPTIMIZERS = ("adamw",)  # plain torch: its state shards with the parameters (bitsandbytes' 8-bit states do not)
