"""A tiny random Qwen-Image 2.1 pipeline, built offline: `builtin:tiny-qwen-image-21` (declared by
engine/families/image/qwen_image_21/).

The layout of a real Qwen-Image 2.1 diffusers directory (transformer/, vae/, text_encoder/, processor/, scheduler/,
model_index.json naming `QwenImage21Pipeline`), written with `QwenImage21Pipeline.save_pretrained` and read back by
diffusers' own `from_pretrained`. Random weights with a fixed seed:

- `QwenImage21Transformer2DModel`: 4 single-stream blocks of 2 heads × 16 (the real one: 32 of 32 × 128), patch 1
  over 8 latent channels (the real VAE has 64), with the shared modulation and the causal condition of the real
  config; its zero-centred text norm gets random weights (zeros would hide a wrong `weight + 1`);
- `AutoencoderKLQwenImage21`: 5 levels (four 2× downsamples, 16× as the real one), 8 channels wide, 8 latent
  channels with their own latents_mean / std, RGBA in and out as the real one;
- a 2-layer `Qwen3VLForConditionalGeneration` (the real one is Qwen3-VL-8B) with a one-block vision tower that
  text-to-image prompt encoding never runs;
- the processor: the real checkpoint's `Qwen3VLProcessor` builds only with torchvision (its video processor), which
  lorad does not install. The pipeline reads three things of it: its chat template (the system prompt's token count,
  dropped from the hidden states), its tokenizer, and text tokenised with left padding. `PaddleOCRVLProcessor` over
  Qwen2-VL's PIL image processor and the same byte-level Qwen2 tokenizer does all three without torchvision (as
  tiny-qwen-image-edit's processor does); every word of the pipeline's templates is one token, as in the real
  vocabulary;
- the scheduler: flow matching with the resolution-dependent exponential shift the pipeline computes (μ 0.5 … 1.15
  over 256 … 4096 image tokens).
"""

from __future__ import annotations

from pathlib import Path

LATENT_CHANNELS = 8  # not 4: the image processor passes a 4-channel (RGBA) tensor through as latents of a 4-channel VAE
TOKENIZER_MAX_LEN = 48  # captions are not padded; short keeps CPU tests fast
# Qwen3-VL's chat template over content parts (what the pipeline's system message is), written out, not downloaded.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tiny_qwen_image_21(dest: Path, seed: int = 1234) -> None:
    """Write a tiny random Qwen-Image 2.1 pipeline directory to `dest`."""
    import torch
    from diffusers import (
        AutoencoderKLQwenImage21,
        FlowMatchEulerDiscreteScheduler,
        QwenImage21Pipeline,
        QwenImage21Transformer2DModel,
    )
    from transformers import (
        PaddleOCRVLProcessor,
        Qwen2VLImageProcessorPil,
        Qwen3VLConfig,
        Qwen3VLForConditionalGeneration,
    )

    from engine.builtin.tiny_pipelines import qwen_tokenizer

    tok = qwen_tokenizer(_TEMPLATE_WORDS, max_len=TOKENIZER_MAX_LEN, vision=True)
    tok.chat_template = CHAT_TEMPLATE
    processor = PaddleOCRVLProcessor(image_processor=Qwen2VLImageProcessorPil(min_pixels=32 * 32, max_pixels=64 * 64),
                                     tokenizer=tok, chat_template=CHAT_TEMPLATE)
    text_hidden = 16
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        transformer = QwenImage21Transformer2DModel(
            patch_size=1, in_channels=LATENT_CHANNELS, out_channels=LATENT_CHANNELS, num_layers=4,
            attention_head_dim=16, num_attention_heads=2, context_in_dim=text_hidden, mlp_ratio=3,
            axes_dims_rope=(4, 6, 6),
        )
        for name, p in transformer.named_parameters():
            if name.endswith("text_norm.weight"):
                p.data.normal_(0, 0.1)
        vae = AutoencoderKLQwenImage21(
            base_dim=8, decoder_base_dim=8, z_dim=LATENT_CHANNELS, dim_mult=[1, 1, 1, 1, 1], num_res_blocks=1,
            temperal_downsample=[False, True, True, True],
            latents_mean=[round(float(x), 4) for x in torch.randn(LATENT_CHANNELS) * 0.3],
            latents_std=[round(float(x), 4) for x in torch.rand(LATENT_CHANNELS) + 0.75],
        )
        image_token = tok.convert_tokens_to_ids("<|image_pad|>")
        text_config = dict(vocab_size=len(tok), hidden_size=text_hidden, intermediate_size=24, num_hidden_layers=2,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=512,
                           rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2],
                                            "mrope_interleaved": True},
                           pad_token_id=0, bos_token_id=0, eos_token_id=0)
        vision_config = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=text_hidden,
                             num_position_embeddings=16, deepstack_visual_indexes=[])
        text_encoder = Qwen3VLForConditionalGeneration(Qwen3VLConfig(
            text_config=text_config, vision_config=vision_config, image_token_id=image_token,
            video_token_id=image_token, vision_start_token_id=tok.convert_tokens_to_ids("<|vision_start|>"),
            vision_end_token_id=tok.convert_tokens_to_ids("<|vision_end|>"), tie_word_embeddings=False,
        ))
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
        max_image_seq_len=4096, time_shift_type="exponential",
    )
    pipe = QwenImage21Pipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, processor=processor,
                               transformer=transformer)
    pipe.save_pretrained(dest, safe_serialization=True)


# The words of the pipeline's prompt templates (system prompt, roles), one token each in the tiny vocabulary.
_TEMPLATE_WORDS = ("<|im_start|>system\nComprehend and analyze the provided prompt.<|im_end|>\n<|im_start|>user\n"
                   "<|im_end|>\n<|im_start|>assistant\n")
