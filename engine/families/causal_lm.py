"""Causal language models from transformers, with LoRA or QLoRA (nf4) through peft."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from engine.blockswap import place_model
from engine.config import BUILTIN_PREFIX, JobConfig, JobInvalid
from engine.data.text import TokenDataset, read_documents
from engine.precision import apply_base_precision, quantization_config
from engine.precision import resolve as resolve_precision

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# LoRA targets when lora.targets is not given: every attention and MLP projection of a Llama-like block.
DEFAULT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def resolve_model_path(cfg: JobConfig, workdir: Path) -> str:
    """A local directory or hub id as given; builtin:NAME is built once under the job's workdir."""
    p = cfg.model.path
    if p.startswith(BUILTIN_PREFIX):
        from engine.builtin_models import materialise

        return str(materialise(p[len(BUILTIN_PREFIX):], Path(workdir) / "builtin-models"))
    return p


class CausalLM:
    def __init__(self):
        self._tokenizer = None

    def prepare(self, cfg: JobConfig, workdir: Path, log) -> None:
        resolve_model_path(cfg, workdir)

    def tokenizer(self, cfg: JobConfig, workdir: Path):
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            path = resolve_model_path(cfg, workdir)
            self._tokenizer = AutoTokenizer.from_pretrained(
                path, revision=cfg.model.revision, trust_remote_code=cfg.model.trust_remote_code
            )
        return self._tokenizer

    def load_model(self, cfg: JobConfig, workdir: Path, device: torch.device, log) -> torch.nn.Module:
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        path = resolve_model_path(cfg, workdir)
        kwargs: dict[str, Any] = dict(
            revision=cfg.model.revision, trust_remote_code=cfg.model.trust_remote_code, dtype=DTYPES[cfg.model.dtype]
        )
        # model.quantize: nf4 is the older spelling of base_precision: nf4.
        choice = "nf4" if cfg.model.quantize == "nf4" else cfg.model.base_precision
        precision, _ = resolve_precision(choice, device)
        quantize = precision if precision in ("nf4", "int8") else None
        qconf = quantization_config(precision, DTYPES[cfg.model.dtype])
        if qconf is not None:
            kwargs["quantization_config"] = qconf
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
        model.config.use_cache = False
        # fp8: swap the frozen linears for FP8 layers before peft wraps them, quantising each on the device
        # as it moves there (the bf16 base never sits on the GPU whole); logs the choice either way.
        swap = cfg.train.blocks_to_swap
        apply_base_precision(model, choice, device, log, compute_dtype=DTYPES[cfg.model.dtype], blocks_to_swap=swap)
        if quantize is not None:
            from peft import prepare_model_for_kbit_training

            model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=cfg.train.gradient_checkpointing)
        elif cfg.train.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.enable_input_require_grads()
        lcfg = LoraConfig(
            r=cfg.lora.rank,
            lora_alpha=cfg.lora.alpha,
            lora_dropout=cfg.lora.dropout,
            target_modules=cfg.lora.targets if cfg.lora.targets is not None else DEFAULT_TARGETS,
            task_type="CAUSAL_LM",
        )
        try:
            # With a bf16/fp8 base the adapters stay in the model dtype (bf16 LoRA compute); peft's default
            # would upcast them to fp32. QLoRA/int8 keep peft's default.
            model = get_peft_model(model, lcfg, autocast_adapter_dtype=quantize is not None)
        except ValueError as e:
            raise JobInvalid(f"lora.targets: {e}".splitlines()[0]) from None
        if quantize is None:
            # After LoRA, so the adapters of swapped blocks (created next to their host weights) move too; the
            # swapped blocks' frozen weights stay in host memory and never reach the GPU whole.
            place_model(model, device, swap)
        return model

    def build_dataset(self, cfg: JobConfig, workdir: Path, log) -> TokenDataset:
        docs = read_documents(Path(cfg.data.path), cfg.data.text_field)
        return TokenDataset(docs, self.tokenizer(cfg, workdir), cfg.data.seq_len, cfg.data.packing)

    def loss(self, model: torch.nn.Module, batch: dict[str, Any], generator: torch.Generator) -> torch.Tensor:
        return model(**batch).loss

    def on_step_end(self, model, step, cfg, workdir, log) -> None:
        return None

    def export(self, model: torch.nn.Module, cfg: JobConfig, out_dir: Path, meta: dict[str, Any]) -> list[str]:
        model.save_pretrained(out_dir, safe_serialization=True)
        return sorted(p.name for p in Path(out_dir).iterdir())
