"""ideogram4: Ideogram 4 LoRA on its conditional transformer (training code: family.py)."""

from __future__ import annotations

from engine.registry.facts import Facts, Offline, training_code

FAMILY = Facts(
    name="ideogram4", display="Ideogram 4", kind="image", joined=12,
    trainer="engine.families.image.ideogram4.family:Ideogram4",
    adapter_types=("lora", "dora"),
    why_not_others=("its checkpoint fuses q, k and v into one linear (attention.qkv), and a Kronecker or Hadamard "
                    "update of each apart is no LyCORIS update of the fused linear"),
    spatial_multiple=16,  # 8x VAE (FLUX.2's), 2x2 patches
    offline=(Offline("tiny-ideogram4", "An Ideogram-4-shaped pipeline (conditional and unconditional transformers of "
                     "4 blocks, tiny FLUX.2 VAE, a 36-layer Qwen3-VL 16 wide) with random weights.",
                     "engine.builtin.tiny_ideogram4:build_tiny_ideogram4"),),
    comfyui_checked=False,
    export_keys="engine.families.image.ideogram4.family:comfyui_name",
)

__getattr__ = training_code(__name__)
