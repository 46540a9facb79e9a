"""ltx2: LTX-2 (Lightricks' joint audio-video model) video LoRA, with the audio branch trained on clips that have
sound (training code: family.py, train.py; data.py, audio.py and sample.py its cache, sound and sample clips)."""

from __future__ import annotations

from engine.registry.facts import Facts, Offline, training_code

FAMILY = Facts(
    name="ltx2", display="LTX-2", kind="video", joined=14,
    trainer="engine.families.video.ltx2.family:LTX2",
    spatial_multiple=32,  # 32x VAE, patch 1
    temporal=8,  # 8x temporal VAE: windows of 8k + 1 frames
    offline=(Offline("tiny-ltx2", "An LTX-2-shaped audio-video pipeline (2 blocks, tiny 8x video VAE, audio VAE "
                     "and vocoder, Gemma 3, text connectors) with random weights.",
                     "engine.builtin.tiny_ltx2:build_tiny_ltx2", spatial_multiple=8),),
    export_keys="engine.families.video.ltx2.family:comfyui_name",
)

__getattr__ = training_code(__name__)
