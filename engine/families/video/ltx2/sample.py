"""LTX-2's sample clips, with their sound: each of `sample.prompts` through `LTX2Pipeline` every
sample.every_steps, written as WORKDIR/samples/step-NNNNNNNN/NN.mp4 (H.264 and an AAC stereo track of the vocoder's
waveform at its output rate), the way engine/families/video/sample.py writes the other video families' clips.

The prompts are the cached connector outputs (engine/families/video/ltx2/data.py), so no Gemma and no connectors
load: the pipeline is handed the video and audio prompt embeddings side by side as its `prompt_embeds` and a
`CachedConnectors` in place of its connectors, which splits them back (the pipeline's only use of its connectors is
that one call on the prompt embeddings). Guidance is the pipeline's classifier-free guidance at sample.guidance for
video and sound; spatio-temporal and modality guidance are off (each would cost one more forward per step).
"""

from __future__ import annotations

import io
from pathlib import Path

import torch

from engine.families.video.sample import ClipRenderer, frames_u8


class CachedConnectors(torch.nn.Module):
    """Stands in for LTX2TextConnectors: its input is [video embeds | audio embeds] on the last axis and the
    connectors' own mask, its output (video, audio, mask) as the connectors returned them when cached."""

    def __init__(self, video_width: int):
        super().__init__()
        self.video_width = video_width
        self.register_buffer("anchor", torch.zeros(0), persistent=False)

    @property
    def device(self) -> torch.device:  # what DiffusionPipeline.device asks of each component
        return self.anchor.device

    @property
    def dtype(self) -> torch.dtype:
        return self.anchor.dtype

    def forward(self, embeds, mask, padding_side: str = "left", **_):
        return embeds[..., :self.video_width], embeds[..., self.video_width:], mask


def prompt_kwargs(emb, negative, device, dtype) -> dict:
    def one(e):
        return (torch.cat([e["prompt_embeds"], e["prompt_audio_embeds"]], dim=-1)[None].to(device, dtype),
                e["prompt_mask"][None].to(device).long())

    (pe, pm), (ne, nm) = one(emb), one(negative)
    return {"prompt_embeds": pe, "prompt_attention_mask": pm, "negative_prompt_embeds": ne,
            "negative_prompt_attention_mask": nm}


class SoundClipRenderer(ClipRenderer):
    def __init__(self, cfg, model_path: str, cache, plan, workdir: Path, *, model):
        super().__init__(cfg, model_path, cache, plan, workdir, model=model)
        self.prompt_kwargs = prompt_kwargs

    def _pipeline(self, transformer):
        if self.pipe is None:
            super()._pipeline(transformer)
            self.pipe.connectors = CachedConnectors(self.prompts[0]["prompt_embeds"].shape[-1])
        return self.pipe

    def clip(self, pipe, prompt: dict, generator: torch.Generator) -> bytes:
        """One prompt's clip with its sound track, as the MP4 file's bytes."""
        from engine.families.video.ltx2.audio import write_mp4_with_audio

        s, cfg = self.cfg.sample, self.cfg
        out = pipe(**prompt, height=s.height, width=s.width, num_frames=max(cfg.data.frames), frame_rate=cfg.data.fps,
                   num_inference_steps=s.steps, guidance_scale=s.guidance, audio_guidance_scale=s.guidance,
                   stg_scale=0.0, audio_stg_scale=0.0, modality_scale=1.0, audio_modality_scale=1.0,
                   spatio_temporal_guidance_blocks=None, generator=generator, output_type="np")
        buf = io.BytesIO()
        write_mp4_with_audio(frames_u8(out.frames[0]), buf, cfg.data.fps, out.audio[0].float().cpu().numpy(),
                             int(pipe.vocoder.config.output_sampling_rate))
        return buf.getvalue()
