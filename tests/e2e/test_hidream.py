"""HiDream-I1 LoRA on the tiny random pipeline (builtin:tiny-hidream): killed twice and resumed bit-identical, both
files read back by their loaders' rules, the pipeline's own time and sign conventions, the mixture of experts.

The killed-twice chain (SIGKILL while caching, SIGKILL with a checkpoint half-written, resumed; real forked
processes, tests/helpers/kill_chain.py) runs in the background of the module fixture while the same job trains
uninterrupted in the test process; the other tests read the uninterrupted run's files.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors import safe_open
from safetensors.torch import load_file

from engine.config.job import load_job
from tests.helpers.images import make_images, tensor_bytes, with_last_checkpoint
from tests.helpers.jobs import deep_update
from tests.helpers.kill_chain import Quiet, chains_beside_references

IMAGES = [("wide-0.png", 48, 24, "a red square on grass"), ("tall-0.png", 20, 40, "a green tower"),
          ("square-0.png", 32, 32, "a yellow sun")]
DIFFUSERS_FILE = "pytorch_lora_weights.safetensors"
COMFY_FILE = "hidream_lora_comfyui.safetensors"


def job_dict(model_dir, data_dir: Path, **over) -> dict:
    d = {
        "name": "tiny-hidream",
        "model": {"family": "hidream", "path": str(model_dir), "dtype": "float32"},
        "lora": {"rank": 4, "alpha": 8, "dropout": 0.1},
        # 48: the wide and tall images get non-square buckets (64x32, 32x64): the transformer's padded path.
        "data": {"path": str(data_dir), "resolution": [32, 48], "trigger": "sks", "caption_dropout": 0.3, "flip": True},
        "train": {"steps": 4, "batch_size": 2, "lr": 0.002, "schedule": "constant", "optimizer": "adamw",
                  "seed": 3, "timestep_sampling": "shift"},
        "checkpoint": {"every_steps": 2, "every_seconds": None, "keep": 2},
        "output": {"formats": ["diffusers", "comfyui"]},
    }
    return deep_update(d, over)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """(model dir, job file, uninterrupted workdir, killed-twice future)."""
    from engine.builtin.tiny_hidream import build_tiny_hidream

    root = tmp_path_factory.mktemp("hidream")
    data = make_images(root / "data", IMAGES)
    build_tiny_hidream(root / "tiny-hidream")
    job = root / "hidream.yaml"
    job.write_text(yaml.safe_dump(job_dict(root / "tiny-hidream", data)))
    with chains_beside_references(root, {"hidream": (job, job)}) as done:
        yield (root / "tiny-hidream", job, *done["hidream"])


def test_killed_while_caching_and_while_saving_then_resumed_is_bit_identical(run):
    _model, _job, reference, killed = run
    wd, story = killed.result(timeout=900)
    for name in (DIFFUSERS_FILE, COMFY_FILE):
        want, got = tensor_bytes(reference / "output" / name), tensor_bytes(wd / "output" / name)
        assert sorted(want) == sorted(got) and want
        assert [k for k in want if want[k] != got[k]] == [], f"{name} differs; {story}"


def _trained(job: Path, workdir: Path):
    from engine.families import get_family

    cfg = load_job(job)
    model = get_family("hidream").load_model(cfg, workdir, torch.device("cpu"), Quiet())
    return with_last_checkpoint(model, workdir), cfg


def _inputs(config, h: int = 4, w: int = 6) -> dict:
    """Fixed transformer inputs: a non-square latent (the padded path), 5 text tokens, every Llama layer."""
    g = torch.Generator().manual_seed(0)
    d5, d4 = config.caption_channels
    return dict(hidden_states=torch.randn(1, config.in_channels, h, w, generator=g), timesteps=torch.tensor([600.0]),
                encoder_hidden_states_t5=torch.randn(1, 5, d5, generator=g),
                encoder_hidden_states_llama3=torch.randn(2, 1, 5, d4, generator=g),
                pooled_embeds=torch.randn(1, config.text_emb_dim, generator=g), return_dict=False)


def test_load_lora_weights_of_both_files_reproduces_the_trained_transformer(run):
    """HiDreamImagePipeline.load_lora_weights reads the diffusers file (scale 1: alpha / r = 2 folded into B, a
    power of two, so bit-identical) and the ComfyUI file (diffusion_model.* converted to transformer.*)."""
    from diffusers import HiDreamImagePipeline

    model_dir, job, reference, _ = run
    mem, cfg = _trained(job, reference)
    x = _inputs(mem.config)
    pipe = HiDreamImagePipeline.from_pretrained(model_dir, vae=None, **{f"{k}{s}": None for k in (
        "text_encoder", "tokenizer") for s in ("", "_2", "_3", "_4")})
    with torch.no_grad():
        want = mem(**x)[0]
        base = pipe.transformer(**x)[0]
        pipe.load_lora_weights(str(reference / "output"), weight_name=DIFFUSERS_FILE)
        got = pipe.transformer(**x)[0]
        layer = pipe.transformer.double_stream_blocks[0].block.attn1.to_q
        assert layer.scaling[next(iter(layer.scaling))] == 1.0 and cfg.lora.alpha / cfg.lora.rank == 2.0
        pipe.unload_lora_weights()
        pipe.load_lora_weights(str(reference / "output"), weight_name=COMFY_FILE)
        comfy = pipe.transformer(**x)[0]
    assert not torch.allclose(base, want, atol=1e-4), "training changed nothing; the test would prove nothing"
    assert torch.equal(got, want), f"max diff {float((got - want).abs().max())}"
    torch.testing.assert_close(comfy, want, rtol=1e-5, atol=1e-6)
    with safe_open(str(reference / "output" / DIFFUSERS_FILE), "pt") as f:
        md = f.metadata()
    assert md["rank"] == "4" and md["steps"] == "4" and md["trigger"] == "sks"
    assert json.loads(md["lora_adapter_metadata"])["transformer.lora_alpha"] == 4.0


def test_comfyui_file_keys_map_through_comfyuis_hidream_rules_at_the_trained_strength(run):
    """The rules as the family's docstring writes them (comfyui_lora_keys: the generic diffusion_model.<path>, the
    HiDream branch's transformer.<path> and lycoris_<path>) send every key of both files to a weight of the
    transformer — ComfyUI's HiDream model has diffusers' names — and B·A (no .alpha: scale 1) is the trained
    update (alpha / r)·B·A of that module."""
    from engine.families.image.export import lora_modules
    from engine.families.image.hidream import family as hidream

    for rule in ("diffusion_model.<path>", "transformer.<path>", "lycoris_<path, dots as _>"):
        assert rule in hidream.__doc__
    _model_dir, job, reference, _ = run
    mem, cfg = _trained(job, reference)
    scale = cfg.lora.alpha / cfg.lora.rank
    deltas = {m: scale * (b @ a) for m, (a, b, _) in lora_modules(mem).items()}
    blocks = [f"double_stream_blocks.{i}.block." for i in range(2)] + [f"single_stream_blocks.{i}.block." for i in range(2)]
    want_modules = {b + f"attn1.{p}{t}" for b in blocks for p in ("to_q", "to_k", "to_v", "to_out")
                    for t in ("", "_t") if t == "" or b.startswith("double")}
    want_modules |= {b + f"ff_i.shared_experts.{w}" for b in blocks for w in ("w1", "w2", "w3")}
    want_modules |= {b + f"ff_t.{w}" for b in blocks[:2] for w in ("w1", "w2", "w3")}
    assert set(deltas) == want_modules  # the default targets; no routed expert
    key_map = {}  # ComfyUI's map for this model: LoRA key -> the weight it patches
    for k in (f"diffusion_model.{n}" for n, _ in mem.named_parameters()):
        k = k.replace(".base_layer.", ".")  # the frozen weight's name without peft's wrapper
        if k.endswith(".weight") and ".lora_" not in k:
            key_map.update({lora_key: k for lora_key in hidream.comfyui_lora_keys(k)})
    for name, prefix in ((COMFY_FILE, "diffusion_model."), (DIFFUSERS_FILE, "transformer.")):
        sd = load_file(str(reference / "output" / name))
        assert not any(k.endswith(".alpha") for k in sd), name
        keys = {k.rsplit(".lora_", 1)[0] for k in sd}
        assert keys == {prefix + m for m in want_modules}, name
        for key in keys:
            weight = key_map[key]
            module = weight.removeprefix("diffusion_model.").removesuffix(".weight")
            torch.testing.assert_close(sd[f"{key}.lora_B.weight"] @ sd[f"{key}.lora_A.weight"], deltas[module],
                                       rtol=1e-5, atol=1e-7, msg=f"{name}: {key}")


def test_predict_is_the_velocity_the_pipeline_integrates_from_the_cached_text(run):
    """predict (what the loss compares with ε − x0) is the velocity HiDreamImagePipeline hands its scheduler — the
    transformer's output negated, at t = 1000 σ — from a caption as the cache keeps it (pack_text of the pipeline's
    own encode_prompt)."""
    from diffusers import HiDreamImagePipeline

    from engine.families.image.hidream.family import HiDreamModel, pack_text

    model_dir = run[0]
    pipe = HiDreamImagePipeline.from_pretrained(model_dir)
    pipe.default_sample_size = 4  # the pipeline renders at (4 · 8)² px: the 32x32 latent given below
    t5, _, llama, _, pooled, _ = pipe.encode_prompt("a red square", do_classifier_free_guidance=False,
                                                    max_sequence_length=16)
    cached = pack_text(t5[0], llama[:, 0], pooled[0])
    assert cached.shape == (16 + 1, 24 + 2 * 16)
    x = torch.randn(1, 4, 4, 4, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        after = pipe(prompt_embeds_t5=t5, prompt_embeds_llama3=llama, pooled_prompt_embeds=pooled,
                     guidance_scale=1.0, sigmas=[0.6], latents=x.clone(), height=32, width=32,
                     output_type="latent").images
        sigma = pipe.scheduler.sigmas[0]  # 0.6 moved by the scheduler's static shift of 3
        velocity = (after - x) / (0 - sigma)  # the Euler step x + (σ_next − σ)·v, σ_next = 0
        model = HiDreamModel()
        pred = model.predict(pipe.transformer, pipe.transformer, x, sigma[None], cached[None],
                             torch.ones(1, 17), None)
    assert float(sigma) == pytest.approx(3 * 0.6 / (1 + 2 * 0.6))
    assert model.shift_mu({"shift": 3.0}, 4096) == pytest.approx(torch.log(torch.tensor(3.0)).item())
    torch.testing.assert_close(pred, velocity, rtol=1e-4, atol=1e-5)


def test_the_experts_train_through_the_same_forward_the_pipeline_runs(run, tmp_path):
    """The loaded transformer computes in training mode what the pipeline's (eval) forward computes, with no
    router auxiliary loss, and a routed expert named in lora.targets gets a gradient (diffusers' moe_infer,
    which the pipeline runs, is under no_grad: it would get none)."""
    from engine.config.job import parse_job
    from engine.families import get_family

    model_dir, _job, _ref, _ = run
    data = make_images(tmp_path / "data", IMAGES[2:])
    targets = r"^double_stream_blocks\.0\.block\.ff_i\.experts\.\d+\.w2$"
    cfg = parse_job(job_dict(model_dir, data, lora={"targets": targets, "dropout": 0.0}), tmp_path)
    model = get_family("hidream").load_model(cfg, tmp_path, torch.device("cpu"), Quiet())
    with torch.no_grad():  # a non-zero update, so that the experts' LoRA changes the output
        for p in model.parameters():
            if p.requires_grad:
                p.normal_(0, 0.1)
    x = _inputs(model.config)
    model.eval()
    with torch.no_grad():
        inference = model(**x)[0]
    model.train()
    gate = model.double_stream_blocks[0].block.ff_i.gate
    routed = []
    gate.register_forward_hook(lambda _m, _i, out: routed.append(set(out[0].flatten().tolist())))
    out = model(**x)[0]
    torch.testing.assert_close(out, inference, rtol=1e-5, atol=1e-6)
    out.square().mean().backward()
    grads = {int(n.split(".experts.")[1].split(".")[0]): p.grad for n, p in model.named_parameters()
             if p.requires_grad and ".lora_B." in n}
    # Every expert the router sent a token to gets a gradient; the others none.
    assert len(routed[0]) >= 2 and {i for i, g in grads.items() if g.abs().sum() > 0} == routed[0]
    assert gate(torch.randn(1, 3, gate.gating_dim))[2] is None  # no auxiliary loss computed, as diffusers' script


def test_samples_render_at_the_size_asked(run, tmp_path):
    import shutil

    from PIL import Image

    from engine.recipe import train

    _model, job, reference, _ = run
    d = deep_update(yaml.safe_load(job.read_text()),
                    {"sample": {"every_steps": 2, "prompts": ["sks"], "steps": 2, "width": 48, "height": 32,
                                "guidance": 2.0}, "train": {"steps": 2}})
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(d))
    shutil.copytree(reference / "cache", tmp_path / "work" / "cache")  # only the sample prompt is encoded
    assert train(load_job(tmp_path / "job.yaml"), tmp_path / "work", progress="none") == 0
    # At the size asked (the pipeline alone would render ~1024² px), non-square: the padded path, with CFG.
    assert Image.open(tmp_path / "work" / "samples" / "step-00000002" / "00.png").size == (48, 32)


def test_a_resolution_past_the_transformers_token_limit_is_refused_naming_it(tmp_path):
    """A non-square latent is padded to the transformer's max_seq tokens: a bucket with more would fail in its
    forward. The tiny model's 20² latents hold 100 tokens: resolution 160 (buckets up to 160² px) fits, 176 not."""
    from engine.config.job import parse_job
    from engine.errors import JobInvalid
    from engine.families import get_family
    from tests.helpers.fakes import RecLog

    data = make_images(tmp_path / "data", IMAGES[:1])
    cfg = parse_job(job_dict("builtin:tiny-hidream", data, data={"resolution": [160, 176]}), tmp_path)
    with pytest.raises(JobInvalid) as e:
        get_family("hidream").prepare(cfg, tmp_path, RecLog())
    assert "data.resolution: 176" in str(e.value) and "100 image tokens" in str(e.value), str(e.value)
    assert "use at most 160" in str(e.value)


