"""The FP8 frozen linear (engine/frozen_base/fp8.py): accuracy, frozen base, peft composition, and CUDA's _scaled_mm rules.

Accuracy budget (stated): against an fp32 reference that uses the original
fp32 weight, the FP8 layer's output and input gradient have a relative
Frobenius error of at most 5%, and no single token's row more than 10%.
e4m3 keeps 3 mantissa bits (relative rounding error up to 2^-4, about 2.5%
rms per operand), so ~3-4% is what correct per-token/per-channel scaling
gives; a wrong scale, layout or transpose gives O(100%).

The CPU runs `torch._scaled_mm` for real, so these tests check the
tensor-core path's numbers here; `check_scaled_mm` stands in for the layout
checks the CPU kernel does not do.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from engine.frozen_base.fp8 import (
    E4M3,
    FP8Linear,
    ScaledMMRejected,
    check_scaled_mm,
    quantize_rows,
    scaled_mm,
)

REL_TOL = 0.05
ROW_TOL = 0.10


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def worst_row(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm(dim=1) / b.norm(dim=1)).max().item()


def make_input(kind: str, tokens: int = 96, width: int = 256) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(tokens, width, generator=g)
    if kind == "outlier_tokens":  # a few tokens 1000x louder than the rest
        x[::10] *= 1000.0
    elif kind == "outlier_channels":  # LLM.int8-style outlier features in a few channels
        x[:, [3, 77, 200]] *= 60.0
    elif kind == "heavy_tailed":  # Student-t with 2 degrees of freedom: infinite variance
        x = torch.distributions.StudentT(torch.tensor(2.0)).sample((tokens, width))
    elif kind == "zero_rows":  # padding tokens: amax 0 must not divide by zero
        x[5:9] = 0.0
    return x


def reference(lin: nn.Linear, x: torch.Tensor, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    xr = x.clone().requires_grad_(True)
    y = lin(xr)
    y.backward(dy)
    return y.detach(), xr.grad


@pytest.fixture
def lin() -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(256, 384, bias=True)


@pytest.mark.parametrize("kind", ["random", "outlier_tokens", "outlier_channels", "heavy_tailed", "zero_rows"])
@pytest.mark.parametrize("compute", ["scaled_mm", "dequant"])
def test_forward_and_input_gradient_within_budget(lin, kind, compute):
    x = make_input(kind)
    dy = torch.randn(x.shape[0], lin.out_features, generator=torch.Generator().manual_seed(2))
    dy[::7] *= 30.0  # uneven gradient magnitudes across tokens
    y_ref, dx_ref = reference(lin, x, dy)

    layer = FP8Linear.from_linear(lin, compute_dtype=torch.bfloat16, compute=compute)
    assert layer.compute == compute
    xq = x.to(torch.bfloat16).requires_grad_(True)
    y = layer(xq)
    y.backward(dy.to(torch.bfloat16))

    assert y.dtype == torch.bfloat16 and xq.grad.dtype == torch.bfloat16
    assert torch.isfinite(y.float()).all() and torch.isfinite(xq.grad.float()).all()
    live = x.abs().sum(1) > 0
    assert rel(y, y_ref) < REL_TOL, f"forward error {rel(y, y_ref):.4f}"
    assert worst_row(y[live], y_ref[live]) < ROW_TOL
    assert rel(xq.grad, dx_ref) < REL_TOL, f"input-gradient error {rel(xq.grad, dx_ref):.4f}"
    assert worst_row(xq.grad, dx_ref) < ROW_TOL


def test_scaled_mm_path_matches_its_own_maths_exactly_in_fp32():
    # Same quantised operands, computed two ways: the kernel and plain fp32 maths on the dequantised values.
    g = torch.Generator().manual_seed(3)
    a8, sa = quantize_rows(torch.randn(40, 64, generator=g))
    w8, sw = quantize_rows(torch.randn(48, 64, generator=g))
    out = scaled_mm(a8, sa, w8.t(), sw.t(), torch.float32, rowwise=False)
    expect = (a8.float() * sa) @ (w8.float() * sw).t()
    torch.testing.assert_close(out, expect, rtol=1e-5, atol=1e-5)
    out_rw = scaled_mm(a8, sa, w8.t(), sw.t(), torch.bfloat16, rowwise=True)
    torch.testing.assert_close(out_rw.float(), expect, rtol=1e-2, atol=1e-2)


def test_weight_is_stored_in_one_byte_per_parameter_with_per_channel_scales(lin):
    layer = FP8Linear.from_linear(lin)
    assert layer.weight.dtype == E4M3 and layer.weight.element_size() == 1
    assert layer.weight_scale.shape == (lin.out_features, 1) and layer.weight_scale.dtype == torch.float32
    # each output channel's scale is a power of two (exact to divide by), the smallest that keeps its
    # largest weight within e4m3's 448: that weight lands in (224, 448], within a rounding step
    s = layer.weight_scale
    assert torch.equal(torch.frexp(s).mantissa, torch.full_like(s, 0.5))
    top = layer.weight.float().abs().amax(dim=1)
    assert (top > 224 - 16).all() and (top <= 448).all()
    assert ((lin.weight.detach().abs().amax(dim=1, keepdim=True) / s) <= 448).all()
    assert ((lin.weight.detach().abs().amax(dim=1, keepdim=True) / (s / 2)) > 448).all()
    torch.testing.assert_close(layer.dequantized(torch.float32), lin.weight.detach(), rtol=0.07, atol=1e-4)


@pytest.mark.parametrize("compute", ["scaled_mm", "dequant"])
def test_no_gradient_ever_reaches_the_frozen_base(lin, compute):
    layer = FP8Linear.from_linear(lin, compute_dtype=torch.float32, compute=compute)
    x = torch.randn(32, 256, requires_grad=True)
    layer(x).square().sum().backward()
    assert x.grad is not None
    assert not layer.weight.requires_grad and layer.weight.grad is None
    assert layer.bias.grad is None and not layer.bias.requires_grad
    assert all(not p.requires_grad for p in layer.parameters())


@pytest.mark.parametrize("compute", ["scaled_mm", "dequant"])
def test_the_backward_keeps_no_activation_alive(lin, compute):
    # The input gradient needs only W: autograd must save nothing at all for the layer — not the (large)
    # activation, not its FP8 copy, not the weight (block swapping moves it between forward and backward).
    layer = FP8Linear.from_linear(lin, compute=compute)
    x = torch.randn(4, 16, 256, requires_grad=True)
    saved = []

    def pack(t):
        saved.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = layer(x)
    assert saved == []
    y.sum().backward()
    assert x.grad is not None


def test_shapes_that_do_not_fit_fall_back_per_layer():
    odd = nn.Linear(100, 48)
    layer = FP8Linear.from_linear(odd, compute="scaled_mm")
    assert layer.compute == "dequant"  # 100 is not a multiple of 16: CUDA's _scaled_mm would reject it
    x = torch.randn(5, 100)
    assert rel(layer(x), odd(x).detach()) < REL_TOL
    assert FP8Linear.from_linear(nn.Linear(64, 48), compute="scaled_mm").compute == "scaled_mm"


def test_auto_compute_on_cpu_is_the_dequantising_path(lin):
    assert FP8Linear.from_linear(lin).compute == "dequant"


def test_moving_to_another_dtype_is_refused(lin):
    layer = FP8Linear.from_linear(lin)
    with pytest.raises(TypeError, match="float8"):
        layer.to(torch.bfloat16)


def test_transposed_copy_gives_the_same_gradient(lin):
    x = torch.randn(16, 256)
    grads = []
    for keep in (False, True):
        layer = FP8Linear.from_linear(lin, compute="scaled_mm", transposed_copy=keep)
        xq = x.clone().requires_grad_(True)
        layer(xq).sum().backward()
        grads.append(xq.grad)
        assert (layer._weight_t is not None) == keep
    assert torch.equal(grads[0], grads[1])


# ----------------------------------------------------------------- peft on top
def test_peft_lora_wraps_the_fp8_layer_trains_and_keeps_bf16_adapters():
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 32)).to(torch.bfloat16)
    target = torch.randn(64, 32, dtype=torch.bfloat16)
    for i in (0, 2):
        base[i] = FP8Linear.from_linear(base[i], compute="scaled_mm")
    fp8_before = [base[i].weight.clone() for i in (0, 2)]
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=["0", "2"]),
                           autocast_adapter_dtype=False)
    wrapped = model.base_model.model[0]
    assert isinstance(wrapped.base_layer, FP8Linear)
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    assert {p.dtype for p in trainable.values()} == {torch.bfloat16}

    x = torch.randn(64, 64, dtype=torch.bfloat16)
    opt = torch.optim.AdamW(trainable.values(), lr=1e-2)
    losses = []
    for _ in range(30):
        loss = (model(x).float() - target.float()).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0], losses
    assert {p.dtype for p in trainable.values()} == {torch.bfloat16}
    for i, before in zip((0, 2), fp8_before, strict=True):
        layer = model.base_model.model[i].base_layer
        assert layer.weight.grad is None and torch.equal(layer.weight.view(torch.uint8), before.view(torch.uint8))


def test_activation_checkpointing_recomputes_the_fp8_layer_to_the_same_gradients():
    import torch.utils.checkpoint as ckpt

    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64))
    for i in (0, 2):
        base[i] = FP8Linear.from_linear(base[i], compute_dtype=torch.float32, compute="scaled_mm")
    lora = nn.Linear(64, 64, bias=False)  # a trainable layer before the frozen FP8 block
    x = torch.randn(32, 64)
    grads = []
    for use_ckpt in (False, True):
        lora.zero_grad()
        h = lora(x)
        y = ckpt.checkpoint(base, h, use_reentrant=False) if use_ckpt else base(h)
        y.square().mean().backward()
        grads.append(lora.weight.grad.clone())
    assert torch.equal(grads[0], grads[1])


# ----------------------------------------------------------------- CUDA's rules, checked on the CPU
def _ops(m=32, k=64, n=48):
    a = torch.zeros(m, k, dtype=E4M3)
    b = torch.zeros(n, k, dtype=E4M3).t()  # column-major (k, n)
    return a, b


def test_validator_accepts_the_layouts_cuda_runs():
    a, b = _ops()
    one = torch.ones((), dtype=torch.float32)
    assert check_scaled_mm(a, b, one, one, torch.float32) == "tensorwise"
    assert check_scaled_mm(a, b, torch.ones(32, 1), torch.ones(1, 48), torch.bfloat16) == "rowwise"
    a_odd_m = torch.zeros(33, 64, dtype=E4M3)  # M (tokens) need not be a multiple of 16
    assert check_scaled_mm(a_odd_m, b, torch.ones(33, 1), torch.ones(1, 48), torch.bfloat16) == "rowwise"


@pytest.mark.parametrize("case,match", [
    ("k_not_16", "divisible by 16"),
    ("n_not_16", "divisible by 16"),
    ("a_column_major", "first operand row-major"),
    ("b_row_major", "second operand column-major"),
    ("scale_fp16", "float32"),
    ("scale_a_wrong_shape", "row-wise"),
    ("scale_b_wrong_shape", "row-wise"),
    ("scale_b_column", "row-wise"),
    ("rowwise_fp32_out", "bf16 output"),
    ("both_e5m2", "two float8_e5m2"),
    ("bf16_operand", "must be float8"),
    ("bias_with_fp32_out", "bias"),
    ("bias_not_output_dtype", "output dtype"),
    ("rowwise_e5m2_second", "second operand float8_e4m3fn"),
    ("inner_mismatch", "cannot be multiplied"),
    ("unaligned_storage", "aligned"),
])
def test_validator_rejects_what_cuda_rejects(case, match):
    a, b = _ops()
    sa, sb, out = torch.ones(32, 1), torch.ones(1, 48), torch.bfloat16
    bias = None
    if case == "k_not_16":
        a, b = torch.zeros(32, 40, dtype=E4M3), torch.zeros(48, 40, dtype=E4M3).t()
    elif case == "n_not_16":
        b = torch.zeros(40, 64, dtype=E4M3).t()
        sb = torch.ones(1, 40)
    elif case == "a_column_major":
        a = torch.zeros(64, 32, dtype=E4M3).t()
    elif case == "b_row_major":
        b = torch.zeros(64, 48, dtype=E4M3)
    elif case == "scale_fp16":
        sa = sa.half()
    elif case == "scale_a_wrong_shape":
        sa = torch.ones(1, 32)
    elif case == "scale_b_wrong_shape":
        sb = torch.ones(48)
    elif case == "scale_b_column":
        sb = torch.ones(48, 1)
    elif case == "rowwise_fp32_out":
        out = torch.float32
    elif case == "both_e5m2":
        a, b = a.to(torch.float8_e5m2), b.to(torch.float8_e5m2)
    elif case == "bf16_operand":
        a = torch.zeros(32, 64, dtype=torch.bfloat16)
    elif case == "bias_with_fp32_out":
        sa = sb = torch.ones((), dtype=torch.float32)
        out, bias = torch.float32, torch.zeros(48, dtype=torch.bfloat16)
    elif case == "bias_not_output_dtype":
        bias = torch.zeros(48, dtype=torch.float16)  # with the bf16 output
    elif case == "rowwise_e5m2_second":
        b = b.to(torch.float8_e5m2)
    elif case == "inner_mismatch":
        b = torch.zeros(48, 80, dtype=E4M3).t()
    elif case == "unaligned_storage":
        a = torch.zeros(32 * 64 + 1, dtype=E4M3)[1:].view(32, 64)
    with pytest.raises(ScaledMMRejected, match=match):
        check_scaled_mm(a, b, sa, sb, out, bias)


def test_every_scaled_mm_call_in_the_layer_goes_through_the_validator(lin, monkeypatch):
    import engine.frozen_base.scaled_mm as checked

    calls = []
    real = checked.check_scaled_mm
    monkeypatch.setattr(checked, "check_scaled_mm", lambda *a, **k: calls.append(1) or real(*a, **k))
    real_mm = torch._scaled_mm
    mm_calls = []
    monkeypatch.setattr(torch, "_scaled_mm", lambda *a, **k: mm_calls.append(1) or real_mm(*a, **k))
    layer = FP8Linear.from_linear(lin, compute="scaled_mm")
    x = torch.randn(32, 256, requires_grad=True)  # enough rows for FP8 compute (fp8.fp8_compute_pays)
    layer(x).sum().backward()
    assert len(mm_calls) == 2 and len(calls) == len(mm_calls)  # forward + input gradient


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_the_tensor_core_path_matches_the_reference(lin):
    from engine.frozen_base.fp8 import fp8_tensor_cores

    dev = torch.device("cuda")
    if not fp8_tensor_cores(dev):
        pytest.skip("GPU without FP8 tensor cores")
    x = make_input("outlier_tokens")
    dy = torch.randn(x.shape[0], lin.out_features)
    y_ref, dx_ref = reference(lin, x, dy)
    layer = FP8Linear.from_linear(lin.to(dev), compute_dtype=torch.bfloat16)
    assert layer.compute == "scaled_mm"
    xq = x.to(dev, torch.bfloat16).requires_grad_(True)
    y = layer(xq)
    y.backward(dy.to(dev, torch.bfloat16))
    assert rel(y.cpu(), y_ref) < REL_TOL and rel(xq.grad.cpu(), dx_ref) < REL_TOL


def test_a_rocm_gpu_takes_the_dequantising_path_not_scaled_mm(monkeypatch):
    from engine.frozen_base.fp8 import fp8_tensor_cores

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 4))  # an MI300 as ROCm says
    monkeypatch.setattr(torch.version, "hip", None)
    assert fp8_tensor_cores(torch.device("cuda")) is True  # the same capability on CUDA: tensor cores
    monkeypatch.setattr(torch.version, "hip", "6.4.0")
    assert fp8_tensor_cores(torch.device("cuda")) is False


def test_quantising_a_weight_slice_by_slice_gives_the_same_bytes_with_a_bounded_transient():
    from bench.chunked_loss import cpu_peak_bytes
    from engine.frozen_base.fp8 import quantize_rows, quantize_weight_rows

    torch.manual_seed(0)
    w = torch.randn(1024, 1024, dtype=torch.bfloat16)  # 1M parameters
    whole, sliced = quantize_rows(w), quantize_weight_rows(w, chunk=64 * 1024)
    assert torch.equal(whole[0].view(torch.uint8), sliced[0].view(torch.uint8)) and torch.equal(whole[1], sliced[1])
    peak_whole, _, _ = cpu_peak_bytes(quantize_rows, w)
    peak_sliced, _, _ = cpu_peak_bytes(lambda t: quantize_weight_rows(t, chunk=64 * 1024), w)
    n = w.numel()
    assert peak_whole >= 8 * n  # an fp32 copy and |x| (or x / s) alive at once
    # the e4m3 result (1 byte a parameter) and fp32 scales, plus one slice's temporaries (64K elements)
    assert peak_sliced <= n + 4 * 1024 + 16 * 64 * 1024
