"""Preview images during image-family training: the way people catch over-fitting early.

Every `sample.every_steps` steps each prompt in `sample.prompts` is rendered
with the LoRA as it is now, with a fixed seed per prompt (its own `seed`, or
sample.seed + i), so the images of successive steps differ only by what the
LoRA learned. Each prompt's negative prompt (its own `negative`; by default
the empty caption) is what classifier-free guidance pushes away from, in the
pipelines that take one. The prompt and
negative embeddings were computed with the captions (engine/families/image/cache.py), so no
text encoder is loaded during training; the VAE decoder is loaded at the first
render and kept.

Files: WORKDIR/samples/step-NNNNNNNN/NN.png, each written atomically; a
`samples` event lists the paths (what `lorad status ID` shows). An edit job's
prompt may name its control image(s) (`control`): the edit pipeline renders
from them, and the event lists them beside the prompts.

Rendering must not change training: it runs under `torch.random.fork_rng`
with its own generators, in eval mode and without gradients, and puts the
model back in train mode.
"""

from __future__ import annotations

import inspect
import io
from pathlib import Path

import torch

from engine.report.once import Once
from engine.storage.fsio import RealFs, ensure_dir_durable, write_file_durable
from engine.training.dtypes import torch_dtype


def sample_due(cfg, step: int) -> bool:
    """Whether preview images are rendered after optimizer step `step`."""
    every = cfg.sample.every_steps
    return bool(every and cfg.sample.prompts and step % every == 0)


