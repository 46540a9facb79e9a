"""Tiny random FLUX.2 (klein layout) and Qwen-Image pipelines, built offline: `builtin:tiny-flux2`, `builtin:tiny-qwen-image`
(registered in engine/builtin/models.py).

Each has the layout of the real diffusers directory (transformer/, vae/,
text_encoder/, tokenizer/, scheduler/, model_index.json), written with
`save_pretrained` and read back by the real loaders (`from_pretrained` of
diffusers' own classes), so the training, caching, sampling and export code
runs exactly as on the real model. Every weight is random with a fixed seed.

- tiny-flux2: `Flux2KleinPipeline` — `Flux2Transformer2DModel` (2 double + 2
  single blocks, no guidance embedding, as klein), `AutoencoderKLFlux2` with
  4 latent channels (16 after the 2×2 patchify) and non-trivial batch-norm
  latent statistics, and a Qwen3 text encoder of 28 narrow layers (the
  pipeline stacks hidden states 9, 18 and 27).
- tiny-qwen-image: `QwenImagePipeline` — `QwenImageTransformer2DModel` (4
  blocks), `AutoencoderKLQwenImage` (z_dim 4 with its own latents_mean/std)
  and a 2-layer Qwen2.5-VL text encoder (with a one-block vision tower, which
  prompt encoding never runs).

Both tokenizers are Qwen2 byte-level BPE with no data behind them: every byte
is a token, plus merges that make each word of the fixed chat-template
prefixes one token, as the real vocabulary does — so the Qwen-Image pipeline's
`prompt_template_encode_start_idx` (34 template tokens dropped) holds here too
and the cached embeddings start at the caption, not inside the template.

The real checkpoints use the dev-only Mistral-3 encoder (`Flux2Pipeline`);
the family reads `model_index.json` and drives whichever pipeline class the
directory names, so both go through the same code.
"""

from __future__ import annotations

import re
from pathlib import Path

LATENT_CHANNELS = 4
TOKENIZER_MAX_LEN = 48  # FLUX.2 pads every caption to 512 tokens; short keeps CPU tests fast
# Qwen-Image does not pad (captions keep their own length); its pipeline truncates at 1024 + the 34 template tokens.
QWEN_MAX_LEN = 1024 + 34
VISION_SPECIALS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")

QWEN_TEMPLATE = ("<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, "
                 "text, spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n")
# Qwen3's template with thinking disabled (what Flux2KleinPipeline asks for); written out, not downloaded.
QWEN3_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


def qwen_tokenizer(words: str, max_len: int = TOKENIZER_MAX_LEN, vision: bool = False):
    """A Qwen2 byte-level BPE tokenizer: 256 byte tokens, the chat specials, and one token per word of `words`;
    vision=True adds Qwen2-VL's image specials and names the image token (tokenizer.image_token)."""
    from tokenizers import pre_tokenizers
    from transformers import Qwen2Tokenizer

    specials = ["<|im_start|>", "<|im_end|>"] + (list(VISION_SPECIALS) if vision else [])
    vocab = {"<|endoftext|>": 0}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    # Split the words with Qwen2's own pre-tokenizer (its regex, then bytes), so the merges match what it sees.
    split = Qwen2Tokenizer(vocab=dict(vocab), merges=[])._tokenizer.pre_tokenizer
    merges: list[tuple[str, str]] = []
    for text in re.split("|".join(map(re.escape, specials)), words):
        for chunk, _ in split.pre_tokenize_str(text):
            for i in range(2, len(chunk) + 1):
                if chunk[:i] not in vocab:
                    vocab[chunk[:i]] = len(vocab)
                    merges.append((chunk[: i - 1], chunk[i - 1]))
    named = {"image_token": VISION_SPECIALS[1]} if vision else {}
    tok = Qwen2Tokenizer(vocab=vocab, merges=merges, model_max_length=max_len, **named)
    tok.add_special_tokens({"additional_special_tokens": specials})
    return tok


def _qwen3_text_encoder(tok, hidden: int, layers: int):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return Qwen3ForCausalLM(Qwen3Config(
        vocab_size=len(tok), hidden_size=hidden, intermediate_size=24, num_hidden_layers=layers,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=256,
        tie_word_embeddings=False, pad_token_id=0, bos_token_id=0, eos_token_id=0,
    ))


