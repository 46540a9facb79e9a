"""model: the base model a job trains a LoRA on."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from engine.config.declare import FAMILIES, IMAGE_FAMILIES, Strict, key

# The image families whose trainer merges model.assistant_lora (engine/families/image/assistant.py): their
# pipelines' LoRA loaders read it into the transformer alone.
ASSISTANT_FAMILIES = ("flux2", "qwen_image", "z_image", "krea2", "qwen_image_21")


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
    # An assistant ("training adapter") LoRA for a distilled base, merged into the frozen base at load and left
    # out of every export: a .safetensors file, a folder holding pytorch_lora_weights.safetensors, or a hub id
    # (read at assistant_lora_revision). A local file's sha256 is part of the job's identity (schema.py).
    assistant_lora: str | None = key(None, families=IMAGE_FAMILIES, read_by=ASSISTANT_FAMILIES, dump_default=False,
                                     min_length=1, max_length=4096)
    assistant_lora_revision: str | None = key(None, families=IMAGE_FAMILIES, read_by=ASSISTANT_FAMILIES,
                                              dump_default=False, max_length=200)
    # sdxl: what the UNet predicts: epsilon (the noise), or v with the zero-terminal-SNR schedule (v-pred fine-tunes);
    # unset = the base's scheduler config's prediction_type (engine/families/image/sdxl/family.py)
    prediction: Literal["epsilon", "v"] | None = key(None, families=("sdxl",), dump_default=False)
    # sdxl: the diffusers config (a local diffusers directory or hub id) of a single-file checkpoint as model.path;
    # unset = the one diffusers infers from the file (from the hub) (engine/families/image/sdxl/single_file.py)
    single_file_config: str | None = key(None, families=("sdxl",), dump_default=False, min_length=1,
                                         max_length=4096)

    @model_validator(mode="after")
    def _assistant_before_quantisation(self):
        # bitsandbytes quantises while it reads the files: there is no full-precision base to merge into.
        if self.assistant_lora is not None and self.effective_base_precision in ("nf4", "int8"):
            raise ValueError("model.assistant_lora: cannot be merged into a base that bitsandbytes quantises "
                             f"while loading (base_precision: {self.effective_base_precision}); use fp8 or bf16")
        return self

    @property
    def effective_base_precision(self) -> str:
        """base_precision, with the deprecated quantize: nf4 mapped onto it: what the families load."""
        return "nf4" if self.quantize == "nf4" else self.base_precision
