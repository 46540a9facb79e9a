"""flux: FLUX.1 (dev, schnell) and FLUX.1 Kontext edit LoRA (training code: family.py)."""

from __future__ import annotations

from engine.registry.facts import Facts, Offline, training_code

FAMILY = Facts(
    name="flux", display="FLUX.1", kind="image", joined=1, edits=True,
    trainer="engine.families.image.flux.family:Flux",
    adapter_types=("lora", "dora", "lokr", "loha"),
    spatial_multiple=16,  # 8x VAE, 2x2 packed patches
    offline=(
        Offline("tiny-flux", "A FLUX.1-shaped pipeline (1 double + 1 single block, tiny VAE, CLIP and T5) with "
                "random weights.", "engine.builtin.tiny_flux:build_tiny_flux"),
        Offline("tiny-flux-kontext", "A FLUX.1-Kontext-shaped edit pipeline (tiny-flux's layout, "
                "FluxKontextPipeline) with random weights.", "engine.builtin.tiny_flux:build_tiny_flux",
                kwargs=(("kontext", True),), pipeline="FluxKontextPipeline"),
    ),
    export_keys="engine.families.image.flux_export:export",
)

__getattr__ = training_code(__name__)
