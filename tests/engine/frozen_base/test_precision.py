"""model.base_precision end to end: the auto choice, which layers become FP8, int8, an fp8 job that
resumes bit-exactly after SIGTERM, and optimizer state that round-trips a checkpoint bit-exactly."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import yaml

import engine.frozen_base.fp8 as fp8
import engine.frozen_base.precision as precision
from engine.frozen_base.fp8 import FP8Linear
from engine.frozen_base.precision import apply_base_precision, convert_linears_to_fp8, resolve
from tests.helpers.fakes import RecLog
from tests.helpers.forked import LM_PRELOAD, ForkedTrainer
from tests.helpers.jobs import (
    QUICKSTART_DATA,
    adapter_bytes,
    deep_update,
    read_events,
    tiny_job,
    tiny_job_dict,
)


# ----------------------------------------------------------------- the choice
def _fake_gpu(monkeypatch, cap):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: f"FakeGPU sm_{cap[0]}{cap[1]}")


@pytest.mark.parametrize("cap,expect", [((9, 0), "fp8"), ((8, 9), "fp8"), ((10, 0), "fp8"), ((8, 6), "bf16"), ((8, 0), "bf16")])
def test_auto_picks_fp8_exactly_on_gpus_with_fp8_tensor_cores(monkeypatch, cap, expect):
    _fake_gpu(monkeypatch, cap)
    got, reason = resolve("auto", torch.device("cuda"))
    assert got == expect
    assert f"sm_{cap[0]}{cap[1]}" in reason and reason.startswith("auto")


def test_auto_on_cpu_is_bf16_and_explicit_choices_are_kept():
    assert resolve("auto", torch.device("cpu"))[0] == "bf16"
    for choice in ("bf16", "fp8", "int8", "nf4"):
        assert resolve(choice, torch.device("cpu"))[0] == choice
    assert "dequantising" in resolve("fp8", torch.device("cpu"))[1]


def test_the_choice_and_reason_are_logged_as_one_event(micro_llama):
    log = RecLog()
    rep = apply_base_precision(micro_llama, "auto", torch.device("cpu"), log)
    assert rep.precision == "bf16" and rep.converted == 0
    [(_, name, kw)] = log.events
    assert name == "base_precision" and kw["precision"] == "bf16" and kw["reason"].startswith("auto")


# ----------------------------------------------------------------- which layers
@pytest.fixture
def micro_llama(micro_model):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(micro_model, dtype=torch.bfloat16)


def test_fp8_converts_every_block_linear_but_never_the_head_or_embeddings(micro_llama):
    ids = torch.randint(3, 200, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = micro_llama(input_ids=ids).logits.float()
    n_block_linears = sum(1 for n, m in micro_llama.named_modules() if type(m) is nn.Linear and ".layers." in n)
    rep = apply_base_precision(micro_llama, "fp8", torch.device("cpu"), fp8_compute="scaled_mm")
    assert rep.converted == n_block_linears == 2 * 7
    assert type(micro_llama.lm_head) is nn.Linear and micro_llama.lm_head.weight.dtype == torch.bfloat16
    assert micro_llama.model.embed_tokens.weight.dtype == torch.bfloat16
    fp8_layers = [m for m in micro_llama.modules() if isinstance(m, FP8Linear)]
    assert len(fp8_layers) == n_block_linears and all(m.compute == "scaled_mm" for m in fp8_layers)
    with torch.no_grad():
        got = micro_llama(input_ids=ids).logits.float()
    # Per-layer errors of ~3.5% compound through 7 quantised matmuls per block: 10% budget for the logits.
    assert ((got - ref).norm() / ref.norm()).item() < 0.10


def test_flux_keeps_its_top_level_projections_but_converts_every_block_linear():
    from diffusers import FluxTransformer2DModel

    flux = FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=1, num_single_layers=2, attention_head_dim=16,
                                  num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32,
                                  guidance_embeds=True, axes_dims_rope=(4, 6, 6)).to(torch.bfloat16)
    block_linears = {n for n, m in flux.named_modules() if type(m) is nn.Linear and "transformer_blocks." in n}
    rep = convert_linears_to_fp8(flux)
    converted = {n for n, m in flux.named_modules() if isinstance(m, FP8Linear)}
    assert converted == block_linears and rep.converted == len(block_linears)
    assert "single_transformer_blocks.0.proj_out" in converted  # not confused with the top-level proj_out
    for top in ("proj_out", "x_embedder", "context_embedder", "norm_out.linear"):
        assert type(flux.get_submodule(top)) is nn.Linear


def test_layers_whose_shapes_do_not_fit_are_reported_and_fall_back():
    model = nn.Sequential(nn.Linear(64, 48), nn.Linear(48, 40), nn.Linear(40, 32))
    rep = convert_linears_to_fp8(model, compute="scaled_mm")
    assert rep.converted == 3 and rep.fallback_layers == ["1", "2"]
    assert [m.compute for m in model] == ["scaled_mm", "dequant", "dequant"]
    # misfits at the start count too, and fitting layers never do
    model = nn.Sequential(nn.Linear(40, 32), nn.Linear(48, 40), nn.Linear(64, 48))
    assert convert_linears_to_fp8(model, compute="scaled_mm").fallback_layers == ["0", "1"]


def test_on_a_device_without_fp8_tensor_cores_nothing_is_a_shape_fallback():
    # auto on the CPU: every layer dequantises anyway, so none is reported as falling back for its shape
    model = nn.Sequential(nn.Linear(64, 48), nn.Linear(48, 40))
    rep = convert_linears_to_fp8(model, compute="auto")
    assert rep.compute == "dequant" and rep.fallback_layers == []


@pytest.mark.parametrize("library", ["transformers", "diffusers"])
def test_load_time_precisions_get_a_bitsandbytes_config_for_either_library(library):
    from engine.frozen_base.precision import quantization_config

    assert quantization_config("fp8", torch.bfloat16, library) is None
    assert quantization_config("bf16", torch.bfloat16, library) is None
    q8 = quantization_config("int8", torch.bfloat16, library)
    q4 = quantization_config("nf4", torch.bfloat16, library)
    assert q8.load_in_8bit and not q8.load_in_4bit
    assert q4.load_in_4bit and q4.bnb_4bit_quant_type == "nf4" and q4.bnb_4bit_use_double_quant
    assert q4.bnb_4bit_compute_dtype == torch.bfloat16
    assert type(q4).__module__.startswith(library)


def test_int8_loads_through_bitsandbytes_and_lora_trains_on_top(micro_model, tmp_path):
    import bitsandbytes as bnb

    from engine.families.causal_lm import CausalLM

    cfg = tiny_job(micro_model, tmp_path, model={"base_precision": "int8", "dtype": "bfloat16"})
    log = RecLog()
    model = CausalLM().load_model(cfg, tmp_path, torch.device("cpu"), log)
    q = model.base_model.model.model.layers[0].self_attn.q_proj
    assert isinstance(q.base_layer, bnb.nn.Linear8bitLt)
    assert log.events[0][1] == "base_precision" and log.events[0][2]["precision"] == "int8"
    ids = torch.randint(3, 200, (2, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    lora = [p for n, p in model.named_parameters() if p.requires_grad]
    assert lora and all(p.grad is not None for p in lora)


def test_fp8_family_load_gives_fp32_adapters_over_fp8_layers(micro_model, tmp_path):
    from engine.families.causal_lm import CausalLM

    cfg = tiny_job(micro_model, tmp_path, model={"base_precision": "fp8", "dtype": "bfloat16"})
    model = CausalLM().load_model(cfg, tmp_path, torch.device("cpu"), RecLog())
    q = model.base_model.model.model.layers[0].self_attn.q_proj
    assert isinstance(q.base_layer, FP8Linear)
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert trainable and {p.dtype for p in trainable} == {torch.float32}  # lora.dtype's default


# ----------------------------------------------------------------- a real fp8 job, interrupted and resumed
@pytest.fixture(scope="module")
def fp8_job(tmp_path_factory, micro_model) -> Path:
    d = deep_update(tiny_job_dict(micro_model, QUICKSTART_DATA), {
        "name": "tiny-fp8",
        "model": {"base_precision": "fp8", "dtype": "bfloat16"},
        "train": {"steps": 16},
        "checkpoint": {"every_steps": 5},
    })
    path = tmp_path_factory.mktemp("fp8job") / "job.yaml"
    path.write_text(yaml.safe_dump(d, sort_keys=False))
    return path


def test_fp8_job_runs_end_to_end_and_resumes_bit_exactly_after_sigterm(fp8_job, tmp_path):
    # scaled_mm forced: the CPU runs the FP8 tensor-core code path (its kernels are deterministic here).
    # Real trainer processes, forked from a server that imported the stack once; the uninterrupted run and the
    # one to be stopped run side by side.
    env = {"LORAD_FP8_COMPUTE": "scaled_mm"}
    ref, wd = tmp_path / "uninterrupted", tmp_path / "interrupted"
    uninterrupted = ForkedTrainer(fp8_job, ref, preload=LM_PRELOAD, **env)
    t = ForkedTrainer(fp8_job, wd, preload=LM_PRELOAD, **env)
    t.wait_step(7)
    t.send(signal.SIGTERM)
    assert t.finish(timeout=300) == 75, t.events[-3:]
    stopped_at = t.named("stopped")[0]["step"]
    assert 7 <= stopped_at < 16
    t = ForkedTrainer(fp8_job, wd, preload=LM_PRELOAD, **env)
    assert t.finish(timeout=300) == 0, t.events[-3:]
    assert t.named("resumed")[0]["from_step"] == stopped_at
    assert uninterrupted.finish(timeout=300) == 0, uninterrupted.events[-3:]
    [ev] = [e for e in read_events(ref) if e["event"] == "base_precision"]
    assert ev["precision"] == "fp8" and ev["compute"] == "scaled_mm" and ev["converted_layers"] == 14
    assert ev["quantisation"] == "torch" and ev["weight_only_below_rows"] == 16  # the CPU: the torch reference

    a, b = adapter_bytes(ref), adapter_bytes(wd)
    assert sorted(a) == sorted(b) and a
    assert [k for k in a if a[k] != b[k]] == []
    from safetensors.torch import load_file

    tensors = load_file(str(wd / "output" / "adapter_model.safetensors"))
    assert {v.dtype for v in tensors.values()} == {torch.float32}  # fp32 adapters over the fp8/bf16 base
    assert any(v.abs().sum() > 0 for k, v in tensors.items() if "lora_B" in k)  # it trained


# ----------------------------------------------------------------- optimizer state through a checkpoint
@pytest.mark.parametrize("opt", ["adamw8bit", "paged_adamw8bit", "adamw"])
def test_optimizer_state_round_trips_a_checkpoint_bit_exactly(opt, tmp_path):
    from engine.checkpoint.state import restore_checkpoint, snapshot
    from engine.checkpoint.store import CheckpointStore
    from engine.config.train import TrainConfig
    from engine.training.optim import build_optimizer

    train = TrainConfig(optimizer=opt, lr=1e-2, weight_decay=0.01)

    def fresh():
        torch.manual_seed(0)
        # 64x128 = 8192 elements: above bitsandbytes' 4096 threshold, so the 8-bit state path is used
        return {"a": nn.Parameter(torch.randn(64, 128)), "b": nn.Parameter(torch.randn(128, 64))}

    def step(params, optimizer, i):
        g = torch.Generator().manual_seed(100 + i)
        for p in params.values():
            p.grad = torch.randn(p.shape, generator=g)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    params = fresh()
    optimizer = build_optimizer(list(params.values()), train)
    for i in range(3):
        step(params, optimizer, i)
    if opt != "adamw":
        assert optimizer.state[params["a"]]["state1"].dtype == torch.uint8  # really 8-bit state
    gen = torch.Generator().manual_seed(5)
    store = CheckpointStore(tmp_path / "ck", "h", keep=2)
    store.commit(snapshot(3, params, optimizer, gen, {"step": 3}))

    params2 = fresh()
    optimizer2 = build_optimizer(list(params2.values()), train)
    loaded, skipped = store.load_latest()
    assert skipped == []
    restore_checkpoint(loaded, params2, optimizer2, torch.Generator())

    def flat(o):
        from engine.training.optim import split_tree

        tensors = {}
        tree = split_tree(o.state_dict(), "", tensors)
        return tree, {k: v.view(-1).view(torch.uint8).clone() for k, v in tensors.items()}

    t1, s1 = flat(optimizer)
    t2, s2 = flat(optimizer2)
    assert t1 == t2 and sorted(s1) == sorted(s2)
    assert [k for k in s1 if not torch.equal(s1[k], s2[k])] == []
    for i in range(3, 6):  # and training continues identically
        step(params, optimizer, i)
        step(params2, optimizer2, i)
    for k in params:
        assert torch.equal(params[k].view(torch.uint8), params2[k].view(torch.uint8))


def test_precision_module_does_not_import_the_daemon():
    for mod in (precision, fp8):
        assert "daemon" not in Path(mod.__file__).read_text()


def test_fp8_conversion_streams_each_layer_onto_the_device_as_it_is_quantised():
    """A base loaded on the host reaches the GPU as FP8 layer by layer; its bf16 copy never sits there whole.

    'meta' stands in for the GPU: the converted layers land there, everything else stays on the host
    until the family moves the rest of the model.
    """
    model = nn.Sequential(nn.Embedding(10, 32), nn.Linear(32, 64), nn.LayerNorm(64), nn.Linear(64, 32))
    report = convert_linears_to_fp8(model, skip="", device=torch.device("meta"))
    assert report.converted == 2
    assert [type(m).__name__ for m in model] == ["Embedding", "FP8Linear", "LayerNorm", "FP8Linear"]
    assert {m.weight.device.type for m in model if type(m).__name__ == "FP8Linear"} == {"meta"}
    assert {m.weight.device.type for m in model if type(m).__name__ != "FP8Linear"} == {"cpu"}
