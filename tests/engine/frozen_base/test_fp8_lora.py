"""An FP8 base and its LoRA as one autograd function (engine/frozen_base/fp8_lora.py), and the FP8 compute rules.

The fused layer must be peft's LoRA Linear in every number and name: in float64 on the weight-only
(dequantising) path y, dx, dA and dB equal peft's within 1e-12, and the state dict's keys are peft's.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import engine.frozen_base.fp8 as fp8
import engine.frozen_base.fp8_quant as fp8_quant
from engine.frozen_base.fp8 import FP8_MIN_ROWS, FP8Linear, fp8_compute_pays
from engine.frozen_base.fp8_lora import FP8LoraLinear, lorad_custom_modules


def wrap(base: nn.Module, targets: list[str], fused: bool, r: int = 4, alpha: int = 12):
    """peft's LoRA on `base`; `fused` registers lorad's custom module for FP8 bases (as adapters.peft_config does)."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0)
    if fused:
        config._register_custom_module(lorad_custom_modules())
    model = get_peft_model(base, config, autocast_adapter_dtype=False)
    g = torch.Generator().manual_seed(7)
    for name, p in model.named_parameters():  # B starts at zero in peft: make both adapter matrices count
        if "lora_" in name:
            p.data = torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.3
    return model


def fp8_base(compute: str, dtype: torch.dtype, bias: bool = True, k: int = 48, n: int = 32) -> nn.Sequential:
    torch.manual_seed(0)
    lin = nn.Linear(k, n, bias=bias).to(dtype)
    return nn.Sequential(FP8Linear.from_linear(lin, compute_dtype=dtype, compute=compute))


def run(model, x: torch.Tensor, dy: torch.Tensor):
    xr = x.clone().requires_grad_(True)
    y = model(xr)
    y.backward(dy)
    layer = model.base_model.model[0]
    return y.detach(), xr.grad, layer.lora_A["default"].weight.grad, layer.lora_B["default"].weight.grad


