"""A tiny random HiDream-I1 pipeline, built offline: `builtin:tiny-hidream` (declared in engine/families/image/hidream/).

The layout of a real HiDream-I1 diffusers directory (transformer/, vae/, text_encoder/ … text_encoder_4/,
tokenizer/ … tokenizer_4/, scheduler/, model_index.json naming `HiDreamImagePipeline`), written with
`HiDreamImagePipeline.save_pretrained` and read back by diffusers' own `from_pretrained`. Random weights, fixed seed:

- `HiDreamImageTransformer2DModel`: 2 double-stream + 2 single-stream blocks (the real one: 16 + 32), 2 heads × 16,
  2×2 patches, the real mixture of experts in every block's image feed-forward (4 routed experts, 2 active, one
  shared expert), RoPE axes 8 + 4 + 4 over the full head as the real 64 + 32 + 32 over 128; `llama_layers` picks a
  Llama hidden state per block ([1, 0, 1, 1] here, so the order matters); max_resolution 20 × 20 latents (100
  image tokens: a non-square latent is padded to them, as the real 128 × 128 pads to 4096; buckets up to 160² px fit,
  the largest resolution the bucket property test draws);
- FLUX.1's VAE class and factors (`AutoencoderKL`, 16 channels in the real one, 4 here), 8× down;
- two `CLIPTextModelWithProjection` (projections 8 and 12 wide: the pooled vector is both, 20 wide), a 2-layer
  `T5EncoderModel` (24 wide) and a 2-layer `LlamaForCausalLM` (16 wide; the pipeline stacks every layer's hidden
  state, the transformer picks its `llama_layers`). Tokenizers: FLUX.1's character-level CLIP and T5 ones, and a
  byte-level BPE one for Llama that starts each prompt with `<|begin_of_text|>` and pads with its end token (the
  pipeline sets pad = eos), as Llama 3.1's does; T5 and Llama tokenizers stop at TOKENIZER_MAX_LEN (the pipeline
  pads both to 128: fixed length, no mask);
- the Dev/Fast checkpoints' scheduler: `FlowMatchEulerDiscreteScheduler`, a static shift of 3.
"""

from __future__ import annotations

from pathlib import Path

LATENT_CHANNELS = 4
TOKENIZER_MAX_LEN = 16  # the pipeline pads T5 and Llama to 128 tokens; short keeps CPU tests fast
T5_DIM, LLAMA_DIM, CLIP_PROJ = 24, 16, (8, 12)
LLAMA_LAYERS = [1, 0, 1, 1]


def llama_tokenizer(max_len: int = TOKENIZER_MAX_LEN):
    """A byte-level BPE tokenizer with Llama 3's specials and BOS template, and no data behind it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    bos, eos = "<|begin_of_text|>", "<|end_of_text|>"
    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab.update({bos: len(vocab), eos: len(vocab) + 1})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                       special_tokens=[(bos, vocab[bos])])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos, pad_token=eos,
                                   model_max_length=max_len)


def build_tiny_hidream(dest: Path, seed: int = 1234) -> None:
    """Write a tiny random HiDream-I1 pipeline directory to `dest`."""
    import torch
    from diffusers import (
        FlowMatchEulerDiscreteScheduler,
        HiDreamImagePipeline,
        HiDreamImageTransformer2DModel,
    )
    from transformers import (
        CLIPTextConfig,
        CLIPTextModelWithProjection,
        LlamaConfig,
        LlamaForCausalLM,
        T5Config,
        T5EncoderModel,
    )

    from engine.builtin.tiny_flux import _clip_tokenizer, t5_tokenizer, tiny_vae

    clip_tok, t5_tok, llama_tok = _clip_tokenizer(), t5_tokenizer(), llama_tokenizer()
    t5_tok.model_max_length = TOKENIZER_MAX_LEN
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        transformer = HiDreamImageTransformer2DModel(
            patch_size=2, in_channels=LATENT_CHANNELS, num_layers=2, num_single_layers=2, attention_head_dim=16,
            num_attention_heads=2, caption_channels=[T5_DIM, LLAMA_DIM], text_emb_dim=sum(CLIP_PROJ),
            num_routed_experts=4, num_activated_experts=2, axes_dims_rope=(8, 4, 4), max_resolution=(20, 20),
            llama_layers=LLAMA_LAYERS,
        )
        vae = tiny_vae()
        clips = [CLIPTextModelWithProjection(CLIPTextConfig(
            vocab_size=len(clip_tok), hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
            max_position_embeddings=218, projection_dim=proj, bos_token_id=0, eos_token_id=1, pad_token_id=1,
        )) for proj in CLIP_PROJ]
        t5 = T5EncoderModel(T5Config(
            vocab_size=len(t5_tok), d_model=T5_DIM, d_ff=32, d_kv=8, num_layers=2, num_heads=3,
            relative_attention_num_buckets=8, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
        ))
        llama = LlamaForCausalLM(LlamaConfig(
            vocab_size=len(llama_tok), hidden_size=LLAMA_DIM, intermediate_size=24, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=128,
            bos_token_id=llama_tok.bos_token_id, eos_token_id=llama_tok.eos_token_id,
            pad_token_id=llama_tok.eos_token_id,
        ))
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False)
    pipe = HiDreamImagePipeline(
        scheduler=scheduler, vae=vae, text_encoder=clips[0], tokenizer=clip_tok, text_encoder_2=clips[1],
        tokenizer_2=clip_tok, text_encoder_3=t5, tokenizer_3=t5_tok, text_encoder_4=llama, tokenizer_4=llama_tok,
        transformer=transformer)
    pipe.save_pretrained(dest, safe_serialization=True)
