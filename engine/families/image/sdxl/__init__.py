"""sdxl: Stable Diffusion XL LoRA, epsilon or v-prediction (training code: family.py; its files: export.py)."""

from __future__ import annotations

from engine.registry.facts import Facts, Offline, training_code

FAMILY = Facts(
    name="sdxl", display="SDXL", kind="image", joined=10,
    trainer="engine.families.image.sdxl.family:SDXL",
    adapter_types=("lora", "dora", "lokr", "loha"),  # dora in the diffusers file, lokr/loha in kohya's (export.py)
    spatial_multiple=8,  # 8x VAE; the UNet pads any latent size its down/up samplers meet
    offline=(Offline("tiny-sdxl", "An SDXL-shaped pipeline (a two-level UNet with size/crop conditioning, tiny VAE, "
                     "two CLIP text encoders) with random weights.", "engine.builtin.tiny_sdxl:build_tiny_sdxl"),),
    export_keys="engine.families.image.sdxl.export:kohya_key",
    denoiser="unet",
    single_file="engine.families.image.sdxl.single_file:check_file",  # a fine-tune's one file as model.path
)

__getattr__ = training_code(__name__)
