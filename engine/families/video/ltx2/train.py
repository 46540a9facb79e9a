"""LTX-2's VideoFamily: the video families' loop, cache and checkpoints (engine/families/video/base.py) with a sound
track beside each window, the joint audio-video loss, and sample clips with their sound (the rules: family.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from engine.builtin.models import resolve_model_path
from engine.config.job import JobConfig
from engine.families.image.flow_lora import flip_and_drop
from engine.families.video.base import VideoFamily
from engine.families.video.ltx2.data import TEXT_NAMES, LTX2Dataset, audio_length
from engine.report.quiet import quiet_libraries


def audio_config(path: str, revision: str | None) -> dict[str, Any]:
    from diffusers import AutoencoderKLLTX2Audio

    return dict(AutoencoderKLLTX2Audio.load_config(path, subfolder="audio_vae", revision=revision))


def pack_video(x: torch.Tensor, patch: int, patch_t: int) -> torch.Tensor:
    """[B, C, F, H, W] → the transformer's tokens [B, F·H·W / patches, C·patches] (LTX2Pipeline._pack_latents)."""
    from diffusers import LTX2Pipeline

    return LTX2Pipeline._pack_latents(x, patch, patch_t)


class LTX2Family(VideoFamily):
    dataset_class = LTX2Dataset

    def fill_window_cache(self, cfg: JobConfig, items, workdir: Path, path: str, log, bar):
        """(cache, plan, report): each window's video and audio latents (both VAEs opened together, once a window
        needs encoding) and each caption's connector outputs (data.py)."""
        import functools

        from engine.families.image import cache as image_cache
        from engine.families.image.dataset import PipelineEncoder
        from engine.families.video.ltx2.data import AVEncoder, av_need, encode_av_windows
        from engine.training.dtypes import pick_device

        quiet_libraries(diffusers=True)
        self.audio = audio_config(path, cfg.model.revision)
        enc = PipelineEncoder(self.model, path, cfg)

        def open_av():
            device = pick_device()
            pipe = enc._pipeline(("vae",))  # the model's load_pipeline: with the audio VAE
            pipe.vae.to(device).eval()
            pipe.audio_vae.to(device).eval()
            return AVEncoder(pipe, device, cfg.data.fps)

        return image_cache.fill_cache(
            cfg, items, workdir, path, log, bar=bar, max_len=self.model.text_max_len(path, cfg.model.revision),
            open_image_encoder=open_av, open_text_encoder=enc.text_encoder,
            latent_need=av_need(cfg.data.fps, int(self.audio["sample_rate"])),
            encode_latents=functools.partial(encode_av_windows, fps=cfg.data.fps, log=log))

    def build_dataset(self, cfg: JobConfig, workdir: Path, log):
        dataset = super().build_dataset(cfg, workdir, log)
        a = self.audio
        dataset.audio_frames = lambda frames: audio_length(frames, cfg.data.fps, int(a["sample_rate"]),
                                                           int(a["mel_hop_length"]), 4)
        dataset.audio_width = int(a["latent_channels"]) * int(a["mel_bins"]) // 4
        return dataset

    def loss(self, model: torch.nn.Module, batch: dict[str, Any], generator: torch.Generator,
             evaluate: bool = False) -> torch.Tensor:
        """Draws from `generator`, in order: flip, caption dropout, video noise, σ, audio noise; then each sample's
        velocities, samples with sound jointly and those without isolated (family.py's docstring)."""
        cfg = self.cfg
        inner = getattr(model, "module", model)
        x0, _flip, text = flip_and_drop(batch, cfg, generator, TEXT_NAMES, draw=not evaluate)
        device = x0.device
        b, _c, f, h, w = x0.shape
        noise = torch.randn(x0.shape, generator=generator).to(device)
        patch, patch_t = inner.config.patch_size, inner.config.patch_size_t
        grid = (f // patch_t, h // patch, w // patch)
        sigma = self.model.sigmas(cfg, self.sched, b, generator, grid[0] * grid[1] * grid[2]).to(device)
        a0 = batch["audio_latents"].to(device).float()
        a_noise = torch.randn(a0.shape, generator=generator).to(device)
        v0, v_noise = pack_video(x0.float(), patch, patch_t), pack_video(noise.float(), patch, patch_t)
        s = sigma.view(-1, 1, 1)
        v_t, a_t = (1 - s) * v0 + s * v_noise, (1 - s) * a0 + s * a_noise
        has = batch["has_audio"].to(device)
        preds, order = [], []
        for rows, isolate in ((has, False), (~has, True)):
            idx = rows.nonzero().flatten()
            if idx.numel():
                preds.append(self.model.predict(model, v_t[idx], a_t[idx], sigma[idx], {k: v[idx] for k, v in
                                                text.items()}, grid, cfg.data.fps, isolate))
                order.append(idx)
        back = torch.argsort(torch.cat(order))
        pred_v = torch.cat([p[0] for p in preds])[back].float()
        pred_a = torch.cat([p[1] for p in preds])[back].float()
        loss = ((pred_v - (v_noise - v0)) ** 2).mean()
        if bool(has.any()):
            loss = loss + ((pred_a[has] - (a_noise - a0)[has]) ** 2).mean()
        return loss

    def on_step_end(self, model: torch.nn.Module, step: int, cfg: JobConfig, workdir: Path, log) -> None:
        from engine.families.image.sample import sample_due
        from engine.families.video.ltx2.sample import SoundClipRenderer

        if not sample_due(cfg, step):
            return
        if self.renderer is None:
            path = resolve_model_path(cfg.model.path, workdir)
            self.renderer = SoundClipRenderer(cfg, path, self.cache, self.plan, Path(workdir), model=self.model)
        self.renderer.render(model, step, log)
