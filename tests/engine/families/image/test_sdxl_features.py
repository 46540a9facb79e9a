"""SDXL on the image families' shared quality features, in process on its loss (builtin:tiny-sdxl): the size and
crop ids the UNet sees, masks (exactly zero gradient outside), regularisation weights, DOP (with the text encoders
training too: their LoRA off in its base pass), the validation loss;
and what SDXL refuses, each naming its key. The features job is tests/e2e/test_image_quality.py's."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import yaml
from PIL import Image

from engine.config.job import load_job, parse_job
from engine.errors import JobInvalid
from engine.families import get_family
from tests.e2e.test_image_quality import _batch_with, _positions, features_job
from tests.helpers.fakes import RecLog


def _prepare(root, model_dir, *, flip: bool = False, **lora):
    """The features job on SDXL, prepared and loaded on the CPU, its lora_B nonzero so the adapter acts."""
    d = features_job(root, "sdxl", model_dir)
    d["train"]["timestep_sampling"] = "linear"
    d["data"]["flip"] = flip
    d["lora"].update(lora)
    cfg = parse_job(d, root)
    fam, log = get_family("sdxl"), RecLog()
    fam.prepare(cfg, root / "work", log)
    ds = fam.build_dataset(cfg, root / "work", log)
    torch.manual_seed(0)
    model = fam.load_model(cfg, root / "work", torch.device("cpu"), log)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    return SimpleNamespace(cfg=cfg, fam=fam, ds=ds, model=model, root=root, model_dir=model_dir)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, tiny_image_model):
    return _prepare(tmp_path_factory.mktemp("sdxl-features"), tiny_image_model("sdxl"), flip=True)


@pytest.fixture
def calls(prepared):
    """Every UNet forward of the test: its output (gradient kept), time ids and text, and whether the adapter was on."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layer = next(m for m in prepared.model.modules() if isinstance(m, BaseTunerLayer))
    seen = []

    def hook(_mod, _args, kwargs, out):
        if out[0].requires_grad:
            out[0].retain_grad()
        seen.append(SimpleNamespace(out=out[0], time_ids=kwargs["added_cond_kwargs"]["time_ids"],
                                    embeds=kwargs["encoder_hidden_states"], adapter_on=not layer.disable_adapters))

    handle = prepared.model.register_forward_hook(hook, with_kwargs=True)
    yield seen
    handle.remove()


def test_the_unet_sees_each_images_original_size_crop_and_bucket(prepared, calls):
    p = prepared
    idx = p.ds.indices_at(p.cfg.train.seed, 0, 2)
    batch = p.ds.collate(idx)
    with torch.no_grad():
        p.fam.loss(p.model, batch, torch.Generator().manual_seed(0), evaluate=True)  # no flip drawn
    want = []
    for i in idx:
        rec, (w, h) = p.ds.items[i].record, p.ds.items[i].bucket
        scale = max(w / rec.width, h / rec.height)
        left = (max(w, round(rec.width * scale)) - w) // 2
        top = (max(h, round(rec.height * scale)) - h) // 2
        want.append([rec.height, rec.width, top, left, h, w])
    assert calls[0].time_ids.tolist() == want


def test_the_crop_corner_is_where_the_bucket_image_was_cut():
    from engine.data.images import cover_crop
    from engine.families.image.sdxl.family import size_and_crop

    im = Image.effect_mandelbrot((61, 23), (-2, -1, 1, 1), 50).convert("RGB")
    rec = SimpleNamespace(width=61, height=23)
    (oh, ow, top, left), (_, _, _, left_flip) = size_and_crop(rec, (32, 16))
    scale = max(32 / 61, 16 / 23)
    resized = im.resize((round(61 * scale), round(23 * scale)), Image.Resampling.LANCZOS)
    assert (oh, ow) == (23, 61) and left > 0
    assert resized.crop((left, top, left + 32, top + 16)).tobytes() == cover_crop(im, (32, 16)).tobytes()
    mirrored = resized.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    assert mirrored.crop((left_flip, top, left_flip + 32, top + 16)).tobytes() == \
        cover_crop(im, (32, 16)).transpose(Image.Transpose.FLIP_LEFT_RIGHT).tobytes()


