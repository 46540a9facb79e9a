"""A tiny random FLUX.1 pipeline, built offline, for tests, demos and `builtin:tiny-flux` (engine/builtin/models.py).

It has the same layout as a real FLUX.1-dev (or Kontext) diffusers directory (transformer/,
vae/, text_encoder/ + tokenizer/ for CLIP, text_encoder_2/ + tokenizer_2/ for
T5, scheduler/, model_index.json), written with `save_pretrained`, so the real
loading code runs against it. Every component is random with a fixed seed and a
few thousand parameters: one double-stream and one single-stream block, head
dimension 16, a 4-channel VAE with an 8x downsampling like the real one, and
character-level CLIP and T5 tokenizers built with the `tokenizers` backend.
"""

from __future__ import annotations

import string
from pathlib import Path

TEXT_DIM = 32       # T5 d_model = transformer joint_attention_dim
POOLED_DIM = 32     # CLIP hidden size = transformer pooled_projection_dim
LATENT_CHANNELS = 4
T5_MAX_LEN = 32     # the real tokenizer_2 says 512; short keeps CPU tests fast


def _clip_tokenizer():
    from transformers import CLIPTokenizer

    # CLIP's BPE marks word ends with "</w>"; with no merges every character is a token.
    chars = sorted(set(string.ascii_lowercase + string.digits + string.punctuation))
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for c in chars:
        vocab[c] = len(vocab)
        vocab[c + "</w>"] = len(vocab)
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=77)


def t5_tokenizer():
    """A character-level T5 (sentencepiece-style unigram) tokenizer with no data behind it (tiny-chroma's too)."""
    from transformers import T5TokenizerFast

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -1.0)]
    chars = sorted(set(string.ascii_letters + string.digits + string.punctuation))
    pieces += [(c, -2.0) for c in chars] + [("\u2581" + c, -1.5) for c in chars]
    return T5TokenizerFast(vocab=pieces, extra_ids=0, model_max_length=T5_MAX_LEN)


def tiny_vae():
    """FLUX.1's VAE layout (AutoencoderKL, shift and scaling factors), 4 latent channels, 8x down (tiny-chroma too)."""
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(8, 8, 8, 8),
        layers_per_block=1,
        latent_channels=LATENT_CHANNELS,
        norm_num_groups=4,
        sample_size=32,
        use_quant_conv=False,
        use_post_quant_conv=False,
        shift_factor=0.1159,
        scaling_factor=0.3611,
    )


def tiny_t5(tok):
    """A 2-layer T5 encoder TEXT_DIM wide over `tok`'s vocabulary (tiny-chroma's too)."""
    from transformers import T5Config, T5EncoderModel

    return T5EncoderModel(T5Config(
        vocab_size=len(tok), d_model=TEXT_DIM, d_ff=37, d_kv=8, num_layers=2, num_heads=4,
        relative_attention_num_buckets=8, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
    ))


def build_tiny_flux(dest: Path, seed: int = 1234, guidance_embeds: bool = True, kontext: bool = False) -> None:
    """Write a tiny random FLUX.1 pipeline directory to `dest` (guidance_embeds=True is dev-like; kontext=True
    names FluxKontextPipeline, the edit model: FLUX.1 Kontext has FLUX.1-dev's very layout)."""
    import torch
    from diffusers import (
        FlowMatchEulerDiscreteScheduler,
        FluxKontextPipeline,
        FluxPipeline,
        FluxTransformer2DModel,
    )
    from transformers import CLIPTextConfig, CLIPTextModel

    clip_tok, t5_tok = _clip_tokenizer(), t5_tokenizer()
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        transformer = FluxTransformer2DModel(
            patch_size=1,
            in_channels=LATENT_CHANNELS * 4,
            num_layers=1,
            num_single_layers=1,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=TEXT_DIM,
            pooled_projection_dim=POOLED_DIM,
            guidance_embeds=guidance_embeds,
            axes_dims_rope=(4, 6, 6),
        )
        vae = tiny_vae()
        clip = CLIPTextModel(CLIPTextConfig(
            vocab_size=len(clip_tok), hidden_size=POOLED_DIM, intermediate_size=37, num_hidden_layers=2,
            num_attention_heads=4, max_position_embeddings=77, projection_dim=POOLED_DIM,
            bos_token_id=0, eos_token_id=1, pad_token_id=1,
        ))
        t5 = tiny_t5(t5_tok)
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
        base_image_seq_len=256, max_image_seq_len=4096,
    )
    pipe = (FluxKontextPipeline if kontext else FluxPipeline)(scheduler=scheduler, vae=vae, text_encoder=clip, tokenizer=clip_tok,
                        text_encoder_2=t5, tokenizer_2=t5_tok, transformer=transformer)
    pipe.save_pretrained(dest, safe_serialization=True)
