"""wan: Wan 2.2 (TI2V-5B, and T2V-A14B's two experts) video LoRA (training code: family.py)."""

from __future__ import annotations

from pathlib import Path

from engine.registry.facts import Facts, Offline, read_config, training_code


def spatial_multiple(model_dir: Path) -> int:
    """The VAE's spatial factor (16 for TI2V-5B's residual VAE, 8 for A14B's) times the transformer's patch side."""
    vae = read_config(model_dir / "vae" / "config.json").get("scale_factor_spatial", 8)
    patch = read_config(model_dir / "transformer" / "config.json").get("patch_size", [1, 2, 2])
    return int(vae) * int(patch[-1] if isinstance(patch, list) else patch)


FAMILY = Facts(
    name="wan", display="Wan 2.2", kind="video", joined=8,
    trainer="engine.families.video.wan.family:Wan",
    spatial_multiple=16,  # A14B: 8x VAE, patch (1, 2, 2); TI2V-5B's 16x VAE makes it 32 (spatial_multiple above)
    spatial_rule="engine.families.video.wan:spatial_multiple",
    temporal=4,
    offline=(
        Offline("tiny-wan22-5b", "A Wan-2.2-TI2V-5B-shaped pipeline (2 blocks, tiny residual VAE, UMT5) with random "
                "weights.", "engine.builtin.tiny_video:build_tiny_wan22_5b", spatial_multiple=32),
        Offline("tiny-wan22-a14b", "A Wan-2.2-T2V-A14B-shaped pipeline (two 2-block experts split at boundary 0.875, "
                "tiny VAE, UMT5) with random weights.", "engine.builtin.tiny_video:build_tiny_wan22_a14b"),
    ),
    export_keys="engine.families.video.wan.family:comfyui_name",
)

__getattr__ = training_code(__name__)
