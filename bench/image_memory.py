"""Memory arithmetic (not a measurement) for the FLUX.2, Qwen-Image, Z-Image, Chroma, FLUX.3, Krea 2, Qwen-Image 2.1
and HiDream-I1 families at their published shapes.

    .venv/bin/python bench/image_memory.py

Builds each transformer on the `meta` device (no weights, no download) with
diffusers' class defaults — FLUX.2-dev's transformer config (8 double + 48
single blocks, 48 heads × 128), Qwen-Image's (60 blocks, 24 heads × 128) and
Z-Image's (30 layers + 2 + 2 refiner blocks, 3840 wide; Turbo and Base share it),
Chroma1-HD's (19 double + 38 single blocks, 24 heads × 128, the approximator),
FLUX.3's (5 per-mode blocks for each of image, reference image and text, 28 joint single blocks, 24 heads × 128;
the distilled flow map adds one timestep embedder), and Krea 2's (28 single-stream
blocks, 48 query heads × 128 over 12 key/value heads, the 2 + 2 text-fusion blocks; the class defaults are
ComfyUI's SingleStreamDiT defaults, base and Turbo alike), and Qwen-Image 2.1's (32 single-stream blocks, 32 heads ×
128, SwiGLU × 3, 64 latent channels),
and HiDream-I1's (16 double + 32 single blocks, 20 heads ×
128, 4 routed + 1 shared expert per block; the text widths set to T5-XXL's and Llama 3.1 8B's 4096) —
and prints: parameters and weight bytes in bf16 and fp8 (e4m3, 1 byte, plus
one fp32 scale per output channel), the per-block sizes that decide
`train.blocks_to_swap`, and the LoRA parameters of the family's default
targets per unit of rank, with the bytes one rank costs for the adapter
weights and gradients — in fp32 (`lora.dtype: float32`, the default) or bf16
— and 8-bit AdamW (two 1-byte states plus one fp32 absmax per 256 values
each). Activations, the CUDA context and the
allocator's slack are not in these numbers: a real run needs headroom
beyond them, which only a measurement on the card can give.
"""

from __future__ import annotations

import re

import torch

GB = 1e9
# weight + grad in lora.dtype, and AdamW8bit's two 1-byte states with their per-256 fp32 absmax
ADAM8BIT_BYTES = 2 * (1 + 4 / 256)
BYTES_PER_LORA_PARAM = {"float32": 4 + 4 + ADAM8BIT_BYTES, "bfloat16": 2 + 2 + ADAM8BIT_BYTES}


def _linears(model: torch.nn.Module) -> dict[str, torch.nn.Linear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


def _fp8_bytes(model: torch.nn.Module, skip: str) -> int:
    """Linears outside `skip` in fp8 with an fp32 scale per output channel; everything else stays bf16."""
    skip_re = re.compile(skip)
    total = 0
    for name, p in model.named_parameters():
        mod_name = name.rpartition(".")[0]  # "" (the model itself) for a top-level parameter (Z-Image's pad tokens)
        mod = model.get_submodule(mod_name)
        if isinstance(mod, torch.nn.Linear) and name.endswith(".weight") and not skip_re.search(mod_name):
            total += p.numel() + 4 * p.shape[0]
        else:
            total += 2 * p.numel()
    return total


def report(label: str, model: torch.nn.Module, targets: str, skip: str, block_lists: list[str]) -> None:
    n = sum(p.numel() for p in model.parameters())
    print(f"## {label}")
    print(f"parameters: {n / 1e9:.2f} B; weights bf16 {2 * n / GB:.1f} GB, fp8 {_fp8_bytes(model, skip) / GB:.1f} GB")
    for attr in block_lists:
        blocks = getattr(model, attr)
        per = sum(p.numel() for p in blocks[0].parameters())
        print(f"{attr}: {len(blocks)} blocks of {per / 1e6:.0f} M params: {2 * per / GB:.3f} GB bf16 each")
    rx = re.compile(targets)
    per_rank = sum(m.in_features + m.out_features for name, m in _linears(model).items() if rx.search(name))
    fp32, bf16 = BYTES_PER_LORA_PARAM["float32"], BYTES_PER_LORA_PARAM["bfloat16"]
    print(f"LoRA (default targets): {per_rank} params per unit of rank; adapter + grads + AdamW8bit per rank: "
          f"{per_rank * fp32 / 1e6:.1f} MB (lora.dtype float32), {per_rank * bf16 / 1e6:.1f} MB (bfloat16)")
    for r in (16, 128, 512, 1024):
        print(f"  rank {r:4d}: {per_rank * r / 1e6:8.1f} M params, {per_rank * r * fp32 / GB:6.2f} GB float32, "
              f"{per_rank * r * bf16 / GB:6.2f} GB bfloat16")
    print()


def main() -> None:
    from diffusers import (
        ChromaTransformer2DModel,
        Flux2Transformer2DModel,
        Flux3Transformer2DModel,
        HiDreamImageTransformer2DModel,
        Krea2Transformer2DModel,
        QwenImage21Transformer2DModel,
        QwenImageTransformer2DModel,
        ZImageTransformer2DModel,
    )

    from engine.families.image import chroma, flux2, flux3, hidream, krea2, qwen_image, qwen_image_21, z_image

    with torch.device("meta"):
        f2 = Flux2Transformer2DModel()
        qi = QwenImageTransformer2DModel()
        zi = ZImageTransformer2DModel()
        ch = ChromaTransformer2DModel()
        f3 = Flux3Transformer2DModel(flow_map=True)  # the distilled one: FLUX.3's plus its target-time embedder
        k2 = Krea2Transformer2DModel()
        q21 = QwenImage21Transformer2DModel()
        # HiDream-I1: the class defaults (16 + 32 blocks, 20 heads x 128, 4 experts) with the text widths the class
        # leaves unset (T5-XXL and Llama 3.1 8B: 4096; one Llama layer index per block)
        hd = HiDreamImageTransformer2DModel(patch_size=2, in_channels=16, caption_channels=[4096, 4096],
                                            axes_dims_rope=(64, 32, 32), llama_layers=[0] * 48)
    report("FLUX.2-dev transformer", f2, flux2.DEFAULT_TARGETS, flux2.FP8_SKIP,
           ["transformer_blocks", "single_transformer_blocks"])
    report("Qwen-Image transformer", qi, qwen_image.DEFAULT_TARGETS, qwen_image.FP8_SKIP, ["transformer_blocks"])
    report("Z-Image transformer", zi, z_image.DEFAULT_TARGETS, z_image.FP8_SKIP,
           ["layers", "noise_refiner", "context_refiner"])
    report("Chroma1-HD transformer", ch, chroma.DEFAULT_TARGETS, chroma.FP8_SKIP,
           ["transformer_blocks", "single_transformer_blocks"])
    report("FLUX.3 (distilled) transformer", f3, flux3.DEFAULT_TARGETS, flux3.FP8_SKIP,
           ["txt_mode_blocks", "single_transformer_blocks"])
    report("Krea 2 transformer (base and Turbo)", k2, krea2.DEFAULT_TARGETS, krea2.FP8_SKIP, ["transformer_blocks"])
    report("Qwen-Image 2.1 transformer", q21, qwen_image_21.DEFAULT_TARGETS, qwen_image_21.FP8_SKIP,
           ["transformer_blocks"])
    report("HiDream-I1 transformer (Full, Dev, Fast)", hd, hidream.DEFAULT_TARGETS, hidream.FP8_SKIP,
           ["double_stream_blocks", "single_stream_blocks"])


if __name__ == "__main__":
    main()
