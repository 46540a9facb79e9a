"""A tiny random Ideogram 4 pipeline, built offline: `builtin:tiny-ideogram4` (declared by the ideogram4 family).

The layout of a real Ideogram 4 diffusers directory (transformer/, unconditional_transformer/, vae/, text_encoder/,
tokenizer/, scheduler/, model_index.json naming `Ideogram4Pipeline`), written with `Ideogram4Pipeline.save_pretrained`
and read back by diffusers' own `from_pretrained`. Random weights with a fixed seed:

- two `Ideogram4Transformer2DModel`s (the conditional one LoRA trains, and the unconditional one of the pipeline's
  asymmetric guidance): 4 blocks, 2 heads × 16, SwiGLU 64 wide, AdaLN 16 wide, MRoPE sections (2, 2, 2);
- a tiny FLUX.2 VAE (`AutoencoderKLFlux2`, 4 latent channels, 16 packed) with random batch-norm statistics, so a
  wrong patch order or normalisation shows in tests;
- a 36-layer `Qwen3VLModel` 16 wide: the pipeline taps the hidden states of decoder layers 0, 3, …, 33 and 35 (its
  fixed QWEN3_VL_ACTIVATION_LAYERS, as the real 36-layer Qwen3-VL-8B has them), 13 × 16 = 208 text features per
  token (the real model: 13 × 4096 = 53248). Its byte-level Qwen2 tokenizer has a Qwen3-VL-style chat template
  (the pipeline sends the caption as a list of typed parts);
- the pipeline's own schedule is built per call (logit-normal, resolution-aware), so the scheduler is the plain
  `FlowMatchEulerDiscreteScheduler`.
"""

from __future__ import annotations

from pathlib import Path

LATENT_CHANNELS = 4
TOKENIZER_MAX_LEN = 96  # the pipeline reads up to 2048 tokens; the cache keeps the real ones only
TEXT_HIDDEN = 16
TEXT_LAYERS = 36  # QWEN3_VL_ACTIVATION_LAYERS reach decoder layer 35
# Qwen3-VL's template for a message whose content is a list of typed parts (text only here); written out.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _transformer(llm_features_dim: int):
    from diffusers import Ideogram4Transformer2DModel

    t = Ideogram4Transformer2DModel(
        in_channels=LATENT_CHANNELS * 4, num_layers=4, attention_head_dim=16, num_attention_heads=2,
        intermediate_size=64, adaln_dim=16, llm_features_dim=llm_features_dim, rope_theta=10000,
        mrope_section=(2, 2, 2),
    )
    # Random zero-centred norm scales: the real checkpoint's are trained; ones would hide a wrong norm input.
    for name, p in t.named_parameters():
        if "norm" in name and name.endswith("weight"):
            p.data.normal_(1.0, 0.1)
    return t


def build_tiny_ideogram4(dest: Path, seed: int = 1234) -> None:
    """Write a tiny random Ideogram 4 pipeline directory to `dest`."""
    import torch
    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Ideogram4Pipeline
    from diffusers.pipelines.ideogram4.pipeline_ideogram4 import QWEN3_VL_ACTIVATION_LAYERS
    from transformers import Qwen3VLConfig, Qwen3VLModel

    from engine.builtin.tiny_pipelines import qwen_tokenizer

    tok = qwen_tokenizer("<|im_start|>user\n<|im_end|>\n<|im_start|>assistant\n", max_len=TOKENIZER_MAX_LEN)
    tok.chat_template = CHAT_TEMPLATE
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        features = len(QWEN3_VL_ACTIVATION_LAYERS) * TEXT_HIDDEN
        transformer, unconditional = _transformer(features), _transformer(features)
        vae = AutoencoderKLFlux2(
            block_out_channels=(8, 8, 8, 8), layers_per_block=1, latent_channels=LATENT_CHANNELS, norm_num_groups=4,
            sample_size=32, use_quant_conv=False, use_post_quant_conv=False, mid_block_add_attention=False,
        )
        vae.bn.running_mean.copy_(torch.randn(vae.bn.num_features) * 0.3)
        vae.bn.running_var.copy_(torch.rand(vae.bn.num_features) + 0.5)
        text_config = dict(vocab_size=len(tok), hidden_size=TEXT_HIDDEN, intermediate_size=24,
                           num_hidden_layers=TEXT_LAYERS, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                           max_position_embeddings=512,
                           rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2],
                                            "mrope_interleaved": True},
                           pad_token_id=0, bos_token_id=0, eos_token_id=0)
        vision_config = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=TEXT_HIDDEN,
                             num_position_embeddings=16, deepstack_visual_indexes=[])
        text_encoder = Qwen3VLModel(Qwen3VLConfig(
            text_config=text_config, vision_config=vision_config, image_token_id=len(tok) - 1,
            video_token_id=len(tok) - 1, vision_start_token_id=len(tok) - 1, vision_end_token_id=len(tok) - 1,
        ))
    pipe = Ideogram4Pipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=text_encoder,
                             tokenizer=tok, transformer=transformer, unconditional_transformer=unconditional)
    pipe.save_pretrained(dest, safe_serialization=True)
