"""qwen_image_21: Qwen-Image 2.1 LoRA (training code: family.py). A new model, not a Qwen-Image checkpoint: its own
transformer, VAE and text encoder (docs/families/qwen-image-21.md)."""

from __future__ import annotations

from engine.registry.facts import Facts, Offline, training_code

FAMILY = Facts(
    name="qwen_image_21", display="Qwen-Image 2.1", kind="image", joined=11,
    trainer="engine.families.image.qwen_image_21.family:QwenImage21",
    adapter_types=("lora", "dora", "lokr", "loha"),
    spatial_multiple=32,  # 16x VAE; the transformer takes latents unpatched but 2x2 of them per vision-encoder slot
    offline=(Offline("tiny-qwen-image-21", "A Qwen-Image-2.1-shaped pipeline (4 single-stream blocks, tiny 16x RGBA "
                     "VAE, Qwen3-VL) with random weights.",
                     "engine.builtin.tiny_qwen_image_21:build_tiny_qwen_image_21", pipeline="QwenImage21Pipeline"),),
    export_keys="engine.families.image.qwen_image_21.family:comfyui_target",
)

__getattr__ = training_code(__name__)