class SampleRenderer:
    """Renders `sample.prompts` with the LoRA as it is (the image families call it every sample.every_steps).

    `pipeline(transformer)` builds the family's pipeline without text encoders (default: FLUX.1's);
    `prompt_kwargs(embedding, negative, device, dtype)` turns one cached prompt and its negative into that
    pipeline's arguments.
    """

    def __init__(self, cfg, model_path: str, cache, plan, workdir: Path, fs=None, pipeline=None, prompt_kwargs=None):
        self.cfg, self.model_path, self.workdir = cfg, model_path, Path(workdir)
        self.fs = fs or RealFs()
        # Prompt embeddings are read now, once, from the cache filled before training.
        self.prompts = [cache.load(k) for k in plan.prompt_texts]
        self.negatives = [cache.load(k) for k in plan.negative_texts]
        self.entries = cfg.sample.entries()
        self.controls = cfg.sample.controls()  # an edit job's control images per prompt ([] for none)
        self.warned = Once()
        self.pipe = None
        self.build_pipeline = pipeline or self._flux_pipeline
        self.prompt_kwargs = prompt_kwargs or self._flux_prompt_kwargs

    def _pipeline(self, transformer):
        if self.pipe is None:
            self.pipe = self.build_pipeline(transformer)
            self.pipe.set_progress_bar_config(disable=True)
        self.pipe.transformer = transformer
        return self.pipe

    @staticmethod
    def _flux_prompt_kwargs(emb, negative, device, dtype) -> dict:
        # FLUX.1-dev samples with its distilled guidance, no negative prompt (a job giving one is refused).
        return {"prompt_embeds": emb["prompt_embeds"][None].to(device, dtype),
                "pooled_prompt_embeds": emb["pooled"][None].to(device, dtype)}

    def _flux_pipeline(self, transformer):
        from diffusers import (
            AutoencoderKL,
            FlowMatchEulerDiscreteScheduler,
            FluxKontextPipeline,
            FluxPipeline,
        )

        rev = self.cfg.model.revision
        vae = AutoencoderKL.from_pretrained(self.model_path, subfolder="vae", revision=rev,
                                            dtype=torch_dtype(self.cfg.model.dtype))
        sched = FlowMatchEulerDiscreteScheduler.from_pretrained(self.model_path, subfolder="scheduler", revision=rev)
        # An edit job on FLUX.1 is a Kontext base (engine/config/controls.py): its pipeline takes the control.
        cls = FluxKontextPipeline if self.cfg.data.control_path is not None else FluxPipeline
        return cls(scheduler=sched, vae=vae.to(transformer.device), text_encoder=None, tokenizer=None,
                   text_encoder_2=None, tokenizer_2=None, transformer=transformer)

    def render(self, transformer: torch.nn.Module, step: int, log) -> list[Path]:
        s = self.cfg.sample
        out_dir = self.workdir / "samples" / f"step-{step:08d}"
        ensure_dir_durable(self.fs, out_dir)
        pipe = self._pipeline(transformer)
        accepted = inspect.signature(pipe.__call__).parameters
        device = transformer.device
        paths, shown = [], []  # shown: per prompt, the control images as rendered from (for the dashboard)
        was_training = transformer.training
        transformer.eval()
        devices = [torch.cuda.current_device()] if device.type == "cuda" else []
        try:
            with torch.random.fork_rng(devices=devices), torch.no_grad():
                for i, (emb, neg, (_text, negative, seed)) in enumerate(zip(self.prompts, self.negatives,
                                                                            self.entries, strict=True)):
                    # The supervisor counts any event as a heartbeat: one per prompt keeps a long list of prompts
                    # (each one far shorter than the hang timeout) from looking like a hung trainer.
                    log.info("heartbeat", phase="samples", step=step, prompt=i, prompts=len(self.prompts))
                    gen = torch.Generator(device="cpu").manual_seed(seed)
                    # Only what this pipeline takes (FLUX.2 dev has no negative prompt, klein no guidance embedding).
                    kwargs = {k: v for k, v in self.prompt_kwargs(emb, neg, device, transformer.dtype).items()
                              if k in accepted}
                    if negative and not any(k.startswith("negative_") for k in kwargs) and self.warned.first(i):
                        log.warning("sample_negative_ignored", prompt=i,
                                    message=f"sample.prompts[{i}]: this model's pipeline takes no negative prompt; "
                                            f"rendered without it")
                    if self.controls[i] and "image" in accepted:  # an edit model's input image(s)
                        kwargs["image"] = control_input(self.controls[i], (s.width, s.height))
                        shown.append(self._write_controls(out_dir, i, kwargs["image"]))
                    else:
                        shown.append([])
                    if self.cfg.data.control_path is not None:
                        # Kontext: the sample's size, not its ~1 MP default, and the control not resized to its
                        # preferred resolutions (training's controls are at their target's size too)
                        kwargs.update({k: v for k, v in (("max_area", s.width * s.height), ("_auto_resize", False))
                                       if k in accepted})
                    image = pipe(
                        **kwargs,
                        height=s.height,
                        width=s.width,
                        num_inference_steps=s.steps,
                        # Qwen-Image 2.1's pipeline has no guidance_scale (its sample_kwargs name its true_cfg_scale).
                        **({"guidance_scale": s.guidance} if "guidance_scale" in accepted else {}),
                        generator=gen,
                        output_type="pil",
                    ).images[0]
                    buf = io.BytesIO()
                    image.save(buf, format="PNG")
                    path = out_dir / f"{i:02d}.png"
                    write_file_durable(self.fs, path, buf.getvalue())
                    paths.append(path)
        finally:
            transformer.train(was_training)
        # The control files named, and their fitted copies beside the samples (the dashboard shows those).
        controls = {"controls": self.controls, "control_images": shown} if any(self.controls) else {}
        log.info("samples", step=step, paths=[str(p) for p in paths], prompts=[p for p, _n, _s in self.entries],
                 **controls)
        return paths

    def _write_controls(self, out_dir: Path, i: int, image) -> list[str]:
        """NN-control-J.png: prompt NN's control images as the pipeline got them, written atomically."""
        out = []
        for j, im in enumerate(image if isinstance(image, list) else [image]):
            buf = io.BytesIO()
            im.save(buf, format="PNG")
            path = out_dir / f"{i:02d}-control-{j}.png"
            write_file_durable(self.fs, path, buf.getvalue())
            out.append(str(path))
        return out


def control_input(files: list[str], size: tuple[int, int]):
    """A sample prompt's control images as the edit pipelines take them: one image (Kontext), or a list (FLUX.2's
    references, one per slot); each resized to cover the sample's size and centre-cropped to it, as training
    fits a control to its target's bucket."""
    from engine.data.images import load_for_bucket

    images = [load_for_bucket(f, size) for f in files]
    return images[0] if len(images) == 1 else images