def test_fp8_base_with_block_swapping_and_checkpointing_trains_every_lora(run, tmp_path):
    """The example job's memory settings on the tiny model: fp8 frozen linears (the embedders, caption projections
    and final layer kept in the model dtype), the last 2 blocks swapped, gradient checkpointing; every LoRA B
    (zero at the start) moved."""
    import shutil

    from engine.frozen_base.fp8 import FP8Linear
    from engine.recipe import train
    from tests.helpers.jobs import read_events

    _model, job, reference, _ = run
    d = deep_update(yaml.safe_load(job.read_text()), {
        "model": {"base_precision": "fp8"}, "train": {"steps": 2, "blocks_to_swap": 2, "gradient_checkpointing": True}})
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(d))
    shutil.copytree(reference / "cache", tmp_path / "work" / "cache")  # same inputs: no encoding
    assert train(load_job(tmp_path / "job.yaml"), tmp_path / "work", progress="none") == 0
    events = read_events(tmp_path / "work")
    (prec,) = [e for e in events if e["event"] == "base_precision"]
    (swap,) = [e for e in events if e["event"] == "block_swap"]
    assert prec["precision"] == "fp8" and prec["converted_layers"] > 0
    assert swap["swapped"] == 2 and swap["blocks"] == 4 and swap["host_bytes"] > 0
    lora = load_file(str(tmp_path / "work" / "output" / DIFFUSERS_FILE))
    assert [k for k, v in lora.items() if k.endswith("lora_B.weight") and not v.abs().sum() > 0] == []
    mem, _ = _trained(tmp_path / "job.yaml", tmp_path / "work")
    assert isinstance(mem.double_stream_blocks[0].block.attn1.to_q.base_layer, FP8Linear)
    assert isinstance(mem.single_stream_blocks[1].block.ff_i.experts[0].w1, FP8Linear)  # frozen, no LoRA
    assert type(mem.final_layer.linear) is torch.nn.Linear and type(mem.caption_projection[0].linear) is torch.nn.Linear