@pytest.mark.parametrize("bias", [True, False])
def test_in_float64_the_fused_function_equals_peft_linear(bias):
    x = torch.randn(24, 48, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    x[5] = 0.0
    dy = torch.randn(24, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    ref = wrap(fp8_base("dequant", torch.float64, bias), ["0"], fused=False)
    ours = wrap(fp8_base("dequant", torch.float64, bias), ["0"], fused=True)
    assert type(ours.base_model.model[0]) is FP8LoraLinear
    assert type(ref.base_model.model[0]) is not FP8LoraLinear
    assert list(ours.state_dict()) == list(ref.state_dict())  # names, hence every export, unchanged
    for got, want in zip(run(ours, x, dy), run(ref, x, dy), strict=True):
        assert got.dtype == torch.float64
        assert (got - want).abs().max().item() <= 1e-12


def graph_nodes(y: torch.Tensor) -> list[str]:
    """The autograd nodes behind y, views and leaves left out."""
    seen, todo, names = set(), [y.grad_fn], []
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        name = type(node).__name__
        if not (name.startswith(("View", "Reshape", "Unsafe", "AccumulateGrad"))):
            names.append(name)
        todo.extend(n for n, _ in node.next_functions)
    return sorted(names)


def test_the_fused_layer_is_one_autograd_node_over_the_base_and_the_adapter():
    x = torch.randn(2, 16, 48, dtype=torch.bfloat16, requires_grad=True)
    fused = wrap(fp8_base("scaled_mm", torch.bfloat16), ["0"], fused=True)
    assert graph_nodes(fused(x)) == ["FrozenFP8FunctionBackward"]
    peft = wrap(fp8_base("scaled_mm", torch.bfloat16), ["0"], fused=False)
    assert len(graph_nodes(peft(x))) >= 4  # the base, two matmuls, the scaling and the sum as nodes of their own


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_fp8_compute_the_fused_function_matches_peft_over_the_same_base(dtype):
    # The same base maths on both sides (FP8 x and W, _scaled_mm): only the adapter's arithmetic is ordered
    # differently (scaling as addmm's alpha, folded into B in the backward).
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    x = torch.randn(32, 48, generator=torch.Generator().manual_seed(1)).to(dtype)
    dy = torch.randn(32, 32, generator=torch.Generator().manual_seed(2)).to(dtype)
    fp8.forget_quantised()
    got = run(wrap(fp8_base("scaled_mm", dtype), ["0"], fused=True), x, dy)
    want = run(wrap(fp8_base("scaled_mm", dtype), ["0"], fused=False), x, dy)
    for g, w in zip(got, want, strict=True):
        assert ((g.float() - w.float()).norm() / w.float().norm()).item() < tol


def test_forward_gemm_takes_the_bias_and_fast_accumulation_the_input_gradient_does_not(monkeypatch):
    calls = []
    real = torch._scaled_mm
    monkeypatch.setattr(torch, "_scaled_mm", lambda *a, **k: calls.append(k) or real(*a, **k))
    model = wrap(fp8_base("scaled_mm", torch.bfloat16), ["0"], fused=True)
    x = torch.randn(32, 48, dtype=torch.bfloat16, requires_grad=True)
    model(x).sum().backward()
    fwd, bwd = calls
    assert fwd["bias"] is not None and fwd["use_fast_accum"] is True
    assert bwd["bias"] is None and bwd["use_fast_accum"] is False


def test_fast_accumulation_error_against_fp32_is_measured_and_within_budget(record_property):
    """The forward's error (FP8 x and W, fast accumulation) against an fp32 Linear on the original weight.

    On the CPU `use_fast_accum` changes nothing (the error is the quantisation's); on a GPU the same test
    (below, marked gpu) compares both accumulations."""
    torch.manual_seed(0)
    lin = nn.Linear(512, 256)
    x = torch.randn(64, 512)
    want = lin(x).detach()
    layer = FP8Linear.from_linear(lin, compute_dtype=torch.bfloat16, compute="scaled_mm")
    got = layer(x.to(torch.bfloat16)).float()
    err = ((got - want).norm() / want.norm()).item()
    record_property("fp8_forward_rel_error_fast_accum_cpu", err)
    assert err < 0.05


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_fast_accumulation_error_against_fp32(record_property, monkeypatch):
    if not fp8.fp8_tensor_cores(torch.device("cuda")):
        pytest.skip("GPU without FP8 tensor cores")
    torch.manual_seed(0)
    lin = nn.Linear(4096, 1024).cuda()
    x = torch.randn(1024, 4096, device="cuda")
    want = lin(x).detach().double()
    layer = FP8Linear.from_linear(lin, compute_dtype=torch.bfloat16, compute="scaled_mm")
    errs = {}
    real = fp8.scaled_mm
    for fast in (True, False):
        monkeypatch.setattr(fp8, "scaled_mm", lambda *a, _f=fast, **k: real(*a, **{**k, "fast_accum": _f}))
        got = layer(x.to(torch.bfloat16)).double()
        errs[fast] = ((got - want).norm() / want.norm()).item()
        record_property(f"fp8_forward_rel_error_{'fast' if fast else 'exact'}_accum", errs[fast])
    print("forward error against fp32: fast accumulation", errs[True], "exact", errs[False])
    assert errs[True] < 0.05 and errs[False] < 0.05


# ----------------------------------------------------------------- where FP8 compute cannot win
def test_the_size_rule_sends_few_row_calls_to_the_weight_only_path(monkeypatch):
    calls = []
    real = torch._scaled_mm
    monkeypatch.setattr(torch, "_scaled_mm", lambda *a, **k: calls.append(1) or real(*a, **k))
    torch.manual_seed(0)
    lin = nn.Linear(64, 96)
    layer = FP8Linear.from_linear(lin, compute_dtype=torch.float32, compute="scaled_mm")
    assert not fp8_compute_pays(1) and fp8_compute_pays(FP8_MIN_ROWS)
    temb = torch.randn(1, 64, requires_grad=True)  # a modulation linear's input: one row per sample
    y = layer(temb)
    y.sum().backward()
    assert calls == []  # neither the forward nor the input gradient quantised anything
    # the weight-only path is the matmul on the dequantised weight, bit for bit (the scales are powers of two)
    xr = temb.detach().clone().requires_grad_(True)
    want = xr @ layer.dequantized(torch.float32).t() + layer.bias
    want.sum().backward()
    assert torch.equal(y, want) and torch.equal(temb.grad, xr.grad)
    layer(torch.randn(FP8_MIN_ROWS, 64)).sum()
    assert calls == [1]  # tokens: FP8 compute


def test_nested_modulation_linears_are_fp8_stored_and_take_the_weight_only_path(monkeypatch):
    """`norm1.linear` deep inside a block (DEFAULT_SKIP matches only top-level names): FP8 storage, no FP8 GEMM."""
    from engine.frozen_base.precision import convert_linears_to_fp8

    block = nn.Module()
    block.norm1 = nn.Module()
    block.norm1.linear = nn.Linear(32, 96)
    block.to_q = nn.Linear(32, 32)
    model = nn.ModuleDict({"transformer_blocks": nn.ModuleList([block])})
    convert_linears_to_fp8(model, compute="scaled_mm")
    mod = model["transformer_blocks"][0].norm1.linear
    assert isinstance(mod, FP8Linear) and mod.path_for(2) == "weight_only"
    assert model["transformer_blocks"][0].to_q.path_for(4096) == "fp8"


class _Attention(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.to_q, self.to_k, self.to_v = (nn.Linear(32, 32) for _ in range(3))

    def forward(self, x):
        return self.to_q(x) + 2 * self.to_k(x) + 3 * self.to_v(x)


@pytest.mark.parametrize("lora", [False, True])
def test_q_k_and_v_share_one_activation_quantisation(lora, monkeypatch):
    attn = _Attention().to(torch.bfloat16)
    for name in ("to_q", "to_k", "to_v"):
        setattr(attn, name, FP8Linear.from_linear(getattr(attn, name), compute="scaled_mm"))
    model = wrap(attn, ["to_q", "to_k", "to_v"], fused=True) if lora else attn
    calls = []
    real = fp8_quant.quantize_rows_op
    monkeypatch.setattr(fp8_quant, "quantize_rows_op", lambda *a: calls.append(a[1] is None) or real(*a))
    x = torch.randn(2, 16, 32, dtype=torch.bfloat16)
    fp8.forget_quantised()
    y = model(x)
    assert calls == [True]  # one activation quantisation for three projections
    x2 = x.clone()
    unshared = []
    for name in ("to_q", "to_k", "to_v"):  # each on its own input object: three quantisations, same numbers
        fp8.forget_quantised()
        unshared.append(getattr(model.base_model.model if lora else model, name)(x2.clone()))
    assert torch.equal(y, unshared[0] + 2 * unshared[1] + 3 * unshared[2])
    calls.clear()
    x.mul_(2)  # changed in place: the cached quantisation is stale and must not be used
    y2 = model(x)
    assert calls == [True]
    assert not torch.equal(y, y2)
    fp8.forget_quantised()


def test_the_training_path_registers_the_fused_layer_for_lora_but_not_dora():
    from engine.config.lora import LoraConfig
    from engine.training.adapters import peft_config

    assert peft_config(LoraConfig(rank=4), ["to_q"])._custom_modules == {FP8Linear: FP8LoraLinear}
    assert not peft_config(LoraConfig(rank=4, type="dora"), ["to_q"])._custom_modules


def test_the_quantisation_op_passes_opcheck_and_the_fused_layer_compiles_whole():
    """torch.library's checks of the op (schema, fake impl, autograd registration), and torch.compile tracing
    base + LoRA without a graph break, to the eager numbers."""
    x = torch.randn(32, 48)
    torch.library.opcheck(fp8.quantize_rows_op, (x, None))
    torch.library.opcheck(fp8.quantize_rows_op, (x.bfloat16(), torch.rand(48)))
    w8, s_w = fp8_quant.quantize_rows(torch.randn(32, 48))
    # (opcheck's schema test multiplies every input, which float8 tensors do not support on the CPU)
    torch.library.opcheck(fp8.w8_matmul_op, (x[:2], w8, s_w, torch.randn(32)),
                          test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"))
    model = wrap(fp8_base("scaled_mm", torch.float32), ["0"], fused=True)
    dy = torch.randn(32, 32)
    eager = [t.clone() for t in run(model, x, dy)]
    model.zero_grad()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    fp8.forget_quantised()
    xr = x.clone().requires_grad_(True)
    y = compiled(xr)
    y.backward(dy)
    layer = model.base_model.model[0]
    got = (y.detach(), xr.grad, layer.lora_A["default"].weight.grad, layer.lora_B["default"].weight.grad)
    for g, e in zip(got, eager, strict=True):
        assert torch.equal(g, e)


def test_the_kernels_run_only_on_gpus_with_e4m3_and_can_be_turned_off(monkeypatch):
    from engine.frozen_base.fp8_quant import triton_kernels_usable

    cuda = torch.device("cuda")
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))  # an A100: no e4m3
    assert not triton_kernels_usable(cuda)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert triton_kernels_usable(cuda)  # an H100 with Triton (installed here: the train extra)
    monkeypatch.setenv("LORAD_FP8_KERNELS", "torch")
    assert not triton_kernels_usable(cuda)
    monkeypatch.delenv("LORAD_FP8_KERNELS")
    monkeypatch.setattr(torch.version, "hip", "6.4.0")
    assert not triton_kernels_usable(cuda)
    assert not triton_kernels_usable(torch.device("cpu"))
