"""qwen_image: Qwen-Image and Qwen-Image-Edit (and -Plus) LoRA (training code: family.py)."""

from __future__ import annotations

from engine.registry.facts import Facts, Offline, training_code

FAMILY = Facts(
    name="qwen_image", display="Qwen-Image", kind="image", joined=3, edits=True,
    trainer="engine.families.image.qwen_image.family:QwenImage",
    adapter_types=("lora", "dora", "lokr", "loha"),
    spatial_multiple=16,  # 8x VAE, 2x2 patches
    offline=(
        Offline("tiny-qwen-image", "A Qwen-Image-shaped pipeline (4 blocks, tiny video VAE, Qwen2.5-VL) with random "
                "weights.", "engine.builtin.tiny_pipelines:build_tiny_qwen_image"),
        Offline("tiny-qwen-image-edit", "A Qwen-Image-Edit-shaped pipeline (tiny-qwen-image's layout, a "
                "vision-capable processor) with random weights.",
                "engine.builtin.tiny_pipelines:build_tiny_qwen_image_edit", pipeline="QwenImageEditPipeline"),
        Offline("tiny-qwen-image-edit-plus", "tiny-qwen-image-edit as Qwen-Image-Edit-Plus (several control images "
                "per target).", "engine.builtin.tiny_pipelines:build_tiny_qwen_image_edit",
                kwargs=(("plus", True),), pipeline="QwenImageEditPlusPipeline"),
    ),
    export_keys="engine.families.image.export:diffusion_model_comfyui_file",
)

__getattr__ = training_code(__name__)
