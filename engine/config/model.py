"""model: the base model a job trains a LoRA on."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from engine.config.declare import FAMILIES, Strict, key


class ModelConfig(Strict):
    family: Literal[FAMILIES] = "causal_lm"  # every family package's name (engine/registry/families.py)
    path: str = Field(description="local directory, hub id (org/name) or builtin:NAME")
    revision: str | None = None
    dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    # Deprecated: the older spelling of base_precision: nf4. Kept as written (not rewritten into base_precision)
    # because the identity hash covers the keys as written: checkpoints of old job files must still resume.
    quantize: Literal["nf4"] | None = None
    base_precision: Literal["auto", "bf16", "fp8", "nf4", "int8"] = "auto"
    trust_remote_code: bool = False
    # wan: which of Wan 2.2 A14B's experts trains (transformer = high noise, transformer_2 = low noise), or both, one
    # LoRA each (engine/families/video/experts.py); unset for a one-transformer model (TI2V-5B).
    expert: Literal["high", "low", "both"] | None = key(None, families=("wan",))
    # wan: t2v, or i2v by first-frame conditioning (TI2V-5B's: the first latent frame stays clean); unset = t2v
    task: Literal["t2v", "i2v"] | None = key(None, families=("wan",))

    @property
    def effective_base_precision(self) -> str:
        """base_precision, with the deprecated quantize: nf4 mapped onto it: what the families load."""
        return "nf4" if self.quantize == "nf4" else self.base_precision
