"""flux3: FLUX.3 (and FLUX.3 distilled) LoRA, a modular diffusers pipeline (training code: family.py)."""

from __future__ import annotations

from engine.registry.facts import Facts, Offline, training_code

FAMILY = Facts(
    name="flux3", display="FLUX.3", kind="image", joined=6,
    trainer="engine.families.image.flux3.family:Flux3",
    adapter_types=("lora", "dora", "lokr", "loha"),
    spatial_multiple=16,  # 8x VAE, 2x2 patches
    offline=(Offline("tiny-flux3", "A FLUX.3-shaped modular pipeline (1 block per mode + 4 single blocks, tiny "
                     "FLUX.2 VAE, Qwen3-VL) with random weights.", "engine.builtin.tiny_flux3:build_tiny_flux3",
                     marker="modular_model_index.json"),),
    comfyui_checked=False,
    export_keys="engine.families.image.flux3.family:bfl_name",
)

__getattr__ = training_code(__name__)
