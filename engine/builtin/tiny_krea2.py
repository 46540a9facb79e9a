"""A tiny random Krea 2 pipeline, built offline: `builtin:tiny-krea2` (registered in engine/builtin/models.py).

The layout of a real Krea 2 diffusers directory (transformer/, vae/, text_encoder/, tokenizer/, scheduler/,
model_index.json naming `Krea2Pipeline` with its `text_encoder_select_layers`, `is_distilled` and `patch_size`),
written with `Krea2Pipeline.save_pretrained` and read back by diffusers' own `from_pretrained`. Random weights with
a fixed seed:

- `Krea2Transformer2DModel`: 4 blocks, 2 query heads × 16 over 1 key/value head (grouped-query attention as the real
  48 × 128 over 12), 2 + 2 text-fusion blocks (the real count) over 2 tapped text layers (the real model taps 12);
- the tiny Qwen-Image VAE of `builtin:tiny-qwen-image` (`AutoencoderKLQwenImage`, 4 latent channels with their own
  latents_mean / std; Krea 2 uses Qwen-Image's VAE);
- a 2-layer `Qwen3VLModel` (the real one is Qwen3-VL-4B) with a one-block vision tower that prompt encoding never
  runs; the pipeline taps hidden states 1 and 2. Its byte-level Qwen2 tokenizer makes each word of Krea 2's chat
  template one token, as the real vocabulary does, so the pipeline's 34 dropped template tokens are the template;
- the base checkpoint's scheduler: dynamic exponential shift over 256 … 6400 image tokens (μ 0.5 … 1.15), not
  distilled.
"""

from __future__ import annotations

from pathlib import Path

LATENT_CHANNELS = 4
TOKENIZER_MAX_LEN = 48  # the pipeline pads every caption to 512; short keeps CPU tests fast
SELECT_LAYERS = (1, 2)  # hidden_states indices of the 2-layer text encoder (0 is the embedding output)


def build_tiny_krea2(dest: Path, seed: int = 1234) -> None:
    """Write a tiny random Krea 2 pipeline directory to `dest`."""
    import torch
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        Krea2Pipeline,
        Krea2Transformer2DModel,
    )
    from transformers import Qwen3VLConfig, Qwen3VLModel

    from engine.builtin.tiny_pipelines import QWEN_TEMPLATE, qwen_tokenizer

    tok = qwen_tokenizer(QWEN_TEMPLATE + "<|im_end|>\n<|im_start|>assistant\n", max_len=TOKENIZER_MAX_LEN)
    text_hidden = 16
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        transformer = Krea2Transformer2DModel(
            in_channels=LATENT_CHANNELS * 4, num_layers=4, attention_head_dim=16, num_attention_heads=2,
            num_key_value_heads=1, intermediate_size=96, timestep_embed_dim=32, text_hidden_dim=text_hidden,
            num_text_layers=len(SELECT_LAYERS), text_num_attention_heads=2, text_num_key_value_heads=2,
            text_intermediate_size=16, axes_dims_rope=(4, 6, 6),
        )
        # Random zero-centred norm scales and modulation tables: the real checkpoint's are trained, zeros would hide
        # a wrong (1 + weight) or table lookup.
        for name, p in transformer.named_parameters():
            if name.endswith(("scale_shift_table", "norm.weight", "norm1.weight", "norm2.weight")):
                p.data.normal_(0, 0.1)
        vae = AutoencoderKLQwenImage(
            base_dim=8, z_dim=LATENT_CHANNELS, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
            temperal_downsample=[False, True, True],
            latents_mean=[round(float(x), 4) for x in torch.randn(LATENT_CHANNELS) * 0.3],
            latents_std=[round(float(x), 4) for x in torch.rand(LATENT_CHANNELS) + 0.75],
        )
        text_config = dict(vocab_size=len(tok), hidden_size=text_hidden, intermediate_size=24, num_hidden_layers=2,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=512,
                           rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2],
                                            "mrope_interleaved": True},
                           pad_token_id=0, bos_token_id=0, eos_token_id=0)
        vision_config = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=text_hidden,
                             num_position_embeddings=16, deepstack_visual_indexes=[])
        text_encoder = Qwen3VLModel(Qwen3VLConfig(
            text_config=text_config, vision_config=vision_config, image_token_id=len(tok) - 1,
            video_token_id=len(tok) - 1, vision_start_token_id=len(tok) - 1, vision_end_token_id=len(tok) - 1,
        ))
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
        max_image_seq_len=6400, time_shift_type="exponential",
    )
    pipe = Krea2Pipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tok,
                         transformer=transformer, text_encoder_select_layers=SELECT_LAYERS, is_distilled=False)
    pipe.save_pretrained(dest, safe_serialization=True)
