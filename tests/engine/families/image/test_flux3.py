"""FLUX.3's training forward is its modular pipeline's: the velocity the pipeline integrates, at the pipeline's
shift, each caption at its own text window (engine/families/image/flux3/family.py)."""

from __future__ import annotations

import math

import pytest
import torch


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from engine.builtin.tiny_flux3 import build_tiny_flux3
    from engine.families.image.flux3 import load_modular

    path = tmp_path_factory.mktemp("tiny-flux3")
    build_tiny_flux3(path)
    return load_modular(str(path), None, ["transformer", "vae"], torch.float32,
                        drop=("prompt_upsampler", "text_encoder", "vae_encoder"))


def test_the_training_shift_is_the_pipelines_static_shift():
    """Both pipelines' set-timesteps step configures the scheduler with a static shift of 6.93, at any size."""
    from engine.families.image.flux3 import Flux3Model

    m = Flux3Model()
    assert m.shift_mu({}, 256) == m.shift_mu({"shift": 1.0}, 4096) == pytest.approx(math.log(6.93))


def test_predict_is_the_velocity_the_modular_pipeline_integrates(tiny):
    """One Euler step of the pipeline (its packing, ids, time and scheduler) from x at σ moves x by −σ·v; the
    family's predict gives that v in the pipeline's token layout."""
    from diffusers import ClassifierFreeGuidance

    from engine.families.image.flux3 import Flux3Model

    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 16, 2, 3, generator=g)
    caption = torch.randn(1, 80, tiny.transformer.config.joint_attention_dim, generator=g)
    tiny.update_components(guider=ClassifierFreeGuidance(guidance_scale=1.0))  # no CFG: the plain velocity
    with torch.no_grad():
        after = tiny(prompt_embeds=caption, latents=x.clone(), height=32, width=48, sigmas=[0.6], output="latents")
        sigma = tiny.scheduler.sigmas[0]  # 0.6 moved by the static shift
        velocity = (after - x) / (0 - sigma)
        m = Flux3Model()
        pred = m.predict(tiny.transformer, tiny.transformer, x, sigma[None], caption, torch.ones(1, 80), None)
    assert float(sigma) == pytest.approx(6.93 * 0.6 / (1 + 5.93 * 0.6))
    torch.testing.assert_close(pred, m.pack(velocity), rtol=1e-4, atol=1e-5)


def test_a_batch_of_different_text_windows_predicts_each_sample_at_its_own_window(tiny):
    """The transformer takes no text mask: a caption padded to a longer caption's window would see tokens the
    pipeline never gives it. Each sample's prediction equals its prediction alone, at its own window."""
    from engine.families.image.flux3 import Flux3Model

    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 16, 2, 2, generator=g)
    dim = tiny.transformer.config.joint_attention_dim
    embeds = torch.zeros(3, 160, dim)
    mask = torch.zeros(3, 160)
    for i, length in enumerate((160, 80, 160)):
        embeds[i, :length] = torch.randn(length, dim, generator=g)
        mask[i, :length] = 1
    sigma = torch.tensor([0.3, 0.5, 0.9])
    m = Flux3Model()
    with torch.no_grad():
        together = m.predict(tiny.transformer, tiny.transformer, x, sigma, embeds, mask, None)
        alone = [m.predict(tiny.transformer, tiny.transformer, x[i : i + 1], sigma[i : i + 1],
                           embeds[i : i + 1, : int(mask[i].sum())], mask[i : i + 1, : int(mask[i].sum())], None)
                 for i in range(3)]
        padded = m.predict(tiny.transformer, tiny.transformer, x[1:2], sigma[1:2], embeds[1:2], torch.ones(1, 160),
                           None)
    torch.testing.assert_close(together, torch.cat(alone), rtol=1e-5, atol=1e-6)
    assert not torch.allclose(padded, alone[1], atol=1e-4), "the padding would change nothing; the test proves nothing"
    # Under DDP (one forward per backward) such a batch is refused naming the key, before any forward.
    from engine.errors import JobInvalid

    ddp = torch.nn.parallel.DistributedDataParallel.__new__(torch.nn.parallel.DistributedDataParallel)
    with pytest.raises(JobInvalid, match=r"train.batch_size: .*\[80, 160\] tokens"):
        m.predict(ddp, tiny.transformer, x, sigma, embeds, mask, None)


def test_the_distilled_flow_map_trains_at_its_own_time_and_samples_through_its_pipeline_without_cfg(tiny, tmp_path):
    """FLUX.3 distilled: predict asks the flow map for the jump to σ itself (its instantaneous velocity, what
    ε − x0 estimates); samples go through the directory's Flux3DistilledAutoBlocks, which take no negative prompt
    (so the renderer, which passes only the keywords a pipeline takes, warns about one)."""
    import inspect
    from types import SimpleNamespace

    from diffusers import Flux3DistilledAutoBlocks, Flux3Transformer2DModel

    from engine.families.image.flux3 import DistilledSampler, Flux3Model

    with torch.random.fork_rng():
        torch.manual_seed(0)
        flow_map = Flux3Transformer2DModel.from_config({**tiny.transformer.config, "flow_map": True})
    pipe = Flux3DistilledAutoBlocks().init_pipeline()
    pipe.update_components(transformer=flow_map, vae=tiny.vae)
    pipe.save_pretrained(str(tmp_path), overwrite_modular_index=True)

    g = torch.Generator().manual_seed(3)
    x, text, sigma = torch.randn(1, 16, 2, 2, generator=g), torch.randn(1, 80, 64, generator=g), torch.tensor([0.4])
    m = Flux3Model()
    with torch.no_grad():
        pred = m.predict(flow_map, flow_map, x, sigma, text, torch.ones(1, 80), None)
        call = dict(hidden_states=m.pack(x), encoder_hidden_states=text, timestep=sigma,
                    img_ids=torch.tensor([[0, h * 0.5, w * 0.5, 0] for h in range(2) for w in range(2)]),
                    txt_ids=torch.tensor([[0, 0, 0, i] for i in range(80)]).float(), return_dict=False)
        assert torch.equal(pred, flow_map(**call, target_timestep=sigma)[0])
        assert not torch.allclose(pred, flow_map(**call, target_timestep=torch.zeros(1))[0])

        cfg = SimpleNamespace(model=SimpleNamespace(revision=None, dtype="float32"))
        sampler = m.sample_pipeline(str(tmp_path), cfg, flow_map)
        sampler.set_progress_bar_config(disable=True)
        image = sampler(prompt_embeds=text, height=32, width=32, num_inference_steps=2,
                        generator=torch.Generator().manual_seed(0)).images[0]
    assert isinstance(sampler, DistilledSampler) and image.size == (32, 32)
    assert "negative_prompt_embeds" not in inspect.signature(sampler.__call__).parameters
