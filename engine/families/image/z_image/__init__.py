"""z_image: Z-Image (Turbo and Base) LoRA (training code: family.py)."""

from __future__ import annotations

from engine.registry.facts import Facts, Offline, training_code

FAMILY = Facts(
    name="z_image", display="Z-Image", kind="image", joined=4,
    trainer="engine.families.image.z_image.family:ZImage",
    adapter_types=("lora", "dora", "lokr", "loha"),
    spatial_multiple=16,  # 8x VAE, 2x2 patches
    offline=(Offline("tiny-z-image", "A Z-Image-shaped pipeline (4 layers + 2 refiner blocks, tiny FLUX.1-style "
                     "VAE, Qwen3) with random weights.", "engine.builtin.tiny_z_image:build_tiny_z_image"),),
    export_keys="engine.families.image.export:diffusion_model_comfyui_file",
)

__getattr__ = training_code(__name__)
