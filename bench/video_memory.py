"""Memory arithmetic (not a measurement) for the video families at their published shapes: Wan 2.2 T2V-A14B (one
expert; the two are the same shape), Wan 2.2 TI2V-5B and HunyuanVideo 1.5.

    .venv/bin/python bench/video_memory.py

Builds each transformer on the `meta` device (no weights, no download) with the published configs as written
below (Wan: the Diffusers repos' transformer/config.json values; HunyuanVideo 1.5: diffusers' class defaults) and
prints, as bench/image_memory.py does for the image families, parameters and weight bytes in bf16 and fp8, the
per-block sizes that decide `train.blocks_to_swap`, and the LoRA parameters and bytes per unit of rank. Then, for
one clip window at a job's size, the tokens the transformer sees and the bytes gradient checkpointing keeps per
block (its input, bf16), and the resident sum for the example 24 GB jobs in configs/examples/: the non-swapped
blocks' fp8 weights, every block's checkpointed input, one block's recompute (the FFN's hidden activations twice
and q, k, v, out: the largest live set inside a block), and the LoRA state. The CUDA context, the allocator's
slack, the VAE and text encoders (freed after caching) and the attention kernel's workspace are not in these
numbers: only a run on the card can measure them.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from image_memory import BYTES_PER_LORA_PARAM, GB, _fp8_bytes, _linears, report  # noqa: E402

WAN_A14B = dict(num_attention_heads=40, attention_head_dim=128, in_channels=16, out_channels=16, text_dim=4096,
                freq_dim=256, ffn_dim=13824, num_layers=40)
WAN_5B = dict(num_attention_heads=24, attention_head_dim=128, in_channels=48, out_channels=48, text_dim=4096,
              freq_dim=256, ffn_dim=14336, num_layers=30)
# The example 24 GB jobs (configs/examples/): model, VAE spatial factor, patch, width x height x frames, blocks swapped,
# experts on the card (A14B's `expert: both` would hold two transformers; it takes no block swapping yet), lora rank
# and lora.dtype.
JOBS = [dict(label="Wan 2.2 T2V-A14B, expert: high (low alike), 480p x 81, fp8, 36 of 40 blocks swapped, rank 16 bf16",
             key="a14b", spatial=8, patch=2, size=(832, 480, 81), swapped=36, experts=1, rank=16, dtype="bfloat16"),
        dict(label="Wan 2.2 TI2V-5B, 720p x 121 (1280x704), fp8, no block swapping, rank 32",
             key="5b", spatial=16, patch=2, size=(1280, 704, 121), swapped=0, experts=1, rank=32, dtype="float32"),
        dict(label="HunyuanVideo 1.5, 480p x 121 (848x480), fp8, 40 of 54 blocks swapped, rank 32",
             key="hv", spatial=16, patch=1, size=(848, 480, 121), swapped=40, experts=1, rank=32, dtype="float32")]


def job_arithmetic(job: dict, model, targets: str, skip: str, blocks, hidden: int, ffn: int) -> float:
    """The resident sum of one example job (module docstring), printed; in bytes."""
    import re

    width, height, frames = job["size"]
    n_tokens = ((frames - 1) // 4 + 1) * (height // job["spatial"] // job["patch"]) * (width // job["spatial"] //
                                                                                       job["patch"])
    per_block_fp8 = _fp8_bytes(blocks[0], skip)
    kept = len(blocks) - job["swapped"]
    resident = job["experts"] * (_fp8_bytes(model, skip) - job["swapped"] * per_block_fp8)
    ckpt = n_tokens * hidden * 2  # one block's input, bf16; one expert runs per sample
    recompute = n_tokens * (2 * ffn + 4 * hidden) * 2
    per_rank = sum(m.in_features + m.out_features for n, m in _linears(model).items() if re.search(targets, n))
    lora = job["experts"] * per_rank * job["rank"] * BYTES_PER_LORA_PARAM[job["dtype"]]
    total = resident + len(blocks) * ckpt + recompute + lora
    print(f"## {job['label']} (arithmetic)")
    print(f"tokens per window: {n_tokens}; checkpointed input per block {ckpt / GB:.3f} GB, all {len(blocks)} "
          f"blocks {len(blocks) * ckpt / GB:.2f} GB")
    print(f"resident fp8 weights {resident / GB:.2f} GB ({kept} blocks per expert on the card; "
          f"{job['experts'] * job['swapped'] * per_block_fp8 / GB:.2f} GB in host memory), one block's recompute "
          f"{recompute / GB:.2f} GB, LoRA state {lora / GB:.2f} GB")
    print(f"sum: {total / GB:.1f} GB of a 24 GB card before the context, allocator slack and kernel workspace\n")
    return total


def main() -> None:
    from diffusers import HunyuanVideo15Transformer3DModel, WanTransformer3DModel

    from engine.families.video import hunyuan_video, wan

    with torch.device("meta"):
        models = {"a14b": WanTransformer3DModel(**WAN_A14B), "5b": WanTransformer3DModel(**WAN_5B),
                  "hv": HunyuanVideo15Transformer3DModel()}
    report("Wan 2.2 T2V-A14B transformer (each of the two experts)", models["a14b"], wan.DEFAULT_TARGETS,
           wan.FP8_SKIP, ["blocks"])
    report("Wan 2.2 TI2V-5B transformer", models["5b"], wan.DEFAULT_TARGETS, wan.FP8_SKIP, ["blocks"])
    report("HunyuanVideo 1.5 transformer", models["hv"], hunyuan_video.DEFAULT_TARGETS, hunyuan_video.FP8_SKIP,
           ["transformer_blocks"])
    for job in JOBS:
        m = models[job["key"]]
        fam = hunyuan_video if job["key"] == "hv" else wan
        blocks = m.transformer_blocks if job["key"] == "hv" else m.blocks
        hidden = m.config.num_attention_heads * m.config.attention_head_dim
        ffn = int(hidden * m.config.mlp_ratio) if job["key"] == "hv" else m.config.ffn_dim
        job_arithmetic(job, m, fam.DEFAULT_TARGETS, fam.FP8_SKIP, blocks, hidden, ffn)


if __name__ == "__main__":
    main()