def build_tiny_flux2(dest: Path, seed: int = 1234) -> None:
    """Write a tiny random FLUX.2-klein-shaped pipeline directory to `dest`."""
    import torch
    from diffusers import (
        AutoencoderKLFlux2,
        FlowMatchEulerDiscreteScheduler,
        Flux2KleinPipeline,
        Flux2Transformer2DModel,
    )

    tok = qwen_tokenizer("<|im_start|>user\n<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")
    tok.chat_template = QWEN3_CHAT_TEMPLATE
    text_hidden = 8
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        transformer = Flux2Transformer2DModel(
            patch_size=1, in_channels=LATENT_CHANNELS * 4, num_layers=2, num_single_layers=2,
            attention_head_dim=16, num_attention_heads=2, joint_attention_dim=3 * text_hidden,
            timestep_guidance_channels=32, mlp_ratio=2.0, axes_dims_rope=(4, 4, 4, 4), guidance_embeds=False,
        )
        vae = AutoencoderKLFlux2(
            block_out_channels=(8, 8, 8, 8), layers_per_block=1, latent_channels=LATENT_CHANNELS, norm_num_groups=4,
            sample_size=32, use_quant_conv=False, use_post_quant_conv=False, mid_block_add_attention=False,
        )
        # The real VAE ships measured latent statistics; random ones make the normalisation visible in tests.
        vae.bn.running_mean.copy_(torch.randn(vae.bn.num_features) * 0.1)
        vae.bn.running_var.copy_(torch.rand(vae.bn.num_features) + 0.5)
        text_encoder = _qwen3_text_encoder(tok, text_hidden, layers=28)
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
        max_image_seq_len=4096, time_shift_type="exponential",
    )
    pipe = Flux2KleinPipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tok,
                              transformer=transformer, is_distilled=False)
    pipe.save_pretrained(dest, safe_serialization=True)


def build_tiny_qwen_image(dest: Path, seed: int = 1234) -> None:
    """Write a tiny random Qwen-Image pipeline directory to `dest`."""
    from diffusers import QwenImagePipeline

    tok = qwen_tokenizer(QWEN_TEMPLATE + "<|im_end|>\n<|im_start|>assistant\n", max_len=QWEN_MAX_LEN)
    pipe = QwenImagePipeline(tokenizer=tok, **qwen_image_components(tok, seed))
    pipe.save_pretrained(dest, safe_serialization=True)


def qwen_image_components(tok, seed: int, image_token_id: int | None = None) -> dict:
    """The tiny Qwen-Image transformer, VAE, Qwen2.5-VL text encoder (its vision tokens `image_token_id`, or the
    last token where prompts carry no image) and scheduler (tiny-qwen-image-edit's too)."""
    import torch
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    text_hidden = 32
    special = len(tok) - 1 if image_token_id is None else image_token_id
    vision_ids = {} if image_token_id is None else {
        "vision_start_token_id": tok.convert_tokens_to_ids(VISION_SPECIALS[0]),
        "vision_end_token_id": tok.convert_tokens_to_ids(VISION_SPECIALS[2])}
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        transformer = QwenImageTransformer2DModel(
            patch_size=2, in_channels=LATENT_CHANNELS * 4, out_channels=LATENT_CHANNELS, num_layers=4,
            attention_head_dim=16, num_attention_heads=2, joint_attention_dim=text_hidden, axes_dims_rope=(4, 6, 6),
        )
        vae = AutoencoderKLQwenImage(
            base_dim=8, z_dim=LATENT_CHANNELS, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
            temperal_downsample=[False, True, True],
            latents_mean=[round(float(x), 4) for x in torch.randn(LATENT_CHANNELS) * 0.3],
            latents_std=[round(float(x), 4) for x in torch.rand(LATENT_CHANNELS) + 0.75],
        )
        text_config = dict(vocab_size=len(tok), hidden_size=text_hidden, intermediate_size=48, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                           rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2]},
                           pad_token_id=0, bos_token_id=0, eos_token_id=0)
        vision_config = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=text_hidden,
                             fullatt_block_indexes=[0], window_size=112)
        text_encoder = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
            text_config=text_config, vision_config=vision_config, image_token_id=special,
            video_token_id=special, **({"vision_start_token_id": special, "vision_end_token_id": special}
                                       if image_token_id is None else vision_ids),
        ))
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9, base_image_seq_len=256,
        max_image_seq_len=8192, shift_terminal=0.02, time_shift_type="exponential",
    )
    return {"transformer": transformer, "vae": vae, "text_encoder": text_encoder, "scheduler": scheduler}


def build_tiny_qwen_image_edit(dest: Path, seed: int = 1234, plus: bool = False) -> None:
    """Write a tiny random Qwen-Image-Edit (plus=True: Edit-Plus) pipeline directory to `dest`: tiny-qwen-image's
    components, a tokenizer with Qwen2-VL's image tokens, and a processor whose vision tower input is the real
    one's (Qwen2VLImageProcessorPil: 14 px patches merged 2x2, a small pixel budget). The real checkpoints'
    Qwen2VLProcessor builds only with torchvision; PaddleOCRVLProcessor drives the same image processor and the
    same image-token expansion without it."""
    from diffusers import QwenImageEditPipeline, QwenImageEditPlusPipeline
    from transformers import PaddleOCRVLProcessor, Qwen2VLImageProcessorPil

    cls = QwenImageEditPlusPipeline if plus else QwenImageEditPipeline
    template = cls(*[None] * 6).prompt_template_encode
    tok = qwen_tokenizer(template.replace("{}", ""), max_len=QWEN_MAX_LEN, vision=True)
    processor = PaddleOCRVLProcessor(image_processor=Qwen2VLImageProcessorPil(min_pixels=28 * 28,
                                                                              max_pixels=56 * 56 * 4), tokenizer=tok)
    parts = qwen_image_components(tok, seed, image_token_id=tok.image_token_id)
    cls(tokenizer=tok, processor=processor, **parts).save_pretrained(dest, safe_serialization=True)
