"""chroma: Chroma (Chroma1-HD and its flash variants) LoRA (training code: family.py)."""

from __future__ import annotations

from engine.registry.facts import Facts, Offline, training_code

FAMILY = Facts(
    name="chroma", display="Chroma", kind="image", joined=5,
    trainer="engine.families.image.chroma.family:Chroma",
    adapter_types=("lora", "dora", "lokr", "loha"),
    spatial_multiple=16,  # 8x VAE, 2x2 packed patches
    offline=(Offline("tiny-chroma", "A Chroma-shaped pipeline (2 double + 2 single blocks, approximator, tiny VAE, "
                     "T5) with random weights.", "engine.builtin.tiny_chroma:build_tiny_chroma"),),
    export_keys="engine.families.image.flux_export:export",
)

__getattr__ = training_code(__name__)
