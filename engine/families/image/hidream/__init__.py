"""hidream: HiDream-I1 (Full, Dev, Fast) LoRA (training code: family.py)."""

from __future__ import annotations

from engine.registry.facts import Facts, Offline, training_code

FAMILY = Facts(
    name="hidream", display="HiDream-I1", kind="image", joined=13,
    trainer="engine.families.image.hidream.family:HiDream",
    adapter_types=("lora", "dora", "lokr", "loha"),
    spatial_multiple=16,  # FLUX.1's 8x VAE, 2x2 patches
    offline=(Offline("tiny-hidream", "A HiDream-I1-shaped pipeline (2 double + 2 single mixture-of-experts blocks, "
                     "tiny FLUX.1-style VAE, two CLIPs, T5, Llama) with random weights.",
                     "engine.builtin.tiny_hidream:build_tiny_hidream"),),
    export_keys="engine.families.image.hidream.family:comfyui_name",
)

__getattr__ = training_code(__name__)
