"""hunyuan_video: HunyuanVideo 1.5 (t2v) video LoRA (training code: family.py)."""

from __future__ import annotations

from engine.registry.facts import Facts, Offline, training_code

FAMILY = Facts(
    name="hunyuan_video", display="HunyuanVideo 1.5", kind="video", joined=9,
    trainer="engine.families.video.hunyuan_video.family:HunyuanVideo",
    spatial_multiple=16,  # 16x VAE, patch 1
    temporal=4,
    offline=(Offline("tiny-hunyuan-video15", "A HunyuanVideo-1.5-shaped t2v pipeline (2 blocks, tiny 16x VAE, "
                     "Qwen2.5-VL text model, ByT5) with random weights.",
                     "engine.builtin.tiny_hunyuan_video:build_tiny_hunyuan_video15"),),
    export_keys="engine.families.video.hunyuan_video.family:comfyui_name",
)

__getattr__ = training_code(__name__)
