"""A tiny random Chroma pipeline, built offline: `builtin:tiny-chroma` (registered in engine/builtin/models.py).

The layout of a real Chroma diffusers directory (lodestones/Chroma1-HD: transformer/, vae/, text_encoder/ +
tokenizer/ for T5, scheduler/, model_index.json), written with `ChromaPipeline.save_pretrained` and read back by
diffusers' own `from_pretrained`, so caching, training, sampling and export run as on the real model. Random
weights with a fixed seed:

- `ChromaTransformer2DModel`: 2 double + 2 single blocks, 2 heads of 16, and a one-layer approximator
  (`distilled_guidance_layer`, 32 wide) that turns the timestep into every block's modulation, as Chroma's does;
- FLUX.1's VAE layout and the character-level T5 of tiny-flux (engine/builtin/tiny_flux.py; Chroma has no CLIP),
  whose tokenizer stops at 32 tokens, so captions are short and CPU tests fast.
"""

from __future__ import annotations

from pathlib import Path


def build_tiny_chroma(dest: Path, seed: int = 1234) -> None:
    """Write a tiny random Chroma pipeline directory to `dest`."""
    import torch
    from diffusers import ChromaPipeline, ChromaTransformer2DModel, FlowMatchEulerDiscreteScheduler

    from engine.builtin.tiny_flux import LATENT_CHANNELS, TEXT_DIM, t5_tokenizer, tiny_t5, tiny_vae

    tok = t5_tokenizer()
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        transformer = ChromaTransformer2DModel(
            patch_size=1, in_channels=LATENT_CHANNELS * 4, num_layers=2, num_single_layers=2, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=TEXT_DIM, axes_dims_rope=(4, 6, 6),
            approximator_num_channels=16, approximator_hidden_dim=32, approximator_layers=1,
        )
        vae = tiny_vae()
        text_encoder = tiny_t5(tok)
    # FLUX.1's dynamic-shift settings, the defaults ChromaPipeline's calculate_shift falls back to.
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
        max_image_seq_len=4096,
    )
    pipe = ChromaPipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tok,
                          transformer=transformer)
    pipe.save_pretrained(dest, safe_serialization=True)
