"""What LTX-2 caches and batches: each window's video latent and, where its clip has a sound track, its audio latent,
in one cache entry (engine/families/video/cache.py's layout, with one more tensor):

    cache/latent-KEY-SHA.safetensors   latent [C, F', h, w] (+ latent_flip), audio_latent [L, C_a · M] (clips with sound)

- video: the VAE's posterior mode normalised as `LTX2Pipeline.prepare_latents` normalises given latents,
  (z − latents_mean) · scaling_factor / latents_std;
- audio: the window's sound (engine/families/video/ltx2/audio.py) as a log-mel spectrogram through the audio VAE
  (posterior mode), cut to the pipeline's audio length for the window, round(F / fps · rate / hop / 4) latent
  frames, packed [L, C_a · M] and normalised as `prepare_audio_latents` does (packed, then (z − mean) / std);
- text: the pipeline's own `encode_prompt` (Gemma's hidden states of every layer, the caption left-padded to the
  tokenizer's length, at most 1024) through its frozen `connectors`, cached as their outputs: the video and the
  audio prompt embeddings and the connectors' mask, each at that padded length (the connectors' learnable registers
  fill the padding, so the output depends on it: it is cached as the pipeline computes it).

A window's key adds the audio sample rate to the video window's key (engine/families/video/cache.py).
"""

from __future__ import annotations

from typing import Any

import torch

from engine.data.videos import VideoItem
from engine.families.image.dataset import CachedImages
from engine.families.video.cache import readable_windows
from engine.storage import cache as store

TEXT_NAMES = ("prompt_embeds", "prompt_audio_embeds", "prompt_mask")


def audio_length(frames: int, fps: float, rate: int, hop: int, factor: int) -> int:
    """The pipeline's audio latent frames for `frames` video frames at `fps` (LTX2Pipeline.__call__)."""
    return round(frames / fps * rate / hop / float(factor))


def av_need(fps: float, rate: int):
    def need(item: VideoItem, mid: str, dtype: str, flip: bool) -> tuple[str, store.Need]:
        f, w, h = item.bucket
        k = store.content_key(kind="latent", clip=item.record.sha256, start=item.start, frames=f, fps=fps,
                              bucket=[w, h], flip=flip, model=mid, dtype=dtype, audio_rate=rate)
        return k, store.Need(k, f"{item.record.rel}@{f}x{w}x{h}+{item.start}", (item, flip), label=item.record.rel)
    return need


class AVEncoder:
    """The video VAE and the audio VAE of an LTX-2 directory (opened together: both are small next to the
    transformer, and a window needs both)."""

    def __init__(self, pipe, device: torch.device, fps: float):
        self.pipe, self.device, self.fps = pipe, device, fps

    def video(self, pixels: torch.Tensor) -> torch.Tensor:
        vae = self.pipe.vae
        lat = vae.encode(pixels.to(self.device, vae.dtype)).latent_dist.mode()
        mean = vae.latents_mean.view(1, -1, 1, 1, 1).to(lat)
        std = vae.latents_std.view(1, -1, 1, 1, 1).to(lat)
        return ((lat - mean) * vae.config.scaling_factor / std)[0]

    def audio(self, item: VideoItem) -> torch.Tensor | None:
        from engine.families.video.ltx2.audio import log_mel, window_audio

        avae = self.pipe.audio_vae
        conf = avae.config
        frames = item.bucket[0]
        wave = window_audio(item.record.path, item.start / self.fps, frames / self.fps, conf.sample_rate)
        if wave is None:
            return None
        mel = log_mel(wave, conf.sample_rate, conf.mel_bins, conf.mel_hop_length)
        lat = avae.encode(mel.to(self.device, avae.dtype)).latent_dist.mode()  # [1, C, L', M]
        n = audio_length(frames, self.fps, conf.sample_rate, conf.mel_hop_length, avae.temporal_compression_ratio)
        if lat.shape[2] < n:  # the causal encoder gives (T − 1) // 4 + 1 frames: never short for T = N // hop + 1
            lat = torch.cat([lat, lat[:, :, -1:].expand(-1, -1, n - lat.shape[2], -1)], dim=2)
        packed = lat[:, :, :n].transpose(1, 2).flatten(2, 3)[0]  # [L, C · M]
        return (packed - avae.latents_mean.to(packed)) / avae.latents_std.to(packed)


def encode_av_windows(todo: list[store.Need], done: store.Done, *, open_encoder, dtype: torch.dtype, fps: float,
                      log) -> None:
    """Each window's video (and flipped) latent and its audio latent; a clip that breaks is skipped with a reason
    (engine/families/video/cache.py)."""
    enc = None
    for need, item, flip, x in readable_windows(todo, fps, log):
        enc = enc or open_encoder()
        with torch.no_grad():
            out = {"latent": enc.video(x[None]).to(dtype)}
            if flip:
                out["latent_flip"] = enc.video(x.flip(-1)[None]).to(dtype)
            sound = enc.audio(item)
            if sound is not None:
                out["audio_latent"] = sound.to(dtype)
        done(need, out)


class LTX2Dataset(CachedImages):
    """Batches of one bucket: the latents, the audio latents (zeros where a window has no sound) with `has_audio`,
    and the cached text tensors stacked as they are (one padded length) with the empty caption's. The family sets
    `audio_frames` (bucket frames → audio latent frames) and `audio_width` from its audio VAE."""

    audio_frames = staticmethod(lambda frames: 1)
    audio_width = 1

    def collate(self, indices: list[int]) -> dict[str, Any]:
        lat, batch = self.latents(indices)
        n = self.audio_frames(self.items[indices[0]].bucket[0])
        sound = [x.get("audio_latent") for x in lat]
        dtype = lat[0]["latent"].dtype
        batch["has_audio"] = torch.tensor([s is not None for s in sound])
        batch["audio_latents"] = torch.stack([s if s is not None else torch.zeros(n, self.audio_width, dtype=dtype)
                                              for s in sound])
        texts = [self.cache.load(self.plan.item_text[i]) for i in indices]
        for name in TEXT_NAMES:
            batch[name] = torch.stack([t[name] for t in texts])
            batch[f"empty_{name}"] = self.empty[name][None]
        return batch
