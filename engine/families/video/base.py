"""The video families' shared half: the image families' base (engine/families/image/base.py) with frames as one
more axis — one `VideoFamily`.

What is the same as for images, and shared with them: the loop, checkpoints and exact resume (engine/recipe.py),
the content-keyed cache and its text entries, the single-bucket batch order (engine/data/images.py's BucketOrder
over (frames, width, height) buckets), caption dropout and flip, the σ sampling (train.timestep_sampling, with
`shift` the model scheduler's own static shift), the frozen transformer with its LoRA, fp8 and block swapping.

What differs:

- data: clips and stills cut into windows (engine/data/videos.py), each window's latent [C, F', h, w] cached
  (engine/families/video/cache.py); a window whose clip breaks while caching is left out with a reason;
- the loss: rectified flow on 5-D latents, x_σ = (1 − σ)·x0 + σ·ε, target ε − x0, MSE over every latent element
  the model predicts (with the model's `loss_mask`: i2v leaves out the clean first frame);
- the transformer may be two (Wan 2.2 A14B's experts): the VideoModel's `route` sends each sample to the expert
  that owns its σ (engine/families/video/experts.py);
- samples are clips (engine/families/video/sample.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from engine.builtin.models import resolve_model_path
from engine.config.job import JobConfig
from engine.errors import JobInvalid
from engine.families.image.base import ImageFamily
from engine.families.image.dataset import CachedImages, PipelineEncoder, pad_texts
from engine.families.image.flow_lora import flip_and_drop, scheduler_settings
from engine.report.quiet import quiet_libraries


def mask_name(name: str) -> str:
    """The mask of a cached text tensor: prompt_embeds → prompt_mask, prompt_embeds_2 → prompt_mask_2."""
    return name.replace("_embeds", "_mask")


def model_multiple(cfg: JobConfig, path: str) -> int:
    """The spatial multiple of the base at path (engine/registry/families.py). A hub id's configs are fetched first
    where the family reads them (the trainer downloads the base anyway): a TI2V-5B from the Hub gets its 32, not
    Wan's reference 16; offline, the reference's, and the base's own load says what is wrong."""
    from engine.registry.families import families, spatial_multiple

    if families()[cfg.model.family].spatial_rule is not None and not Path(path).is_dir():
        try:
            from huggingface_hub import snapshot_download

            path = snapshot_download(path, revision=cfg.model.revision, allow_patterns=["*/config.json"])
        except OSError:
            pass
    return spatial_multiple(cfg.model.family, path)


class VideoDataset(CachedImages):
    """Batches of one bucket: the windows' latents, and each cached text tensor (Wan: prompt_embeds; HunyuanVideo:
    prompt_embeds and the glyph encoder's prompt_embeds_2) padded to the batch's longest (at least one token), with
    its mask and the empty caption's (caption dropout)."""

    def collate(self, indices: list[int]) -> dict[str, Any]:
        _lat, batch = self.latents(indices)
        texts = [self.cache.load(self.plan.item_text[i]) for i in indices]
        for name, empty in self.empty.items():
            length = max(1, empty.shape[0], *(t[name].shape[0] for t in texts))
            batch[name], batch[mask_name(name)] = pad_texts([t[name] for t in texts], length)
            batch[f"empty_{name}"], batch[f"empty_{mask_name(name)}"] = pad_texts([empty], length)
        return batch