def test_latent_pixels_outside_the_mask_get_exactly_zero_gradient(prepared, calls):
    p = prepared
    batch = _batch_with(p, lambda items: any(it.mask is not None for it in items))
    # evaluate: no flip drawn, so each sample's own mask applies (and no DOP pass)
    p.fam.loss(p.model, batch, torch.Generator().manual_seed(0), evaluate=True).backward()
    p.model.zero_grad(set_to_none=True)
    grad = calls[0].out.grad
    mask = batch["masks"][:, None].expand(grad.shape)
    assert (mask == 0).any() and (mask > 0).any()
    assert (grad[mask == 0] == 0).all(), "latent pixels outside the mask got gradient"
    assert (grad[mask > 0] != 0).float().mean() > 0.99  # ... while those inside do get one


def test_regularisation_weights_scale_each_samples_loss(prepared):
    p = prepared
    batch = _batch_with(p, lambda items: any(it.repeats is not None for it in items) and
                        any(it.repeats is None for it in items))
    assert sorted(batch["loss_weight"].tolist()) == [0.5, 1.0]

    def loss_at(scale: float) -> torch.Tensor:
        with torch.no_grad():
            return p.fam.loss(p.model, {**batch, "loss_weight": batch["loss_weight"] * scale},
                              torch.Generator().manual_seed(1))

    torch.testing.assert_close(loss_at(2) - loss_at(1), loss_at(1) - loss_at(0))
    assert loss_at(1) > loss_at(0)


def test_dop_adds_the_class_prompts_distance_from_the_adapter_free_base(prepared, calls):
    p = prepared
    batch = p.ds.collate(p.ds.indices_at(p.cfg.train.seed, 0, 2))
    with torch.no_grad():
        with_dop = p.fam.loss(p.model, batch, torch.Generator().manual_seed(5))
        train, base, lora = calls
        p.fam.cfg = p.cfg.model_copy(deep=True)
        p.fam.cfg.train.dop = None
        try:
            plain = p.fam.loss(p.model, batch, torch.Generator().manual_seed(5))
        finally:
            p.fam.cfg = p.cfg
    assert train.adapter_on and not base.adapter_on and lora.adapter_on
    assert torch.equal(base.embeds, batch["class_prompt_embeds"]) and not torch.equal(train.embeds, base.embeds)
    torch.testing.assert_close(with_dop - plain, p.cfg.train.dop.weight * torch.nn.functional.mse_loss(lora.out, base.out))


def test_the_validation_loss_depends_on_the_weights_alone(prepared):
    p = prepared
    vset = p.fam.validation_set(p.cfg, p.root, RecLog())
    assert vset.indices and not set(vset.indices) & {i for b in _positions(p.ds, p.cfg.train.seed) for i in b}

    def validation() -> torch.Tensor:
        with torch.no_grad():
            return p.fam.validation_loss(p.model, vset.dataset, vset.indices, p.cfg.train.seed, torch.device("cpu"))

    first = validation()
    with torch.no_grad():
        p.fam.loss(p.model, p.ds.collate(p.ds.indices_at(p.cfg.train.seed, 2, 2)), torch.Generator().manual_seed(9))
    assert torch.equal(validation(), first)


