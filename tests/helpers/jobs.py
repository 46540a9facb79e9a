"""The tiny jobs tests train: a micro causal LM built offline, the quickstart-like job over it, and its results."""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path
from typing import Any

from tests.helpers.processes import REPO

QUICKSTART_DATA = REPO / "configs" / "examples" / "data" / "quickstart.jsonl"


def build_micro_llama(dest: Path) -> Path:
    """A 2-layer, 128-wide random Llama with the built-in byte-level tokenizer.

    128 wide so that a rank-32 LoRA A matrix has 4096 elements, the size from
    which bitsandbytes keeps 8-bit optimizer state: the tests exercise real
    8-bit states, not only its 32-bit fallback for small tensors.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from engine.builtin.models import byte_level_tokenizer

    tok = byte_level_tokenizer()
    cfg = LlamaConfig(
        vocab_size=len(tok), bos_token_id=1, eos_token_id=2, pad_token_id=0,
        hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    with torch.random.fork_rng():
        torch.manual_seed(7)
        model = LlamaForCausalLM(cfg)
    model.save_pretrained(dest)
    tok.save_pretrained(dest)
    return dest


def tiny_job_dict(model_path: Path | str, data_path: Path | str) -> dict[str, Any]:
    """A quickstart-like job that trains in well under a second of compute."""
    return {
        "name": "tiny",
        "model": {"family": "causal_lm", "path": str(model_path), "dtype": "float32"},
        # dropout > 0: the RNG state must be restored for a resume to be exact.
        "lora": {"rank": 32, "alpha": 32, "dropout": 0.1, "targets": ["q_proj", "v_proj"]},
        "data": {"path": str(data_path), "text_field": "text", "seq_len": 32, "packing": True},
        "train": {
            "steps": 24, "batch_size": 2, "grad_accum": 1, "lr": 0.002, "schedule": "cosine",
            "warmup_steps": 3, "weight_decay": 0.01, "optimizer": "adamw8bit", "seed": 11, "max_grad_norm": 1.0,
        },
        "checkpoint": {"every_steps": 4, "every_seconds": None, "keep": 3},
    }


def deep_update(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_update(out[k], v)
        else:
            out[k] = v
    return out


def tiny_job(model_path: Path | str, base_dir: Path, **sections: Any):
    """The tiny job on the quickstart data, its `sections` updated (e.g. train={"steps": 2}), validated."""
    from engine.config.job import parse_job

    return parse_job(deep_update(tiny_job_dict(model_path, QUICKSTART_DATA), sections), base_dir)


def read_events(workdir: Path) -> list[dict[str, Any]]:
    path = Path(workdir) / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def adapter_bytes(workdir: Path) -> dict[str, bytes]:
    """The final adapter's tensors, by name, as raw bytes (for bit-exact comparison)."""
    import torch
    from safetensors.torch import load_file

    tensors = load_file(str(Path(workdir) / "output" / "adapter_model.safetensors"))
    return {k: v.contiguous().view(-1).view(torch.uint8).numpy().tobytes() for k, v in tensors.items()}


EXPORT_FILES = {"pytorch_lora_weights.safetensors": b"diffusers-bytes", "raw/pytorch_lora_weights.safetensors": b"raw"}


def commit_checkpoint(workdir: Path, step: int, files: dict[str, bytes] = EXPORT_FILES) -> Path:
    """checkpoints/step-N/ with export/ files and the manifest listing them (and a checkpoint file of its own)."""
    d = workdir / "checkpoints" / f"step-{step:08d}"
    every = {"state.json": b"{}", **{f"export/{n}": data for n, data in files.items()}}
    for name, data in every.items():
        (d / name).parent.mkdir(parents=True, exist_ok=True)
        (d / name).write_bytes(data)
    (d / "manifest.json").write_text(json.dumps({"format": 1, "step": step, "files": {
        n: {"size": len(b), "sha256": hashlib.sha256(b).hexdigest()} for n, b in every.items()}}))
    return d


def good_job(name: str = "good", **over) -> dict:
    """A valid micro-model job as a dict (the intake and mirror tests' starting point); `over` replaces sections."""
    d = {"name": name, "model": {"path": "builtin:tiny-llama", "dtype": "float32"},
         "data": {"path": str(QUICKSTART_DATA), "seq_len": 32}, "train": {"steps": 5}}
    d.update(over)
    return d