class VideoFamily(ImageFamily):
    """The Family protocol for a diffusers flow-matching video model (a VideoModel: engine/families/video/wan/family.py)."""

    dataset_class = VideoDataset

    # ---------------------------------------------------------------- data
    def prepare(self, cfg: JobConfig, workdir: Path, log, bar=None) -> None:
        """Scan the clips, cut them into windows and make the latent/text cache complete (encoders freed after);
        data.validation's windows come after the training ones (items[n_train:]), cached the same way."""
        from engine.data.videos import make_video_items

        quiet_libraries(diffusers=True)
        self.cfg = cfg
        path = resolve_model_path(cfg.model.path, workdir)
        self.records, held = self.scan_records(cfg, workdir, log)
        multiple = model_multiple(cfg, path)
        items = make_video_items(self.records, cfg.data.resolution, cfg.data.frames, multiple)
        n_items = len(items)
        if held:
            items += make_video_items(held, cfg.data.resolution, cfg.data.frames, multiple)
        cache, plan, self.report = self.fill_window_cache(cfg, items, workdir, path, log, bar)
        # Windows whose clip broke while caching have no entry: they are left out (cache.py's docstring).
        keep = [i for i, k in enumerate(plan.item_latent) if cache.verify(k) is None]
        plan.item_latent = [plan.item_latent[i] for i in keep]
        plan.item_text = [plan.item_text[i] for i in keep]
        self.items, self.cache, self.plan = [items[i] for i in keep], cache, plan
        self.n_train = sum(i < n_items for i in keep)
        if not self.n_train:
            raise JobInvalid(f"data.path: no window of any clip in {cfg.data.path} could be decoded")
        if held and self.n_train == len(self.items):
            raise JobInvalid("data.validation: no window of its clips could be decoded (or none is as long as "
                             "data.frames); give it clips of at least one window")

    def scan_records(self, cfg: JobConfig, workdir: Path, log) -> tuple[list, list]:
        """(training records, validation records): data.path's clips and stills (near-duplicates handled and
        captions written first), and data.validation's — whole clips of data.path held out by train.seed
        (engine/training/heldout.py), or the clips of its own path, captioned by their files."""
        from engine.data.videos import scan_videos

        records = scan_videos(Path(cfg.data.path), cfg.data.fps, cfg.data.caption_ext, cfg.data.trigger, log)
        if cfg.data.dedupe_mode != "off":  # near-duplicate clips by their sampled frames (engine/captioning/dedupe.py)
            from engine.captioning.dedupe import dedupe_records

            records = dedupe_records(cfg.data.dedupe_mode, records, log, cfg.data.fps)
        if cfg.data.caption_mode != "files":  # captions from sampled frames, before the cache (engine/captioning/)
            from engine.captioning.stage import caption_records

            records = caption_records(cfg, records, workdir, log)
        val = cfg.data.validation
        if val is None:
            return records, []
        if val.fraction is not None:
            from engine.training.heldout import holdout

            train, held = holdout(len(records), val.fraction, cfg.train.seed)
            return [records[i] for i in train], [records[i] for i in held]
        return records, scan_videos(Path(val.path), cfg.data.fps, cfg.data.caption_ext, cfg.data.trigger, log,
                                     key="data.validation.path")

    def fill_window_cache(self, cfg: JobConfig, items, workdir: Path, path: str, log, bar):
        """(cache, plan, report): each window's latent and each caption's embeddings, encoded where missing (a
        family with more per window overrides it: LTX-2's sound)."""
        from engine.families.video.cache import fill_video_cache

        enc = PipelineEncoder(self.model, path, cfg)
        return fill_video_cache(
            cfg, items, workdir, path, log, bar=bar, max_len=self.model.text_max_len(path, cfg.model.revision),
            open_video_encoder=enc.image_encoder, open_text_encoder=enc.text_encoder)

    def build_dataset(self, cfg: JobConfig, workdir: Path, log):
        from engine.data.images import BucketOrder

        if self.cache is None:
            self.prepare(cfg, workdir, log)
        train = self.items[:self.n_train]  # the rest are data.validation's windows
        order = BucketOrder(train, cfg.train.batch_size, cfg.data.repeats, cfg.train.seed)
        log.info("dataset", clips=sum(not r.still for r in self.records), stills=sum(r.still for r in self.records),
                 windows=len(train), samples_per_epoch=len(order),
                 buckets=sorted({"{}x{}x{}".format(*it.bucket) for it in train}),
                 captions_missing=sum(r.caption_missing for r in self.records),
                 validation=len(self.items) - len(train))
        self.dataset = self.dataset_class(self.items, order, self.cache, self.plan)
        return self.dataset

    # ---------------------------------------------------------------- model
    def load_model(self, cfg: JobConfig, workdir: Path, device: torch.device, log) -> torch.nn.Module:
        self.cfg = cfg
        path = resolve_model_path(cfg.model.path, workdir)
        self.sched = scheduler_settings(path, cfg.model.revision)
        return self.model.load(path, cfg, device, log)

    def loss(self, model: torch.nn.Module, batch: dict[str, Any], generator: torch.Generator,
             evaluate: bool = False) -> torch.Tensor:
        """Draws from `generator`, in order: flip, caption dropout, noise, σ (the model's `sigmas`, which keep an
        expert's side of the boundary); then the model's prediction, each sample by the transformer owning its σ."""
        cfg = self.cfg
        conds = tuple(k for k in batch if k.startswith("prompt_"))
        x0, _flip, text = flip_and_drop(batch, cfg, generator, conds, draw=not evaluate)
        device = x0.device
        noise = torch.randn(x0.shape, generator=generator).to(device)
        sigma = self.model.sigmas(cfg, self.sched, x0.shape[0], generator).to(device)
        x0, noise = x0.float(), noise.float()
        s = sigma.view(-1, *[1] * (x0.dim() - 1))
        x_t = (1 - s) * x0 + s * noise
        x_t, mask = self.model.condition(x_t, x0, cfg)
        pred = self.model.predict(model, x_t, sigma, text, cfg)
        err = (pred.float() - (noise - x0)) ** 2
        if mask is None:
            return err.mean()
        return (err * mask).sum() / (mask.expand_as(err).sum()).clamp(min=1)

    # ---------------------------------------------------------------- samples and export
    def on_step_end(self, model: torch.nn.Module, step: int, cfg: JobConfig, workdir: Path, log) -> None:
        from engine.families.image.sample import sample_due
        from engine.families.video.sample import ClipRenderer

        if not sample_due(cfg, step):
            return
        if self.renderer is None:
            path = resolve_model_path(cfg.model.path, workdir)
            self.renderer = ClipRenderer(cfg, path, self.cache, self.plan, Path(workdir), model=self.model)
        self.renderer.render(model, step, log)
