"""LTX-2 LoRA: diffusers `LTX2VideoTransformer3DModel`, the joint audio-video transformer, trained by flow matching
on cached clip windows and their sound, through diffusers' `LTX2Pipeline` and its components.

What is LTX-2's own:

- Data (engine/families/video/ltx2/data.py): each window's video latent and, where its clip has a sound track, its
  audio latent (the track through PyAV, a log-mel spectrogram, the audio VAE: ltx2/audio.py); the captions through
  Gemma and the frozen text connectors, cached as the connectors' video and audio prompt embeddings.
- Noise, as `LTX2Pipeline` and LTX-2's own trainer (ltx-trainer's text-to-video strategy) define it: one σ per
  sample for both modalities, x_σ = (1 − σ)·x0 + σ·ε on the packed tokens ([B, F'·h·w, C] video, [B, L, C_a·M]
  audio), target ε − x0 (the transformer predicts the velocity; the pipeline's scheduler steps with it). The
  transformer takes t = σ · 1000 (the scheduler's timesteps) as `timestep` and `sigma`, as the pipeline passes
  them. `shift` sampling uses the pipeline's resolution-dependent shift, e^μ with μ from `calculate_shift` over the
  window's video tokens and the scheduler's base_shift / max_shift.
- Loss: the video MSE over every video latent element, plus, for the samples whose window has sound, the audio
  MSE over their audio latents (ltx-trainer's video_loss + audio_loss). A window without sound runs with
  `isolate_modalities` (the transformer's audio-to-video and video-to-audio attention off), so the video branch
  learns from the clip alone and the audio branch gets no gradient from it; a batch that mixes the two runs as two
  forwards, each sample in its own.
- LoRA targets: the attention q/k/v/out of every block (video self and text attention, audio self and text
  attention, audio-to-video and video-to-audio) and both feed-forwards: the audio branch's LoRA is the `audio_*`
  and `video_to_audio_attn` modules.
- Samples: clips with their sound (the pipeline's vocoder output muxed as AAC: ltx2/audio.py).
- Export: the diffusers file (`transformer.<path>`, alpha / r folded; `LTX2Pipeline.load_lora_weights` reads it)
  and `ltx2_lora_comfyui.safetensors` in the names of the original LTX-2 checkpoint, which ComfyUI's LTX-2 model
  (comfy/ldm/lightricks/av_model.py: `BasicAVTransformerBlock` with attn1, audio_attn1, attn2, audio_attn2,
  audio_to_video_attn, video_to_audio_attn, each a CrossAttention of to_q / to_k / to_v / to_out.0, and ff /
  audio_ff, each a FeedForward of net.0.proj / net.2) has under `transformer_blocks.N`:

      diffusion_model.transformer_blocks.N.<attn>.to_q|to_k|to_v|to_out.0  ← transformer_blocks.N.<attn>.(same)
      diffusion_model.transformer_blocks.N.<ff>.net.0.proj|net.2            ← transformer_blocks.N.<ff>.(same)
      <attn>: attn1 audio_attn1 attn2 audio_attn2 audio_to_video_attn video_to_audio_attn; <ff>: ff audio_ff
      each with .lora_A.weight [r, in] and .lora_B.weight [out, r], alpha / r folded into lora_B, no .alpha

  How ComfyUI reads it (comfy/lora.py): `model_lora_keys_unet` maps `diffusion_model.<name>` to the model weight
  `diffusion_model.<name>.weight` for every weight the model has (its generic rule), and `load_lora` takes
  `<key>.lora_B.weight` as up and `<key>.lora_A.weight` as down; with no `.alpha` the scale is 1, the trained
  strength. The block names are the same in diffusers (its converter `_convert_non_diffusers_ltx2_lora_to_diffusers`
  renames only modules outside the blocks: patchify_proj, adaln_single, q_norm, ...), so diffusers' own
  `load_lora_weights` reads this file too; it refuses `.alpha` keys (no "lora" in their names), hence the fold. A
  target outside these rules is refused before training when output.formats has comfyui. That ComfyUI's loader
  applies the file is read from its sources, not run: this tree holds no ComfyUI (unverified there).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from engine.config.job import JobConfig
from engine.errors import JobInvalid
from engine.families.image.export import folded_comfyui_file, output_files
from engine.families.image.flow_lora import load_lora_transformer, sample_sigmas

_ATTN = r"(attn1|audio_attn1|attn2|audio_attn2|audio_to_video_attn|video_to_audio_attn)\.(to_q|to_k|to_v|to_out\.0)"
_FF = r"(ff|audio_ff)\.net\.(0\.proj|2)"
DEFAULT_TARGETS = rf"^transformer_blocks\.\d+\.({_ATTN}|{_FF})$"
AUDIO_BRANCH = r"\.(audio_attn1|audio_attn2|video_to_audio_attn|audio_ff)\."
FP8_SKIP = (r"^(proj_in|audio_proj_in|time_embed|audio_time_embed|av_cross_attn_\w+|caption_projection"
            r"|audio_caption_projection|prompt_adaln|audio_prompt_adaln|norm_out|audio_norm_out|proj_out"
            r"|audio_proj_out|scale_shift_table|audio_scale_shift_table)(\.|$)")
COMFYUI_FILE = "ltx2_lora_comfyui.safetensors"


def comfyui_name(module: str) -> str:
    """The original LTX-2 (ComfyUI) name of a diffusers module path: the same path, inside the blocks only."""
    if re.match(DEFAULT_TARGETS, module):
        return module
    raise ValueError(f"no ComfyUI name for LTX-2 module {module!r}")


class LTX2Model:
    """The LTX-2 half of a VideoFamily (see the module docstring)."""

    name = "ltx2"
    default_targets = DEFAULT_TARGETS
    fp8_skip = FP8_SKIP

    def transformer_class(self) -> type:
        from diffusers import LTX2VideoTransformer3DModel

        return LTX2VideoTransformer3DModel

    def text_max_len(self, model_path: str, revision: str | None) -> int:
        from engine.families.image.model import tokenizer_text_len

        return tokenizer_text_len(model_path, revision, 1024)

    def encode_text(self, pipe, text: str, max_len: int, device: torch.device) -> dict[str, torch.Tensor]:
        embeds, mask, _n, _m = pipe.encode_prompt(text, do_classifier_free_guidance=False,
                                                  max_sequence_length=max_len, device=device)
        side = getattr(pipe.tokenizer, "padding_side", "left")
        video, audio, out_mask = pipe.connectors(embeds, mask, padding_side=side)
        return {"prompt_embeds": video[0], "prompt_audio_embeds": audio[0], "prompt_mask": out_mask[0].float()}

    def load_pipeline(self, model_path: str, revision: str | None, dtype: torch.dtype, keep: tuple[str, ...]):
        """The pipeline with the `keep` components (and the connectors with the text encoder, both audio and video
        VAEs with the VAE); the others are left out, their configs read where __init__ needs them."""
        from diffusers import DiffusionPipeline

        from engine.families.image.dataset import pipeline_components

        keep = keep + (("connectors",) if "text_encoder" in keep else ()) + (("audio_vae",) if "vae" in keep else ())
        names = pipeline_components(DiffusionPipeline.load_config(model_path, revision=revision))
        drop: dict[str, Any] = {k: None for k in names if not k.startswith(("scheduler", *keep))}
        return DiffusionPipeline.from_pretrained(model_path, revision=revision, dtype=dtype, **drop)

    # ---------------------------------------------------------------- the transformer
    def load(self, path: str, cfg: JobConfig, device: torch.device, log) -> torch.nn.Module:
        model = load_lora_transformer(self.transformer_class(), path, cfg, device, log, fp8_skip=FP8_SKIP,
                                      default_targets=DEFAULT_TARGETS)
        if "comfyui" in cfg.output.formats:  # refused now, not when the finished LoRA is exported
            for name, mod in model.named_modules():
                if "default" in getattr(mod, "lora_A", {}) and not re.match(DEFAULT_TARGETS, name):
                    raise JobInvalid(f"lora.targets: {name} has no name in ComfyUI's LTX-2 model (its file takes "
                                     "the attention and feed-forward linears of the blocks); leave it out or write "
                                     "output.formats: [diffusers]")
        return model

    def sigmas(self, cfg: JobConfig, sched: dict[str, Any], batch: int, generator: torch.Generator,
               tokens: int) -> torch.Tensor:
        from diffusers.pipelines.ltx2.pipeline_ltx2 import calculate_shift

        shift = 1.0
        if cfg.train.timestep_sampling == "shift":
            mu = calculate_shift(tokens, sched.get("base_image_seq_len", 1024), sched.get("max_image_seq_len", 4096),
                                 sched.get("base_shift", 0.95), sched.get("max_shift", 2.05))
            shift = float(torch.tensor(mu, dtype=torch.float64).exp())
        return sample_sigmas(cfg.train.timestep_sampling, batch, shift, generator, cfg.train.timestep_bias)

    def predict(self, model, video: torch.Tensor, audio: torch.Tensor, sigma: torch.Tensor,
                text: dict[str, torch.Tensor], grid: tuple[int, int, int], fps: float, isolate: bool):
        """(video, audio) velocities of packed tokens, as LTX2Pipeline.__call__ calls the transformer."""
        inner = getattr(model, "module", model)
        dtype, device = inner.dtype, video.device
        t = (sigma * 1000.0).to(dtype)
        f, h, w = grid
        mask = text["prompt_mask"].to(device)
        return model(hidden_states=video.to(dtype), audio_hidden_states=audio.to(dtype),
                     encoder_hidden_states=text["prompt_embeds"].to(device, dtype),
                     audio_encoder_hidden_states=text["prompt_audio_embeds"].to(device, dtype), timestep=t, sigma=t,
                     encoder_attention_mask=mask, audio_encoder_attention_mask=mask, num_frames=f, height=h,
                     width=w, fps=fps, audio_num_frames=audio.shape[1], isolate_modalities=isolate,
                     use_cross_timestep=True, return_dict=False)

    # ---------------------------------------------------------------- samples and export
    def sample_pipeline(self, model_path: str, cfg: JobConfig, model):
        from diffusers import LTX2Pipeline

        from engine.training.dtypes import torch_dtype

        pipe = LTX2Pipeline.from_pretrained(model_path, revision=cfg.model.revision, text_encoder=None,
                                            tokenizer=None, connectors=None, transformer=model,
                                            dtype=torch_dtype(cfg.model.dtype))
        for part in (pipe.vae, pipe.audio_vae, pipe.vocoder):
            part.to(model.device)
        return pipe

    def export(self, model, cfg: JobConfig, out_dir: Path, meta: dict[str, Any]) -> list[str]:
        return output_files(model, cfg, out_dir, meta, lambda md: folded_comfyui_file(
            model, cfg, out_dir, md, COMFYUI_FILE, "ltx2", comfyui_name))


def LTX2():  # noqa: N802 - reads as the family's class at get_family's call site
    from engine.families.video.ltx2.train import LTX2Family

    return LTX2Family(LTX2Model())
