"""A tiny random FLUX.3 pipeline, built offline: `builtin:tiny-flux3` (registered in engine/builtin/models.py).

FLUX.3's pipelines are modular only in diffusers 0.42.1 (`Flux3ModularPipeline` over `Flux3AutoBlocks`), so this
is what `Flux3AutoBlocks().init_pipeline()` + `update_components` + `save_pretrained` writes: transformer/, vae/,
text_encoder/, tokenizer/ and `modular_model_index.json` naming the blocks; `ModularPipeline.from_pretrained` reads
it back (a copy elsewhere loads its components from where it lies, so materialise's rename is safe). The scheduler
and guider are the blocks' own from-config components (the FLUX.3 timestep shift 6.93, CFG), not files. Random
weights with a fixed seed:

- `Flux3Transformer2DModel`: 1 per-mode block per mode (image, reference image, text) and 4 joint single blocks,
  2 heads of 8, 4 latent channels × 4 after the 2×2 patchify (the real one: 5 + 28 blocks, 24 × 128, 128 channels);
- `AutoencoderKLFlux2` (FLUX.3's VAE class) with 4 latent channels and non-trivial batch-norm latent statistics,
  so the normalisation is visible;
- a `Qwen3VLForConditionalGeneration` text encoder of 32 narrow layers (the pipeline stacks hidden states 4, 8,
  ..., 32, so the text width is 8 × 8) with a one-block vision tower that prompt encoding never runs;
- the processor: a `GotOcr2Processor` around a byte-level Qwen2 tokenizer with the Qwen3 chat template. The real
  one is a `Qwen3VLProcessor`, which transformers builds only with torchvision (its video processor); the text
  encoder step uses only what both have, `apply_chat_template` and `.tokenizer`.
"""

from __future__ import annotations

from pathlib import Path

LATENT_CHANNELS = 4
TEXT_HIDDEN = 8
TEXT_LAYERS = 32  # the pipeline's default text_encoder_out_layers reach hidden state 32


def _text_encoder(vocab: int):
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    text = dict(vocab_size=vocab, hidden_size=TEXT_HIDDEN, intermediate_size=16, num_hidden_layers=TEXT_LAYERS,
                num_attention_heads=2, num_key_value_heads=1, head_dim=4, max_position_embeddings=512,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 0]},
                pad_token_id=0, bos_token_id=0, eos_token_id=0)
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=TEXT_HIDDEN,
                  deepstack_visual_indexes=[0], num_position_embeddings=16)
    special = vocab - 1  # no image is ever given: the vision tokens only need an id
    return Qwen3VLForConditionalGeneration(Qwen3VLConfig(
        text_config=text, vision_config=vision, image_token_id=special, video_token_id=special,
        vision_start_token_id=special, vision_end_token_id=special))


def build_tiny_flux3(dest: Path, seed: int = 1234) -> None:
    """Write a tiny random FLUX.3 modular pipeline directory to `dest`."""
    import torch
    from diffusers import AutoencoderKLFlux2, Flux3AutoBlocks, Flux3Transformer2DModel
    from transformers import GotOcr2ImageProcessorPil, GotOcr2Processor

    from engine.builtin.tiny_pipelines import QWEN3_CHAT_TEMPLATE, qwen_tokenizer

    tok = qwen_tokenizer("<|im_start|>user\n<|im_end|>\n<|im_start|>assistant\n", max_len=512)
    processor = GotOcr2Processor(image_processor=GotOcr2ImageProcessorPil(), tokenizer=tok,
                                 chat_template=QWEN3_CHAT_TEMPLATE)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        transformer = Flux3Transformer2DModel(
            in_channels=LATENT_CHANNELS * 4, cond_in_channels=LATENT_CHANNELS * 4, num_layers=1, num_single_layers=4,
            attention_head_dim=8, num_attention_heads=2, joint_attention_dim=8 * TEXT_HIDDEN, timestep_channels=16,
            mlp_ratio=2.0, axes_dims_rope=(2, 2, 2, 2),
        )
        vae = AutoencoderKLFlux2(
            block_out_channels=(8, 8, 8, 8), layers_per_block=1, latent_channels=LATENT_CHANNELS, norm_num_groups=4,
            sample_size=32, use_quant_conv=False, use_post_quant_conv=False, mid_block_add_attention=False,
        )
        vae.bn.running_mean.copy_(torch.randn(vae.bn.num_features) * 0.1)
        vae.bn.running_var.copy_(torch.rand(vae.bn.num_features) + 0.5)
        text_encoder = _text_encoder(len(tok))
    pipe = Flux3AutoBlocks().init_pipeline()
    pipe.update_components(transformer=transformer, vae=vae, text_encoder=text_encoder, tokenizer=processor)
    pipe.save_pretrained(str(dest), safe_serialization=True, overwrite_modular_index=True)
