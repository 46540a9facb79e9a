"""SDXL LoRA: diffusers `UNet2DConditionModel` trained by DDPM noise prediction (epsilon or v) on cached latents.

What is SDXL's own, all through diffusers' `StableDiffusionXLPipeline`:

- Latents: its `AutoencoderKL` (8x down, 4 channels), the posterior mode times the VAE's `scaling_factor`
  (0.13025), as the pipeline's img2img sibling prepares them (the cache keeps the mode, as the other families do).
  A VAE that says `force_upcast` encodes in float32 when the job's dtype is float16 (SDXL's VAE overflows in fp16).
- Text: the pipeline's `encode_prompt` — both CLIP encoders' penultimate hidden states side by side (77 tokens,
  768 + 1280 wide) and the second encoder's pooled, projected embedding (1280), cached per caption as
  `prompt_embeds` / `pooled_prompt_embeds`. The text encoders are frozen and never loaded while training; with
  lora.text_encoder they train too, and the cache holds token ids instead (text.py).
- Size and crop conditioning (the UNet's `add_time_ids`): per sample the image's original (height, width), the
  top-left corner of its centre crop in the resized image (engine/data/images.py's cover_crop: the crop's own
  arithmetic, mirrored with data.flip), and the bucket's (height, width) — what the pipeline passes as
  original_size, crops_coords_top_left and target_size.
- Noise schedule: DDPM over the model's own scheduler config (its betas, 1000 steps). model.prediction: epsilon
  (target ε) or v (target v = √ᾱ·ε − √(1 − ᾱ)·x0) with the betas rescaled to zero terminal SNR (diffusers'
  rescale_betas_zero_snr): the last step is pure noise, as v-prediction bases (NoobAI-XL v-pred) are trained.
  Unset, it is the scheduler config's prediction_type. x_t = √ᾱ_t·x0 + √(1 − ᾱ_t)·ε; the loss is the MSE on the
  target (masks and regularisation weights as the other image families: masked_loss.py).
- Timesteps: t = ⌊u·1000⌋ with u from train.timestep_sampling (linear: uniform, kohya's default; sigmoid:
  logit-normal, weighted to the middle) and train.timestep_bias. `shift` is a flow-matching schedule: refused.
- LoRA targets (DEFAULT_TARGETS): attention to_q / to_k / to_v / to_out.0 of every transformer block (self and
  cross); lora.targets may add the resnets' conv1 / conv2 / conv_shortcut and the samplers (LoCon), which both
  files carry. Files and their key rules: export.py.

Every random draw comes from the checkpointed generator, in this order: flip, caption dropout, noise, u.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from engine.builtin.models import resolve_model_path
from engine.config.job import JobConfig
from engine.errors import JobInvalid
from engine.families.image.dataset import CachedImages, ImageData, PipelineEncoder, scan_images
from engine.families.image.dop import with_preservation
from engine.families.image.flow_lora import flip_and_drop, load_lora_transformer, sample_sigmas
from engine.families.image.masked_loss import batch_flow_loss
from engine.families.image.sdxl.single_file import diffusers_dir
from engine.families.image.sdxl.text import (
    IDS,
    TOKENS_KIND,
    SDXLWithText,
    load_text_encoders,
    open_tokenizers,
    parts,
)
from engine.report.quiet import quiet_libraries
from engine.training.dtypes import torch_dtype

DEFAULT_TARGETS = r"^.*transformer_blocks\.\d+\.attn[12]\.(to_q|to_k|to_v|to_out\.0)$"
FP8_SKIP = r"^(conv_in|conv_out|time_embedding|add_embedding)(\.|$)"
TEXT_LEN = 77  # both CLIP tokenizers' length
VAE_FACTOR = 8
CONDS = ("prompt_embeds", "pooled_prompt_embeds")


def size_and_crop(record, bucket: tuple[int, int]) -> tuple[list[int], list[int]]:
    """([orig h, orig w, crop top, crop left], the same mirrored) for an image at its (w, h) bucket: cover_crop's
    resize and centre crop (engine/data/images.py), so the crop corner is the one the latent was cut at."""
    w, h = bucket
    scale = max(w / record.width, h / record.height)
    size = (max(w, round(record.width * scale)), max(h, round(record.height * scale)))
    left, top = (size[0] - w) // 2, (size[1] - h) // 2
    return [record.height, record.width, top, left], [record.height, record.width, top, size[0] - w - left]


class SDXLEncoders:
    """The cache's encoders (dataset.PipelineEncoder's model half): the VAE's latents and encode_prompt's tensors."""

    name = "sdxl"

    def text_max_len(self, model_path: str, revision: str | None) -> int:
        return TEXT_LEN

    def encode_latents(self, pipe, pixels: torch.Tensor) -> torch.Tensor:
        vae = pipe.vae
        if vae.dtype == torch.float16 and vae.config.get("force_upcast", False):
            vae.to(torch.float32)
        lat = vae.encode(pixels.to(vae.dtype)).latent_dist.mode()
        return (lat * vae.config.scaling_factor)[0]

    def encode_text(self, pipe, text: str, max_len: int, device: torch.device) -> dict[str, torch.Tensor]:
        embeds, _neg, pooled, _neg_pooled = pipe.encode_prompt(text, device=device, num_images_per_prompt=1,
                                                               do_classifier_free_guidance=False)
        return {"prompt_embeds": embeds[0], "pooled_prompt_embeds": pooled[0]}


class SDXLDataset(CachedImages):
    """SDXL batches: the two text tensors (all 77 tokens: no padding; embeddings, or token ids when the encoders
    train), each sample's size and crop, masks, weights and DOP class prompts."""

    def collate(self, indices: list[int]) -> dict[str, Any]:
        from engine.data.image_sets import extra_batch

        lat, batch = self.latents(indices)
        batch.update(self.texts([self.cache.load(self.plan.item_text[i]) for i in indices]))
        batch.update({f"empty_{k}": v for k, v in self.texts([self.empty]).items()})
        sizes = [size_and_crop(self.items[i].record, self.items[i].bucket) for i in indices]
        batch["size_crop"] = torch.tensor([s[0] for s in sizes], dtype=torch.float32)
        batch["size_crop_flip"] = torch.tensor([s[1] for s in sizes], dtype=torch.float32)
        batch.update(extra_batch(self.items, self.cache, self.plan, indices, lat, self.texts))
        return batch

    @staticmethod
    def texts(entries: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        return {k: torch.stack([e[k] for e in entries]) for k in entries[0]}


def prediction(cfg: JobConfig, sched: dict[str, Any]) -> str:
    """model.prediction, or the scheduler config's prediction_type where the job leaves it unset."""
    if cfg.model.prediction is not None:
        return cfg.model.prediction
    return "v" if sched.get("prediction_type") == "v_prediction" else "epsilon"


def alphas_cumprod(sched: dict[str, Any], pred: str) -> torch.Tensor:
    """ᾱ_t of the model's DDPM schedule (its betas), rescaled to zero terminal SNR for v-prediction."""
    from diffusers import DDPMScheduler

    conf = {k: sched[k] for k in ("num_train_timesteps", "beta_start", "beta_end", "beta_schedule", "trained_betas")
            if sched.get(k) is not None}
    return DDPMScheduler(**conf, rescale_betas_zero_snr=pred == "v").alphas_cumprod.clone()


def noised(x0: torch.Tensor, noise: torch.Tensor, ac: torch.Tensor, pred: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_t, the target) at ᾱ_t per sample: x_t = √ᾱ·x0 + √(1 − ᾱ)·ε; the target ε, or v = √ᾱ·ε − √(1 − ᾱ)·x0."""
    ac = ac.view(-1, *[1] * (x0.dim() - 1))
    x_t = ac.sqrt() * x0 + (1 - ac).sqrt() * noise
    return x_t, noise if pred == "epsilon" else ac.sqrt() * noise - (1 - ac).sqrt() * x0


def check_job(cfg: JobConfig) -> None:
    """What SDXL cannot do, said before anything is encoded (JobInvalid: the trainer's exit 65)."""
    if cfg.train.timestep_sampling == "shift":
        raise JobInvalid("train.timestep_sampling: shift is a flow-matching schedule; SDXL's DDPM takes linear "
                         "(uniform, kohya's default) or sigmoid")


class SDXL(ImageData):
    """The Family protocol (engine/families/base.py) for SDXL (see the module docstring)."""

    dataset_class = SDXLDataset

    def __init__(self):
        self.cfg: JobConfig | None = None
        self.sched: dict[str, Any] = {}
        self.pred = "epsilon"
        self.ac: torch.Tensor | None = None
        self.renderer = None
        self.sampled: torch.nn.Module | None = None
        self.path = ""

    def _setup(self, cfg: JobConfig, workdir: Path, log=None) -> str:
        from diffusers import EulerDiscreteScheduler

        self.cfg = cfg
        check_job(cfg)
        # a single-file checkpoint: its diffusers directory, converted once into the workdir (single_file.py)
        path = self.path = diffusers_dir(resolve_model_path(cfg.model.path, workdir), cfg, workdir, log)
        self.sched = dict(EulerDiscreteScheduler.load_config(path, subfolder="scheduler", revision=cfg.model.revision))
        self.pred = prediction(cfg, self.sched)
        self.ac = alphas_cumprod(self.sched, self.pred)
        return path

    def prepare(self, cfg: JobConfig, workdir: Path, log, bar=None) -> None:
        from engine.families.image.cache import fill_cache

        quiet_libraries(diffusers=True)
        path = self._setup(cfg, workdir, log)
        self.records, self.items, self.n_train = scan_images(cfg, log, workdir)
        enc = PipelineEncoder(SDXLEncoders(), path, cfg)
        text, kind = enc.text_encoder, "text"
        if cfg.lora.text_encoder:  # the encoders train: their inputs are cached, not their outputs (text.py)
            text, kind = (lambda: open_tokenizers(path, cfg.model.revision)), TOKENS_KIND
        self.cache, self.plan, self.report = fill_cache(
            cfg, self.items, workdir, path, log, bar=bar, max_len=TEXT_LEN,
            open_image_encoder=enc.image_encoder, open_text_encoder=text, text_kind=kind)

    def load_model(self, cfg: JobConfig, workdir: Path, device: torch.device, log) -> torch.nn.Module:
        from diffusers import UNet2DConditionModel

        path = self._setup(cfg, workdir, log)
        log.info("sdxl", prediction=self.pred, zero_terminal_snr=self.pred == "v",
                 text_encoders_train=cfg.lora.text_encoder)
        unet = load_lora_transformer(UNet2DConditionModel, path, cfg, device, log, fp8_skip=FP8_SKIP,
                                     default_targets=DEFAULT_TARGETS, subfolder="unet")
        if not cfg.lora.text_encoder:
            return unet
        model = SDXLWithText(unet, *load_text_encoders(path, cfg, device))
        log.info("lora_text_encoders", trainable_params=sum(
            p.numel() for n, p in model.named_parameters() if p.requires_grad and not n.startswith("unet.")))
        return model

    def loss(self, model: torch.nn.Module, batch: dict[str, Any], generator: torch.Generator,
             evaluate: bool = False) -> torch.Tensor:
        """evaluate: the validation loss — the plain objective on the sample as it is (no flip, no caption
        dropout, no preservation term), with only the noise and the timestep drawn."""
        cfg = self.cfg
        inner = getattr(model, "module", model)  # under DDP the forward goes through the wrapper
        conds = IDS if cfg.lora.text_encoder else CONDS
        x0, flip, text = flip_and_drop(batch, cfg, generator, conds, draw=not evaluate)
        device, dtype = x0.device, inner.dtype
        b, _c, h, w = x0.shape
        noise = torch.randn(x0.shape, generator=generator).to(device)
        kind = cfg.train.timestep_sampling
        u = sample_sigmas(kind, b, 1.0, generator, cfg.train.timestep_bias)
        steps = self.ac.shape[0]
        t = (u * steps).long().clamp(0, steps - 1)
        x0, noise = x0.float(), noise.float()
        x_t, target = noised(x0, noise, self.ac[t].to(device), self.pred)
        sc = batch["size_crop"].to(device)
        if flip is not None:
            sc = torch.where(flip[:, None], batch["size_crop_flip"].to(device), sc)
        target_size = torch.tensor([h * VAE_FACTOR, w * VAE_FACTOR], device=device, dtype=sc.dtype).expand(b, 2)
        time_ids = torch.cat([sc, target_size], dim=1).to(dtype)
        timesteps = t.to(device)

        def predict(embeds: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
            if cfg.lora.text_encoder:  # token ids, through the training encoders (SDXLWithText.forward)
                return model(x_t.to(dtype), timesteps, input_ids=embeds.to(device), input_ids_2=pooled.to(device),
                             time_ids=time_ids)[0]
            return model(x_t.to(dtype), timesteps, encoder_hidden_states=embeds.to(device, dtype),
                         added_cond_kwargs={"text_embeds": pooled.to(device, dtype), "time_ids": time_ids},
                         return_dict=False)[0]

        pred = predict(*(text[k] for k in conds))
        loss = batch_flow_loss(pred, target, batch, flip, lambda x: x, x0.shape)
        if evaluate:
            return loss
        return with_preservation(loss, cfg, model, predict, batch, conds)

    def on_step_end(self, model: torch.nn.Module, step: int, cfg: JobConfig, workdir: Path, log) -> None:
        from engine.families.image.sample import SampleRenderer, sample_due

        if not sample_due(cfg, step):
            return
        self.sampled = model  # its encoders turn the cached token ids into embeddings when they train
        if self.renderer is None:
            path = self.path
            self.renderer = SampleRenderer(cfg, path, self.cache, self.plan, Path(workdir),
                                           pipeline=lambda m: sample_pipeline(path, cfg, parts(m)["unet"], self.pred),
                                           prompt_kwargs=self.sample_kwargs)
        self.renderer.render(model, step, log)

    def export(self, model: torch.nn.Module, cfg: JobConfig, out_dir: Path, meta: dict[str, Any]) -> list[str]:
        from engine.families.image.sdxl.export import export

        return export(model, cfg, Path(out_dir), self.export_meta(cfg, meta), self.pred)

    def sample_kwargs(self, emb, negative, device, dtype) -> dict[str, Any]:
        if isinstance(self.sampled, SDXLWithText):  # cached token ids: encoded by the encoders as trained so far
            emb, negative = ({k: v[0] for k, v in zip(CONDS, self.sampled.encode(e["input_ids"][None],
                                                                                  e["input_ids_2"][None]), strict=True)}
                             for e in (emb, negative))
        return sample_kwargs(emb, negative, device, dtype)


def sample_kwargs(emb, negative, device, dtype) -> dict[str, Any]:
    """One cached prompt and its negative as the pipeline's embeddings (CFG at sample.guidance)."""
    return {"prompt_embeds": emb["prompt_embeds"][None].to(device, dtype),
            "pooled_prompt_embeds": emb["pooled_prompt_embeds"][None].to(device, dtype),
            "negative_prompt_embeds": negative["prompt_embeds"][None].to(device, dtype),
            "negative_pooled_prompt_embeds": negative["pooled_prompt_embeds"][None].to(device, dtype)}


def sample_pipeline(model_path: str, cfg: JobConfig, unet, pred: str):
    """The SDXL pipeline with the training UNet and no text encoders (prompts come from the cache); for v its
    scheduler predicts v on the zero-terminal-SNR schedule with trailing timesteps (so the last step is t = 999)."""
    from diffusers import EulerDiscreteScheduler, StableDiffusionXLPipeline

    rev, dtype = cfg.model.revision, torch_dtype(cfg.model.dtype)
    sched = EulerDiscreteScheduler.from_pretrained(model_path, subfolder="scheduler", revision=rev)
    if pred == "v":
        sched = EulerDiscreteScheduler.from_config(sched.config, prediction_type="v_prediction",
                                                   rescale_betas_zero_snr=True, timestep_spacing="trailing")
    pipe = StableDiffusionXLPipeline.from_pretrained(model_path, revision=rev, unet=unet, scheduler=sched,
                                                     text_encoder=None, text_encoder_2=None, tokenizer=None,
                                                     tokenizer_2=None, dtype=dtype)
    pipe.vae.to(unet.device)
    return pipe
