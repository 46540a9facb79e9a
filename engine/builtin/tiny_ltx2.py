"""A tiny random LTX-2 pipeline, built offline: `builtin:tiny-ltx2` (declared in engine/families/video/ltx2/).

An `LTX2Pipeline` directory written with `save_pretrained` and read back by diffusers' own `from_pretrained`, every
component random with a fixed seed and shaped like the real one, only small:

- `LTX2VideoTransformer3DModel`: 2 audio-video blocks (video 2 heads × 8, audio 2 heads × 4), 4 latent channels
  for video and 2 × 2 (channels × latent mel bins) for audio, as the real 128 and 8 × 16;
- `AutoencoderKLLTX2Video`: three spatio-temporal down blocks, so 8× in space and 8× in time (the real VAE: 32× and
  8×, frames 8k + 1), 4 latent channels; per-channel latents_mean / latents_std that are not 0 / 1, so a missing
  normalisation shows;
- `AutoencoderKLLTX2Audio`: stereo log-mel input (8 mel bins, 16 kHz, hop 160), 4× down in time and mel, 2 latent
  channels, with latents_mean / latents_std of its packed width (channels × latent mel bins);
- `LTX2Vocoder` (mel → 16 kHz stereo waveform, 160× up: one hop per mel frame, as the real one);
- a 2-layer `Gemma3ForConditionalGeneration` (with a one-layer vision tower that prompt encoding never runs) and a
  Gemma tokenizer over bytes (one token per byte), captions cut at TEXT_LEN tokens (the real pipeline: 1024);
- `LTX2TextConnectors` with learnable registers (the real model's 128; here 8), so a caption's connector output is
  a function of the padded length, as it is for the real model;
- the real scheduler's settings (dynamic exponential shift, μ from 0.95 at 1024 to 2.05 at 4096 video tokens).
"""

from __future__ import annotations

from pathlib import Path

TEXT_LEN = 16
VIDEO_CHANNELS, AUDIO_CHANNELS, MEL_BINS = 4, 2, 8
TEXT_HIDDEN, TEXT_LAYERS = 32, 2


def gemma_tokenizer(max_len: int = TEXT_LEN):
    """A GemmaTokenizerFast over bytes (no merges): <pad>, <eos>, <bos>, <unk> and the 256 byte symbols."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import GemmaTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return GemmaTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                              unk_token="<unk>", model_max_length=max_len, padding_side="left")


def build_tiny_ltx2(dest: Path, seed: int = 1234) -> None:
    """Write a tiny random LTX-2 pipeline directory to `dest`."""
    import torch
    from diffusers import (
        AutoencoderKLLTX2Audio,
        AutoencoderKLLTX2Video,
        FlowMatchEulerDiscreteScheduler,
        LTX2Pipeline,
        LTX2VideoTransformer3DModel,
    )
    from diffusers.pipelines.ltx2 import LTX2TextConnectors
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    tok = gemma_tokenizer()
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        text_encoder = Gemma3ForConditionalGeneration(Gemma3Config(
            text_config={"vocab_size": len(tok), "hidden_size": TEXT_HIDDEN, "intermediate_size": 48,
                         "num_hidden_layers": TEXT_LAYERS, "num_attention_heads": 2, "num_key_value_heads": 1,
                         "head_dim": 16, "max_position_embeddings": 256, "sliding_window": 64,
                         "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2},
            vision_config={"hidden_size": 16, "intermediate_size": 16, "num_hidden_layers": 1,
                           "num_attention_heads": 2, "image_size": 16, "patch_size": 8},
            mm_tokens_per_image=4, image_token_index=3))
        connectors = LTX2TextConnectors(
            caption_channels=TEXT_HIDDEN, text_proj_in_factor=TEXT_LAYERS + 1,
            video_connector_num_attention_heads=4, video_connector_attention_head_dim=8,
            video_connector_num_layers=1, video_connector_num_learnable_registers=8,
            audio_connector_num_attention_heads=4, audio_connector_attention_head_dim=8,
            audio_connector_num_layers=1, audio_connector_num_learnable_registers=8,
            connector_rope_base_seq_len=32, rope_double_precision=False, rope_type="split")
        transformer = LTX2VideoTransformer3DModel(
            in_channels=VIDEO_CHANNELS, out_channels=VIDEO_CHANNELS, patch_size=1, patch_size_t=1,
            num_attention_heads=2, attention_head_dim=8, cross_attention_dim=16, vae_scale_factors=(8, 8, 8),
            audio_in_channels=AUDIO_CHANNELS * MEL_BINS // 4, audio_out_channels=AUDIO_CHANNELS * MEL_BINS // 4,
            audio_num_attention_heads=2, audio_attention_head_dim=4, audio_cross_attention_dim=8, num_layers=2,
            caption_channels=TEXT_HIDDEN, rope_double_precision=False, rope_type="split")
        vae = AutoencoderKLLTX2Video(
            in_channels=3, out_channels=3, latent_channels=VIDEO_CHANNELS, block_out_channels=(8, 8, 8),
            decoder_block_out_channels=(8, 8, 8), layers_per_block=(1, 1, 1, 1),
            decoder_layers_per_block=(1, 1, 1, 1), spatio_temporal_scaling=(True, True, True),
            decoder_spatio_temporal_scaling=(True, True, True), decoder_inject_noise=(False,) * 4,
            downsample_type=("spatiotemporal",) * 3, upsample_residual=(False,) * 3, upsample_factor=(1,) * 3,
            timestep_conditioning=False, patch_size=1, patch_size_t=1, encoder_causal=True, decoder_causal=False)
        vae.latents_mean.copy_(torch.randn(VIDEO_CHANNELS) * 0.3)
        vae.latents_std.copy_(torch.rand(VIDEO_CHANNELS) + 0.75)
        packed = AUDIO_CHANNELS * MEL_BINS // 4
        audio_vae = AutoencoderKLLTX2Audio(
            base_channels=packed, output_channels=2, ch_mult=(1, 1, 1), num_res_blocks=1, attn_resolutions=None,
            in_channels=2, resolution=32, latent_channels=AUDIO_CHANNELS, norm_type="pixel",
            causality_axis="height", dropout=0.0, mid_block_add_attention=False, sample_rate=16000,
            mel_hop_length=160, is_causal=True, mel_bins=MEL_BINS)
        audio_vae.latents_mean.copy_(torch.randn(packed) * 0.3)
        audio_vae.latents_std.copy_(torch.rand(packed) + 0.75)
        vocoder = LTX2Vocoder(
            in_channels=2 * MEL_BINS, hidden_channels=32, out_channels=2, upsample_kernel_sizes=[16, 10, 8],
            upsample_factors=[8, 5, 4], resnet_kernel_sizes=[3], resnet_dilations=[[1, 3, 5]],
            leaky_relu_negative_slope=0.1, output_sampling_rate=16000)
    scheduler = FlowMatchEulerDiscreteScheduler(
        use_dynamic_shifting=True, base_shift=0.95, max_shift=2.05, base_image_seq_len=1024,
        max_image_seq_len=4096, shift_terminal=0.1, time_shift_type="exponential")
    pipe = LTX2Pipeline(scheduler=scheduler, vae=vae, audio_vae=audio_vae, text_encoder=text_encoder, tokenizer=tok,
                        connectors=connectors, transformer=transformer, vocoder=vocoder)
    pipe.save_pretrained(dest, safe_serialization=True)
