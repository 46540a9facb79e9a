"""A tiny random HunyuanVideo 1.5 pipeline, built offline: `builtin:tiny-hunyuan-video15` (registered in
engine/builtin/models.py).

A `HunyuanVideo15Pipeline` directory written with `save_pretrained` and read back by diffusers' loaders:
`HunyuanVideo15Transformer3DModel` (2 blocks, t2v input: latents + zero condition + zero mask channels),
`AutoencoderKLHunyuanVideo15` (16x spatial, 4x temporal), a 2-layer `Qwen2_5_VLTextModel` and a 1-layer T5 encoder
with the byte-level ByT5 tokenizer (the pipeline's glyph encoder, for quoted text in a prompt), the CFG guider and
the flow-matching scheduler. Every weight is random with a fixed seed.

The Qwen2 tokenizer is byte-level (one token per byte), and its chat template renders the system message cut to
the length that makes the prefix before the caption exactly `prompt_template_encode_start_idx` (108) tokens, as
the real vocabulary makes the full message: the pipeline crops that many tokens off the front, so the cached
embeddings start at the caption, not inside the template. Captions are
cut at TEXT_LEN tokens (the real pipeline: 1000) to keep CPU tests fast.
"""

from __future__ import annotations

from pathlib import Path

TEXT_LEN = 24
CHANNELS = 4
QWEN_DIM, BYT5_DIM, IMAGE_DIM = 32, 16, 8
# Qwen's chat template, with the system message rendered by SYSTEM (template_tokenizer)
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
            "{% if m['role'] == 'system' %}{{ SYSTEM }}{% else %}{{ m['content'] }}{% endif %}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def template_tokenizer(crop: int):
    """A Qwen2 byte-level tokenizer without merges (one token per byte) whose chat template renders the system
    message cut or padded to the length that makes the prefix before the caption exactly `crop` tokens."""
    from engine.builtin.tiny_pipelines import qwen_tokenizer

    tok = qwen_tokenizer("", max_len=TEXT_LEN + crop)
    fixed = len(tok.apply_chat_template([{"role": "system", "content": ""}, {"role": "user", "content": ""}],
                                        chat_template=TEMPLATE.replace("SYSTEM", "''"), tokenize=True,
                                        return_dict=True)["input_ids"]) - len(tok("<|im_end|>\n")["input_ids"])
    tok.chat_template = TEMPLATE.replace("SYSTEM", f"(m['content'] ~ '{' ' * crop}')[:{crop - fixed}]")
    return tok


def build_tiny_hunyuan_video15(dest: Path, seed: int = 1234) -> None:
    """Write a tiny random HunyuanVideo 1.5 (t2v) pipeline directory to `dest`."""
    import torch
    from diffusers import (
        AutoencoderKLHunyuanVideo15,
        ClassifierFreeGuidance,
        FlowMatchEulerDiscreteScheduler,
        HunyuanVideo15Pipeline,
        HunyuanVideo15Transformer3DModel,
    )
    from transformers import (
        ByT5Tokenizer,
        Qwen2_5_VLTextConfig,
        Qwen2_5_VLTextModel,
        T5Config,
        T5EncoderModel,
    )

    byt5 = ByT5Tokenizer(extra_ids=0)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        transformer = HunyuanVideo15Transformer3DModel(
            in_channels=2 * CHANNELS + 1, out_channels=CHANNELS, num_attention_heads=2, attention_head_dim=8,
            num_layers=2, num_refiner_layers=1, mlp_ratio=2.0, text_embed_dim=QWEN_DIM, text_embed_2_dim=BYT5_DIM,
            image_embed_dim=IMAGE_DIM, rope_axes_dim=(2, 2, 4), task_type="t2v")
        vae = AutoencoderKLHunyuanVideo15(latent_channels=CHANNELS, block_out_channels=(8, 8, 8, 8, 8),
                                          layers_per_block=1, spatial_compression_ratio=16,
                                          temporal_compression_ratio=4)
        text_encoder = Qwen2_5_VLTextModel(Qwen2_5_VLTextConfig(
            vocab_size=512, hidden_size=QWEN_DIM, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, pad_token_id=0, bos_token_id=0, eos_token_id=0,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2]}))
        text_encoder_2 = T5EncoderModel(T5Config(vocab_size=len(byt5), d_model=BYT5_DIM, d_kv=8, d_ff=32,
                                                 num_layers=1, num_heads=2, relative_attention_num_buckets=8))
    tok = template_tokenizer(108)  # the pipeline's prompt_template_encode_start_idx (checked below)
    pipe = HunyuanVideo15Pipeline(text_encoder=text_encoder, tokenizer=tok, transformer=transformer, vae=vae,
                                  scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0), text_encoder_2=text_encoder_2,
                                  tokenizer_2=byt5, guider=ClassifierFreeGuidance(guidance_scale=6.0))
    assert pipe.prompt_template_encode_start_idx == 108 and len(tok) <= text_encoder.config.vocab_size
    pipe.save_pretrained(dest, safe_serialization=True)
