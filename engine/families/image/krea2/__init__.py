"""krea2: Krea 2 (base and Turbo) LoRA (training code: family.py)."""

from __future__ import annotations

from engine.registry.facts import Facts, Offline, training_code

FAMILY = Facts(
    name="krea2", display="Krea 2", kind="image", joined=7,
    trainer="engine.families.image.krea2.family:Krea2",
    adapter_types=("lora", "dora", "lokr", "loha"),
    spatial_multiple=16,  # 8x VAE, 2x2 patches
    offline=(Offline("tiny-krea2", "A Krea-2-shaped pipeline (4 single-stream blocks + 2 + 2 text-fusion blocks, "
                     "tiny Qwen-Image VAE, Qwen3-VL) with random weights.", "engine.builtin.tiny_krea2:build_tiny_krea2"),),
    export_keys="engine.families.image.krea2.family:comfyui_name",
)

__getattr__ = training_code(__name__)