def test_a_directory_without_llama_is_refused_naming_model_path(run, tmp_path):
    """HiDream-ai's examples hand Llama 3.1 to the pipeline separately; a directory whose model_index.json names no
    text_encoder_4 is refused before anything loads, not a traceback in the text encoder."""
    import shutil

    from engine.config.job import parse_job
    from engine.errors import JobInvalid
    from engine.families import get_family
    from tests.helpers.fakes import RecLog

    model = tmp_path / "no-llama"
    shutil.copytree(run[0], model, ignore=shutil.ignore_patterns("text_encoder_4", "tokenizer_4"))
    index = json.loads((model / "model_index.json").read_text())
    (model / "model_index.json").write_text(json.dumps({**index, "text_encoder_4": [None, None],
                                                        "tokenizer_4": [None, None]}))
    cfg = parse_job(job_dict(model, make_images(tmp_path / "data", IMAGES[:1])), tmp_path)
    with pytest.raises(JobInvalid) as e:
        get_family("hidream").prepare(cfg, tmp_path, RecLog())
    assert str(e.value).startswith("model.path: ") and "text_encoder_4 or tokenizer_4" in str(e.value), str(e.value)


def test_shift_is_the_schedulers_static_one_or_the_pipelines_single_dynamic_mu():
    """Dev/Fast's FlowMatchEuler `shift`, a UniPC scheduler's `flow_shift`; dynamic: calculate_shift of the
    transformer's max_seq, whatever the image's size (HiDreamImagePipeline passes that one μ)."""
    import math

    from diffusers.pipelines.hidream_image.pipeline_hidream_image import calculate_shift

    from engine.families.image.hidream.family import HiDreamModel

    m = HiDreamModel()
    assert m.shift_mu({"shift": 3.0}, 64) == m.shift_mu({"flow_shift": 3.0, "shift": 1.0}, 4096) == math.log(3.0)
    dynamic = {"use_dynamic_shifting": True, "max_seq": 4096}
    assert m.shift_mu(dynamic, 64) == m.shift_mu(dynamic, 1024) == pytest.approx(calculate_shift(4096)) == 1.15