def test_what_sdxl_refuses_names_the_key(prepared, tmp_path):
    from engine.families.image.sdxl.family import check_job

    shift = prepared.cfg.model_copy(deep=True)
    shift.train.timestep_sampling = "shift"
    with pytest.raises(JobInvalid, match="train.timestep_sampling: shift is a flow-matching schedule"):
        check_job(shift)
    single = tmp_path / "noobai-xl-vpred.safetensors"
    single.write_bytes(b"\0" * 16)
    data = prepared.root / "data"
    for over, words in (({"path": str(single)}, "is not a safetensors checkpoint (no readable header)"),
                        ({"family": "flux", "path": "builtin:tiny-flux", "prediction": "v"},
                         "model.prediction: only for model.family sdxl; this job is flux"),
                        ({"family": "causal_lm", "path": "builtin:tiny-llama", "text_encoder": True},
                         "lora.text_encoder: only for model.family sdxl; this job is causal_lm")):
        lora = {"text_encoder": over.pop("text_encoder")} if "text_encoder" in over else {}
        job = {"name": "x", "model": {"family": "sdxl", "path": "builtin:tiny-sdxl", **over},
               "data": {"path": str(data)}, "lora": lora}
        (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
        with pytest.raises(JobInvalid) as e:
            load_job(tmp_path / "job.yaml")
        assert words in str(e.value)


@pytest.mark.parametrize("pred", ["epsilon", "v"])
def test_the_noisy_latent_and_target_are_diffusers_ddpm_ones(pred):
    """x_t and v as diffusers' DDPMScheduler (add_noise, get_velocity) makes them, on SDXL's betas — rescaled to zero
    terminal SNR for v, where the last step is pure noise and v = −x0."""
    from diffusers import DDPMScheduler

    from engine.families.image.sdxl.family import alphas_cumprod, noised

    sdxl = {"num_train_timesteps": 1000, "beta_start": 0.00085, "beta_end": 0.012, "beta_schedule": "scaled_linear"}
    ref = DDPMScheduler(**sdxl, rescale_betas_zero_snr=pred == "v")
    ac = alphas_cumprod(sdxl, pred)
    g = torch.Generator().manual_seed(0)
    x0, noise = torch.randn(3, 4, 5, 6, generator=g), torch.randn(3, 4, 5, 6, generator=g)
    t = torch.tensor([0, 500, 999])
    x_t, target = noised(x0, noise, ac[t], pred)
    torch.testing.assert_close(x_t, ref.add_noise(x0, noise, t))
    torch.testing.assert_close(target, noise if pred == "epsilon" else ref.get_velocity(x0, noise, t))
    if pred == "v":
        torch.testing.assert_close(x_t[2], noise[2])
        torch.testing.assert_close(target[2], -x0[2])


@pytest.fixture(scope="module")
def prepared_te(tmp_path_factory, tiny_image_model):
    """The features job with lora.text_encoder: the cache holds token ids, the model is UNet + both encoders."""
    return _prepare(tmp_path_factory.mktemp("sdxl-features-te"), tiny_image_model("sdxl"), text_encoder=True)


def test_dop_with_trained_text_encoders_takes_the_base_from_the_encoders_without_their_lora(prepared_te):
    """DOP's base pass turns the encoders' LoRA off with the UNet's: its text is what the frozen pipeline's
    encode_prompt makes of the class captions; the LoRA pass's text is not."""
    from diffusers import StableDiffusionXLPipeline

    p = prepared_te
    idx = p.ds.indices_at(p.cfg.train.seed, 0, 2)
    batch = p.ds.collate(idx)
    assert {"input_ids", "input_ids_2", "class_input_ids", "class_input_ids_2"} <= set(batch)
    assert "prompt_embeds" not in batch  # the cache held token ids, not embeddings
    seen = []
    handle = p.model.unet.register_forward_hook(
        lambda _m, _a, kw, out: seen.append((kw["encoder_hidden_states"], kw["added_cond_kwargs"]["text_embeds"],
                                             out[0])), with_kwargs=True)
    try:
        with torch.no_grad():
            with_dop = p.fam.loss(p.model, batch, torch.Generator().manual_seed(5))
    finally:
        handle.remove()
    (_, _, _), (base_emb, base_pooled, base_out), (lora_emb, _lora_pooled, lora_out) = seen
    pipe = StableDiffusionXLPipeline.from_pretrained(p.model_dir, unet=None, vae=None)
    texts = [p.fam.plan.texts[p.fam.plan.item_class_text[i]].payload for i in idx]
    with torch.no_grad():
        emb, _, pooled, _ = pipe.encode_prompt(texts, device="cpu", do_classifier_free_guidance=False)
    torch.testing.assert_close(base_emb, emb, rtol=0, atol=1e-6)
    torch.testing.assert_close(base_pooled, pooled, rtol=0, atol=1e-6)
    assert not torch.allclose(lora_emb, emb, atol=1e-4)
    assert torch.isfinite(with_dop) and torch.nn.functional.mse_loss(lora_out, base_out) > 0
