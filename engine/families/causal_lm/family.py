"""Causal language models from transformers, with LoRA or QLoRA (nf4) through peft."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from engine.builtin.models import resolve_model_path
from engine.config.job import JobConfig
from engine.data.text import TokenDataset, encode_documents, read_documents
from engine.errors import JobInvalid
from engine.frozen_base.blockswap import place_model
from engine.frozen_base.placing import placing
from engine.frozen_base.precision import apply_base_precision, quantization_config
from engine.frozen_base.precision import resolve as resolve_precision
from engine.training.adapters import check_base_precision, import_bitsandbytes, peft_config, set_adapter_dtype
from engine.training.chunked_loss import AUTO_MIN_VOCAB, chunked_cross_entropy
from engine.training.dtypes import DTYPES, torch_dtype
from engine.training.heldout import ValidationSet, holdout, to_device

# LoRA targets when lora.targets is not given: every attention and MLP projection of a Llama-like block.
DEFAULT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class CausalLM:
    def __init__(self):
        self._tokenizer = None
        self._chunked = False
        self._held_out: TokenDataset | None = None  # data.validation.fraction's samples, set by build_dataset

    def prepare(self, cfg: JobConfig, workdir: Path, log) -> None:
        resolve_model_path(cfg.model.path, workdir)

    def tokenizer(self, cfg: JobConfig, workdir: Path):
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            path = resolve_model_path(cfg.model.path, workdir)
            self._tokenizer = AutoTokenizer.from_pretrained(
                path, revision=cfg.model.revision, trust_remote_code=cfg.model.trust_remote_code
            )
        return self._tokenizer

    def load_model(self, cfg: JobConfig, workdir: Path, device: torch.device, log) -> torch.nn.Module:
        import_bitsandbytes()  # before peft and transformers' quantisers import it
        from peft import get_peft_model
        from transformers import AutoModelForCausalLM

        path = resolve_model_path(cfg.model.path, workdir)
        dtype = torch_dtype(cfg.model.dtype)
        kwargs: dict[str, Any] = dict(revision=cfg.model.revision, trust_remote_code=cfg.model.trust_remote_code, dtype=dtype)
        choice = cfg.model.effective_base_precision  # the deprecated model.quantize: nf4 included
        precision, _ = resolve_precision(choice, device)
        check_base_precision(cfg.lora, precision)
        quantize = precision if precision in ("nf4", "int8") else None
        qconf = quantization_config(precision, dtype)
        if qconf is not None:
            kwargs["quantization_config"] = qconf
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
        model.config.use_cache = False
        # fp8: swap the frozen linears for FP8 layers before peft wraps them, quantising each on the device
        # as it moves there (the bf16 base never sits on the GPU whole); logs the choice either way.
        swap = cfg.train.blocks_to_swap
        with placing(model, swap):  # an out-of-memory here: the daemon swaps more blocks and loads again
            apply_base_precision(model, choice, device, log, compute_dtype=dtype, blocks_to_swap=swap)
            if quantize is not None:
                from peft import prepare_model_for_kbit_training

                model = prepare_model_for_kbit_training(
                    model, use_gradient_checkpointing=cfg.train.gradient_checkpointing)
            elif cfg.train.gradient_checkpointing:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
                model.enable_input_require_grads()
            targets = cfg.lora.targets if cfg.lora.targets is not None else DEFAULT_TARGETS
            lcfg = peft_config(cfg.lora, targets, task_type="CAUSAL_LM")
            try:
                model = get_peft_model(model, lcfg, autocast_adapter_dtype=False)
            except ValueError as e:
                raise JobInvalid(f"lora.targets: {e}".splitlines()[0]) from None
            set_adapter_dtype(model, cfg.lora.dtype)  # fp32 by default over any base (engine/training/adapters.py)
            self._chunked = use_chunked_loss(model, cfg, log)
            if quantize is None:
                # After LoRA, so the adapters of swapped blocks (created next to their host weights) move too; the
                # swapped blocks' frozen weights stay in host memory and never reach the GPU whole.
                place_model(model, device, swap)
        return model

    def _token_dataset(self, cfg: JobConfig, workdir: Path, path: Path, log, what: str) -> TokenDataset:
        tok = self.tokenizer(cfg, workdir)
        docs = read_documents(path, cfg.data.text_field)
        chat = bool(docs) and isinstance(docs[0], list)
        if cfg.data.train_on == "completions" and not chat:  # check_text_source says so at load time too
            raise JobInvalid("data.train_on: completions needs chat data (.jsonl lines with 'messages')")
        encoded = encode_documents(docs, tok, cfg.data.train_on, log)
        pad = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
        dataset = TokenDataset(encoded, pad, cfg.data.seq_len, cfg.data.packing)
        log.info(what, documents=len(docs), format="chat" if chat else "text", samples=len(dataset),
                 train_on=cfg.data.train_on or ("completions" if chat else "all"))
        return dataset

    def build_dataset(self, cfg: JobConfig, workdir: Path, log) -> TokenDataset:
        dataset = self._token_dataset(cfg, workdir, Path(cfg.data.path), log, "dataset")
        val = cfg.data.validation
        if val is not None and val.fraction is not None:
            train, held = holdout(len(dataset), val.fraction, cfg.train.seed)
            self._held_out = dataset.subset(held)
            dataset = dataset.subset(train)
            log.info("validation_holdout", held_out=len(held), samples=len(train))
        return dataset

    def validation_set(self, cfg: JobConfig, workdir: Path, log) -> ValidationSet:
        val = cfg.data.validation
        data = self._held_out if val.path is None else self._token_dataset(cfg, workdir, Path(val.path), log,
                                                                            "validation_dataset")
        return ValidationSet(data, list(range(len(data))))

    def validation_loss(self, model, dataset: TokenDataset, indices: list[int], seed: int, device) -> torch.Tensor:
        return self.loss(model, to_device(dataset.collate(indices), device), None)  # eval mode: no dropout to draw

    def loss(self, model: torch.nn.Module, batch: dict[str, Any], generator: torch.Generator) -> torch.Tensor:
        if not self._chunked:
            # No KV cache: with one, transformers would not read packed documents from the position ids.
            return model(**batch, use_cache=False).loss
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        hidden = base.get_decoder()(**inputs, use_cache=False)[0]
        return chunked_cross_entropy(hidden, base.get_output_embeddings().weight, batch["labels"])

    def on_step_end(self, model, step, cfg, workdir, log) -> None:
        return None

    def export(self, model: torch.nn.Module, cfg: JobConfig, out_dir: Path, meta: dict[str, Any]) -> list[str]:
        model.save_pretrained(out_dir, safe_serialization=True)
        return sorted(p.name for p in Path(out_dir).iterdir())


def _chunk_blocker(base: torch.nn.Module) -> str | None:
    """Why this model's LM head cannot go through engine.training.chunked_loss (which reads its weight directly), or None."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    head = base.get_output_embeddings()
    if isinstance(head, BaseTunerLayer):  # any lora.type (LoRA, DoRA, LoKr, LoHa) wraps the module in one
        return "lm_head carries a LoRA adapter (lora.targets matches lm_head)"
    if not isinstance(getattr(head, "weight", None), torch.Tensor) or head.weight.dtype not in DTYPES.values():
        return f"its LM head is a {type(head).__name__} with no plain weight"
    if getattr(head, "bias", None) is not None:
        return "its LM head has a bias"
    conf = base.config
    for key in ("final_logit_softcapping", "logit_scale", "output_multiplier_scale"):
        if getattr(conf, key, None) not in (None, 1, 1.0):
            return f"the model transforms its logits ({key}={getattr(conf, key)})"
    return None


def use_chunked_loss(model: torch.nn.Module, cfg: JobConfig, log) -> bool:
    """train.chunked_loss resolved for this model: true refuses what it cannot do, auto falls back and says so."""
    choice = cfg.train.chunked_loss
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    vocab = base.get_output_embeddings().weight.shape[0]
    if choice is False or (choice == "auto" and vocab < AUTO_MIN_VOCAB):
        return False
    why = _chunk_blocker(base)
    if why is not None:
        if choice is True:
            raise JobInvalid(f"train.chunked_loss: cannot be used here: {why}; set train.chunked_loss: false"
                             + (" or drop lm_head from lora.targets" if "lora" in why.lower() else ""))
        log.warning("chunked_loss_off", reason=why, vocab=vocab,
                    message=f"train.chunked_loss: auto stays off: {why}; the full logits are built")
        return False
    log.info("chunked_loss", vocab=vocab, message="LM head and cross-entropy run in chunks (no full logits)")
    return True
