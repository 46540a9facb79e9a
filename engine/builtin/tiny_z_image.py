"""A tiny random Z-Image pipeline, built offline: `builtin:tiny-z-image` (registered in engine/builtin/models.py).

The layout of the real diffusers directory (transformer/, vae/, text_encoder/,
tokenizer/, scheduler/, model_index.json naming `ZImagePipeline`), written
with `save_pretrained` and read back by the real loaders, as
engine/builtin/tiny_pipelines.py does for FLUX.2 and Qwen-Image:

- `ZImageTransformer2DModel`: 4 main layers and 1 noise / 1 context refiner
  block, 32 wide (2 heads × 16, RoPE axes 4 + 6 + 6), 4 latent channels and
  2×2 patches, as the real one (3840 wide, 30 layers, 2 + 2 refiners);
- `AutoencoderKL` (FLUX.1's VAE class, which Z-Image uses) with 4 latent
  channels and the real model's scaling / shift factors, so the
  normalisation is visible;
- a 2-layer `Qwen3Model` text encoder (the real one is Qwen3-4B; the pipeline
  reads its second-to-last hidden state) and a byte-level Qwen2 tokenizer
  with the chat template the pipeline applies;
- Z-Image-Turbo's scheduler: a static shift of 3 (no dynamic shifting).

Every weight is random with a fixed seed.
"""

from __future__ import annotations

from pathlib import Path

LATENT_CHANNELS = 4
TOKENIZER_MAX_LEN = 64  # the pipeline pads to 512 and drops the padding; short keeps CPU tests fast


def build_tiny_z_image(dest: Path, seed: int = 1234) -> None:
    """Write a tiny random Z-Image pipeline directory to `dest`."""
    import torch
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        ZImagePipeline,
        ZImageTransformer2DModel,
    )
    from transformers import Qwen3Config, Qwen3Model

    from engine.builtin.tiny_pipelines import QWEN3_CHAT_TEMPLATE, qwen_tokenizer

    tok = qwen_tokenizer("<|im_start|>user\n<|im_end|>\n<|im_start|>assistant\n", max_len=TOKENIZER_MAX_LEN)
    tok.chat_template = QWEN3_CHAT_TEMPLATE
    text_hidden = 16
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        transformer = ZImageTransformer2DModel(
            in_channels=LATENT_CHANNELS, dim=32, n_layers=4, n_refiner_layers=1, n_heads=2, n_kv_heads=2,
            cap_feat_dim=text_hidden, axes_dims=[4, 6, 6], axes_lens=[256, 64, 64],
        )
        vae = AutoencoderKL(
            in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
            up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(8, 8, 8, 8), layers_per_block=1,
            latent_channels=LATENT_CHANNELS, norm_num_groups=4, sample_size=32, scaling_factor=0.3611,
            shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False, mid_block_add_attention=False,
        )
        text_encoder = Qwen3Model(Qwen3Config(
            vocab_size=len(tok), hidden_size=text_hidden, intermediate_size=24, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=256,
            pad_token_id=0, bos_token_id=0, eos_token_id=0,
        ))
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False)
    pipe = ZImagePipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tok,
                          transformer=transformer)
    pipe.save_pretrained(dest, safe_serialization=True)
