"""A tiny random SDXL pipeline, built offline: `builtin:tiny-sdxl` (declared in engine/families/image/sdxl/).

The layout of the real diffusers directory (unet/, vae/, text_encoder/ + tokenizer/ for CLIP ViT-L,
text_encoder_2/ + tokenizer_2/ for OpenCLIP bigG with its projection, scheduler/, model_index.json naming
`StableDiffusionXLPipeline`), written with `save_pretrained` and read back by the real loaders:

- `UNet2DConditionModel` with SDXL's shape in small: a plain down block then cross-attention blocks (the real one
  has three levels, transformer depths 0 / 2 / 10; this one two, depths 1 / 2), linear projections, the
  "text_time" added embedding (size and crop ids, 6 × addition_time_embed_dim, plus the pooled text embedding);
  cross-attention over both encoders' penultimate hidden states side by side (16 + 16 here, 768 + 1280 there);
- `AutoencoderKL` with SDXL's scaling factor (0.13025), 4 latent channels, 8x down;
- two 2-layer CLIP text encoders over a character-level tokenizer (77 tokens, as the real ones);
- SDXL's scheduler config (EulerDiscrete, scaled-linear betas 0.00085 → 0.012, 1000 steps, epsilon).

Every weight is random with a fixed seed.
"""

from __future__ import annotations

from pathlib import Path

TEXT_DIM = 16  # each CLIP's hidden size (the UNet's cross-attention dim is both side by side)
TIME_DIM = 8  # addition_time_embed_dim (256 in SDXL)


def build_tiny_sdxl(dest: Path, seed: int = 1234, text_dim_2: int = TEXT_DIM) -> None:
    """Write a tiny random SDXL pipeline directory to `dest`. text_dim_2: the second encoder's hidden size (a
    single-file test tells the two encoders apart by it, as diffusers' converter does: the real ones differ)."""
    import torch
    from diffusers import (
        AutoencoderKL,
        EulerDiscreteScheduler,
        StableDiffusionXLPipeline,
        UNet2DConditionModel,
    )
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    from engine.builtin.tiny_flux import _clip_tokenizer

    tok, tok2 = _clip_tokenizer(), _clip_tokenizer()
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        unet = UNet2DConditionModel(
            sample_size=4, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(8, 16),
            down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), transformer_layers_per_block=(1, 2),
            attention_head_dim=(2, 4), cross_attention_dim=TEXT_DIM + text_dim_2, norm_num_groups=4,
            use_linear_projection=True, addition_embed_type="text_time", addition_time_embed_dim=TIME_DIM,
            projection_class_embeddings_input_dim=6 * TIME_DIM + TEXT_DIM,
        )
        vae = AutoencoderKL(
            in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
            up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(8, 8, 8, 8), layers_per_block=1,
            latent_channels=4, norm_num_groups=4, sample_size=32, scaling_factor=0.13025, force_upcast=True,
        )
        common = dict(hidden_size=TEXT_DIM, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
                      max_position_embeddings=77, bos_token_id=0, eos_token_id=1, pad_token_id=1,
                      hidden_act="gelu")
        te1 = CLIPTextModel(CLIPTextConfig(vocab_size=len(tok), **common))
        te2 = CLIPTextModelWithProjection(CLIPTextConfig(vocab_size=len(tok2), projection_dim=TEXT_DIM,
                                                         **{**common, "hidden_size": text_dim_2}))
    scheduler = EulerDiscreteScheduler(
        num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
        steps_offset=1, timestep_spacing="leading", prediction_type="epsilon",
    )
    pipe = StableDiffusionXLPipeline(vae=vae, text_encoder=te1, text_encoder_2=te2, tokenizer=tok, tokenizer_2=tok2,
                                     unet=unet, scheduler=scheduler)
    pipe.save_pretrained(dest, safe_serialization=True)
