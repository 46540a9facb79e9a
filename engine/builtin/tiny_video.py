"""Tiny random Wan 2.2 pipelines, built offline: `builtin:tiny-wan22-5b` (TI2V-5B's layout: one transformer, the
residual VAE with 16x spatial compression, expand_timesteps) and `builtin:tiny-wan22-a14b` (T2V-A14B's: two
experts, `transformer` for high noise and `transformer_2` for low noise, split at boundary_ratio 0.875, the 8x
VAE). Registered in engine/builtin/models.py.

Each is a `WanPipeline` directory written with `save_pretrained` and read back by diffusers' own loaders, so the
caching, training, sampling and export code runs as on the real model. The text encoder is a one-layer UMT5 and
the tokenizer byte-level (engine/builtin/tiny_pipelines.py), capped at TEXT_LEN tokens so that CPU tests stay fast: the
pipeline pads every caption to that length, as it pads to 512 on the real model. Every weight is random with a
fixed seed.
"""

from __future__ import annotations

from pathlib import Path

TEXT_LEN = 32
TEXT_DIM = 16


def _text_parts(seed: int):
    import torch
    from transformers import UMT5Config, UMT5EncoderModel

    from engine.builtin.tiny_pipelines import qwen_tokenizer

    tok = qwen_tokenizer("", max_len=TEXT_LEN)  # byte-level: every byte a token, <|endoftext|> (0) pads
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        enc = UMT5EncoderModel(UMT5Config(vocab_size=len(tok), d_model=TEXT_DIM, d_kv=8, d_ff=32, num_layers=1,
                                          num_heads=2, relative_attention_num_buckets=8, pad_token_id=0,
                                          eos_token_id=2, decoder_start_token_id=0))
    return tok, enc


def _transformer(channels: int, seed: int):
    import torch
    from diffusers import WanTransformer3DModel

    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8,
                                     in_channels=channels, out_channels=channels, text_dim=TEXT_DIM, freq_dim=16,
                                     ffn_dim=32, num_layers=2, rope_max_seq_len=64)


def _vae(z_dim: int, seed: int, residual: bool):
    import torch
    from diffusers import AutoencoderKLWan

    with torch.random.fork_rng():
        torch.manual_seed(seed)
        stats = dict(latents_mean=[round(float(x), 4) for x in torch.randn(z_dim) * 0.3],
                     latents_std=[round(float(x), 4) for x in torch.rand(z_dim) + 0.75])
        if residual:  # Wan 2.2's VAE: 2x2 patchified pixels, 16x spatial, 4x temporal
            return AutoencoderKLWan(base_dim=8, decoder_base_dim=8, z_dim=z_dim, dim_mult=[1, 1, 1, 1],
                                    num_res_blocks=1, temperal_downsample=[False, True, True], is_residual=True,
                                    in_channels=12, out_channels=12, patch_size=2, scale_factor_spatial=16,
                                    scale_factor_temporal=4, **stats)
        return AutoencoderKLWan(base_dim=8, z_dim=z_dim, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                                temperal_downsample=[False, True, True], **stats)


def _scheduler(shift: float):
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(shift=shift)


def build_tiny_wan22_5b(dest: Path, seed: int = 1234) -> None:
    """Write a tiny random Wan 2.2 TI2V-5B-shaped pipeline directory to `dest`."""
    from diffusers import WanPipeline

    tok, enc = _text_parts(seed)
    pipe = WanPipeline(tokenizer=tok, text_encoder=enc, vae=_vae(8, seed + 1, residual=True),
                       scheduler=_scheduler(5.0), transformer=_transformer(8, seed + 2), expand_timesteps=True)
    pipe.save_pretrained(dest, safe_serialization=True)


def build_tiny_wan22_a14b(dest: Path, seed: int = 1234) -> None:
    """Write a tiny random Wan 2.2 T2V-A14B-shaped pipeline (two experts) directory to `dest`."""
    from diffusers import WanPipeline

    tok, enc = _text_parts(seed)
    pipe = WanPipeline(tokenizer=tok, text_encoder=enc, vae=_vae(4, seed + 1, residual=False),
                       scheduler=_scheduler(12.0), transformer=_transformer(4, seed + 2),
                       transformer_2=_transformer(4, seed + 3), boundary_ratio=0.875)
    pipe.save_pretrained(dest, safe_serialization=True)
