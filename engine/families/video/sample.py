"""Sample clips during video training: each of `sample.prompts` rendered as an MP4 every sample.every_steps.

The image families' SampleRenderer (engine/families/image/sample.py) does the rest as for images: cached prompt
and negative embeddings (no text encoder loaded), a fixed seed per prompt, its own generators under
`torch.random.fork_rng` (training stays bit-identical), eval mode and no gradients. A clip has max(data.frames)
frames at sample.width × sample.height, plays at data.fps, and is written atomically as
WORKDIR/samples/step-NNNNNNNN/NN.mp4 (H.264, yuv420p: what browsers play); the `samples` event lists them.
Samples are text-to-video (an i2v job samples t2v: there is no conditioning image to give).
"""

from __future__ import annotations

import inspect
import io
from pathlib import Path

import numpy as np
import torch

from engine.families.image.sample import SampleRenderer
from engine.storage.fsio import ensure_dir_durable, write_file_durable


def clip_bytes(frames, fps: float) -> bytes:
    """An MP4 of uint8 frames [F, H, W, 3]."""
    from engine.data.clip_files import write_mp4

    buf = io.BytesIO()
    write_mp4(frames, buf, fps)
    return buf.getvalue()


class ClipRenderer(SampleRenderer):
    """SampleRenderer for a VideoModel: the model's own pipeline, clips out."""

    def __init__(self, cfg, model_path: str, cache, plan, workdir: Path, *, model):
        super().__init__(cfg, model_path, cache, plan, workdir,
                         pipeline=lambda t: model.sample_pipeline(model_path, cfg, t),
                         prompt_kwargs=lambda emb, neg, dev, dt: model.sample_kwargs(emb, neg, dev, dt, cfg))

    def _pipeline(self, transformer):
        # The pipeline holds the training transformer(s) from the start: nothing to swap in afterwards.
        if self.pipe is None:
            self.pipe = self.build_pipeline(transformer)
            self.pipe.set_progress_bar_config(disable=True)
        return self.pipe

    def render(self, transformer: torch.nn.Module, step: int, log) -> list[Path]:
        out_dir = self.workdir / "samples" / f"step-{step:08d}"
        ensure_dir_durable(self.fs, out_dir)
        pipe = self._pipeline(transformer)
        device, paths = transformer.device, []
        was_training = transformer.training
        transformer.eval()
        devices = [torch.cuda.current_device()] if device.type == "cuda" else []
        try:
            with torch.random.fork_rng(devices=devices), torch.no_grad():
                for i, (emb, neg, (_text, _negative, seed)) in enumerate(zip(self.prompts, self.negatives,
                                                                             self.entries, strict=True)):
                    log.info("heartbeat", phase="samples", step=step, prompt=i, prompts=len(self.prompts))
                    prompt = self.prompt_kwargs(emb, neg, device, transformer.dtype)
                    clip = self.clip(pipe, prompt, torch.Generator(device="cpu").manual_seed(seed))
                    path = out_dir / f"{i:02d}.mp4"
                    write_file_durable(self.fs, path, clip)
                    paths.append(path)
        finally:
            transformer.train(was_training)
        log.info("samples", step=step, paths=[str(p) for p in paths], prompts=[p for p, _n, _s in self.entries])
        return paths

    def clip(self, pipe, prompt: dict, generator: torch.Generator) -> bytes:
        """One prompt's clip, as the MP4 file's bytes."""
        s, cfg = self.cfg.sample, self.cfg
        kwargs = {**prompt, "height": s.height, "width": s.width, "num_frames": max(cfg.data.frames),
                  "num_inference_steps": s.steps, "guidance_scale": s.guidance, "generator": generator,
                  "output_type": "np"}
        # Only what the pipeline takes: HunyuanVideo's guidance is its guider's (sample_pipeline).
        accepted = inspect.signature(pipe.__call__).parameters
        video = pipe(**{k: v for k, v in kwargs.items() if k in accepted}).frames[0]
        return clip_bytes(frames_u8(video), cfg.data.fps)


def frames_u8(video) -> np.ndarray:
    """A pipeline's float frames in [0, 1] as the uint8 frames a clip is written from."""
    return (np.clip(np.asarray(video, dtype=np.float32), 0, 1) * 255).round().astype(np.uint8)
