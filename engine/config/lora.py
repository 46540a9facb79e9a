"""lora: the adapter trained (engine/training/adapters.py)."""

from __future__ import annotations

import re
from typing import Literal, Union

from pydantic import Field, field_validator, model_validator

from engine.config.declare import Strict, key


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
    # A list of module-name suffixes, or one regular expression matched against the full module path.
    # None (the default) means the family's own default list (engine/families/*.py: DEFAULT_TARGETS).
    targets: Union[list[str], str, None] = None
    # sdxl: LoRA on both CLIP text encoders too (their attention and MLP linears), trained with the UNet; captions
    # are then tokenised, not encoded, before training (engine/families/image/sdxl/text.py)
    text_encoder: bool = key(False, families=("sdxl",), dump_default=False)
    # sdxl, with text_encoder: the encoders' learning rate (kohya's text_encoder_lr); unset = train.lr. It follows
    # train.schedule as a fixed multiple of train.lr (engine/training/optim.py: LR_SCALE)
    text_encoder_lr: float | None = key(None, families=("sdxl",), dump_default=False, gt=0, le=1.0)

    @model_validator(mode="after")
    def _text_encoder_lr(self):
        if self.text_encoder_lr is not None and not self.text_encoder:
            raise ValueError("lora.text_encoder_lr: only with lora.text_encoder: true")
        return self

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
