"""flux2: FLUX.2 (dev, and klein 4B/9B) LoRA, edit by references (training code: family.py)."""

from __future__ import annotations

from engine.registry.facts import Facts, Offline, training_code

FAMILY = Facts(
    name="flux2", display="FLUX.2", kind="image", joined=2, edits=True,
    trainer="engine.families.image.flux2.family:Flux2",
    adapter_types=("lora", "dora"),
    why_not_others="ComfyUI's FLUX.2 model fuses q, k and v (and the single blocks' q, k, v and MLP input) into one "
                   "linear and maps FLUX.2 LoRA keys by those fused BFL names only; a LoKr or LoHa update of each "
                   "part is no LyCORIS update of the fused weight, and diffusers' load_lora_weights reads neither",
    spatial_multiple=16,  # 8x VAE, 2x2 patches
    offline=(Offline("tiny-flux2", "A FLUX.2-klein-shaped pipeline (2 double + 2 single blocks, tiny VAE, Qwen3) "
                     "with random weights.", "engine.builtin.tiny_pipelines:build_tiny_flux2",
                     pipeline="Flux2KleinPipeline"),),
    export_keys="engine.families.image.flux2.family:bfl_target",
)

__getattr__ = training_code(__name__)
