"""causal_lm: causal language models from transformers, LoRA or QLoRA through peft (training code: family.py)."""

from __future__ import annotations

from engine.registry.facts import Facts, Offline, training_code

FAMILY = Facts(
    name="causal_lm", display="causal language model", kind="text", joined=0,
    trainer="engine.families.causal_lm.family:CausalLM",
    adapter_types=("lora", "dora", "lokr", "loha"),  # peft writes and reads every one
    offline=(Offline("tiny-llama", "A 4-layer, 256-wide Llama with random weights and a byte-level tokenizer "
                     "(~3M parameters).", "engine.builtin.models:build_tiny_llama", marker="config.json"),),
)

__getattr__ = training_code(__name__)
