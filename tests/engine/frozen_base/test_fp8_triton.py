"""The Triton kernels (engine/frozen_base/fp8_triton.py) against their torch forms (fp8_quant.py): the fused
quantisation bit for bit, the weight-only path's few-row matmul within fp32 summation's bound.

Run on the CPU by Triton's interpreter (TRITON_INTERPRET=1, set before the kernel module is imported). Held
equal bit for bit: the power-of-two scales, the fp32 values before the cast, and the e4m3 bytes. The
interpreter's own float-to-e4m3 cast differs from torch's (ties away from zero, a lost carry, flushed
subnormals: `test_the_interpreters_own_cast_is_not_torchs` names them); the kernel rounds to the e4m3 grid
itself so that its bytes do not depend on it. Tensors are small: the interpreter runs each program in numpy.
"""

from __future__ import annotations

import importlib

import pytest
import torch

import engine.frozen_base.fp8 as fp8
import engine.frozen_base.fp8_quant as fp8_quant
from engine.frozen_base.fp8 import FP8Linear
from engine.frozen_base.fp8_quant import E4M3, prescale_rows, quantize_rows

pytest.importorskip("triton")


@pytest.fixture(scope="module")
def kern():
    """fp8_triton, its kernel interpreted on the CPU (TRITON_INTERPRET=1, set by tests/conftest.py before
    anything imports triton), or compiled where there is a GPU."""
    mod = importlib.import_module("engine.frozen_base.fp8_triton")
    from triton.runtime.interpreter import InterpretedFunction

    interpreted = isinstance(mod._quantize_rows_kernel, InterpretedFunction)
    if not interpreted and not torch.cuda.is_available():
        pytest.fail("triton was imported without TRITON_INTERPRET=1: tests/conftest.py sets it before any import")
    mod.device = torch.device("cpu" if interpreted else "cuda")
    return mod


def run(kern, x, col_scale=None, **kw):
    """The kernel on its device (the interpreter: the CPU), the results back on the CPU."""
    col_scale = col_scale.to(kern.device) if col_scale is not None else None
    return tuple(t.cpu() for t in kern.quantize_rows(x.to(kern.device), col_scale, **kw))


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits, so -0.0 and 0.0 (and NaNs) compare as what they are."""
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def edge_rows(dtype: torch.dtype) -> torch.Tensor:
    """7 rows × 40 columns (not a power of two: the last block is masked) covering the edge cases."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 40, generator=g)
    x[1] = 0.0  # padding: the amax floor, not a division by zero
    x[2, :] = -0.0
    x[2, 5] = 0.0
    x[3] *= 3e4  # large
    x[3, 7] = -3e4 * 8
    x[4] = torch.logspace(-30, 2, 40)  # thirty decades: most fall into e4m3's subnormals or to zero
    # a row whose amax is 448 · 2^3, so x / s = x / 8 exactly: ties and carries of the e4m3 grid
    x[5, :8] = torch.tensor([448.0, 1.0625, 1.1875, 1.9375, -1.9375, 3.875, 0.0029296875, -0.0009765625]) * 8
    x[6] = torch.randn(40, generator=g) * 1e-6  # tiny but normal
    if dtype == torch.bfloat16:
        x[0, 0] = 3.0e38  # near bf16's (and fp32's) largest
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("block", [None, 16])  # None: the row in one block; 16: the two-pass path for wide rows
def test_triton_kernel_equals_the_torch_reference_bit_for_bit(kern, dtype, block):
    x = edge_rows(dtype)
    pre_ref, s_ref = prescale_rows(x)
    q_ref, _ = quantize_rows(x)
    pre, s = run(kern, x, precast=True, block=block)
    q, s2 = run(kern, x, block=block)
    assert torch.equal(bits(s), bits(s_ref)) and torch.equal(bits(s2), bits(s_ref))
    assert torch.equal(bits(pre), bits(pre_ref))
    assert q.dtype == E4M3 and torch.equal(bits(q), bits(q_ref))
    # the cases are really there: a zero row at the floor scale, a negative zero, e4m3 subnormals
    assert s[1].item() == fp8_quant.pow2_scale(torch.tensor([fp8_quant.AMAX_EPS])).item()
    assert bits(q)[2, 0].item() == 0x80 and bits(q)[2, 5].item() == 0x00
    assert ((bits(q[4]) & 0x78) == 0).any() and (bits(q[4]) & 0x07).ne(0).logical_and((bits(q[4]) & 0x78) == 0).any()


def test_triton_kernel_folds_the_weight_scale_into_a_gradient(kern):
    torch.manual_seed(1)
    w = torch.randn(24, 16)
    _, s_w = quantize_rows(w)  # power-of-two weight scales, one per output channel (dy's columns)
    dy = torch.randn(9, 24, dtype=torch.bfloat16) * torch.logspace(-3, 3, 9).to(torch.bfloat16)[:, None]
    dy[4] = 0.0
    pre_ref, s_ref = prescale_rows(dy, s_w.reshape(-1))
    q_ref, _ = quantize_rows(dy, s_w.reshape(-1))
    pre, s = run(kern, dy, s_w.reshape(-1), precast=True)
    q, _ = run(kern, dy, s_w.reshape(-1))
    assert torch.equal(bits(s), bits(s_ref)) and torch.equal(bits(pre), bits(pre_ref))
    assert torch.equal(bits(q), bits(q_ref))
    # and the fold is what it says: the reference quantises dy · s_w
    assert torch.equal(bits(q_ref), bits(quantize_rows(dy.float() * s_w.t())[0]))


def test_triton_scales_are_the_smallest_power_of_two_within_e4m3(kern):
    amax = torch.tensor([[1e-12], [1.0], [1.75], [1.7500001], [448.0], [448.00003], [3.0e38], [2.0 ** -20]])
    x = torch.cat([amax, torch.zeros(amax.shape[0], 15)], dim=1)
    _, s = run(kern, x)
    assert torch.equal(torch.frexp(s).mantissa, torch.full_like(s, 0.5))  # powers of two
    assert (amax / s <= 448).all() and (amax / (s / 2) > 448).all()
    assert s[4].item() == 1.0 and s[5].item() == 2.0 and s[1].item() == 2.0 ** -8


def test_the_interpreters_own_cast_is_not_torchs(kern):
    """Why the kernel rounds by itself: the named differences of the interpreter's float-to-e4m3 cast."""
    if kern.device.type != "cpu":
        pytest.skip("about Triton's interpreter")
    import triton
    import triton.language as tl

    @triton.jit
    def cast(x_ptr, o_ptr, N: tl.constexpr):
        i = tl.arange(0, N)
        tl.store(o_ptr + i, tl.load(x_ptr + i).to(tl.float8e4nv))

    values = torch.tensor([1.0625,  # a tie between 1.0 and 1.125: torch rounds to even, the interpreter away
                           1.9375,  # rounds up to 2.0: the interpreter loses the carry into the odd exponent
                           0.00146484375,  # 0.75 · 2^-9, an e4m3 subnormal's tie-breaking neighbour
                           1.25, 3.5, -0.5, 0.0, 448.0])  # exact values: both casts agree
    out = torch.empty(8, dtype=E4M3)
    cast[(1,)](values, out, 8)
    ours, torchs = bits(out).tolist(), bits(values.to(E4M3)).tolist()
    assert ours[3:] == torchs[3:]
    assert [ours[i] != torchs[i] for i in range(3)] == [True, True, True]
    assert (ours[1], torchs[1]) == (0x38, 0x40)  # 1.0 instead of 2.0


def test_the_layer_through_the_op_runs_the_kernel_and_gives_the_torch_paths_numbers(kern, monkeypatch):
    """An FP8Linear on FP8 compute with the op routed to the kernel (as on a GPU): same y and dx, bit for bit."""
    if kern.device.type != "cpu":
        pytest.skip("routes CPU tensors to the interpreted kernel")
    torch.manual_seed(2)
    layer = FP8Linear.from_linear(torch.nn.Linear(32, 48), compute="scaled_mm")
    x = torch.randn(20, 32, dtype=torch.bfloat16)
    x[3] = 0.0
    dy = torch.randn(20, 48, dtype=torch.bfloat16)
    results = []
    calls = []
    real = kern.quantize_rows
    monkeypatch.setattr(kern, "quantize_rows", lambda *a, **k: calls.append(1) or real(*a, **k))
    for on_kernel in (False, True):
        monkeypatch.setattr(fp8_quant, "KERNELS_ON_CPU", on_kernel)
        fp8.forget_quantised()
        xr = x.clone().requires_grad_(True)
        y = layer(xr)
        y.backward(dy)
        results.append((y, xr.grad))
        assert len(calls) == (2 if on_kernel else 0)  # forward x and backward dy, both by the kernel, only when routed there
    assert torch.equal(bits(results[0][0]), bits(results[1][0]))
    assert torch.equal(bits(results[0][1]), bits(results[1][1]))


def test_the_kernel_modules_constants_are_the_references(kern):
    assert (kern.AMAX_EPS, kern.E4M3_MAX, kern.E4M3) == (fp8_quant.AMAX_EPS, fp8_quant.E4M3_MAX, fp8_quant.E4M3)


@pytest.mark.parametrize("rows,bias", [(1, True), (3, False), (16, True)])
def test_triton_weight_only_matmul_reads_e4m3_and_equals_the_exact_product(kern, rows, bias):
    """The few-row weight-only path's kernel: x @ (s_w · W8)ᵀ + b with an fp32 accumulator, rounded once.

    Held to the float64 product within fp32 summation's error bound (K terms, in any order) plus one step of
    the output dtype: a whole bf16 step, not half, because Triton's interpreter truncates fp32 to bf16 (another
    of its casts that is not the GPU's, which rounds to nearest). 48 outputs and 40 inputs: the last output block
    and every input block are masked."""
    torch.manual_seed(3)
    w8, s_w = quantize_rows(torch.randn(48, 40))
    wd = w8.double() * s_w.double()
    b = torch.randn(48) if bias else None
    x = torch.randn(rows, 40)
    x[rows // 2] = 0.0
    for dtype, out_eps in ((torch.float32, 2.0 ** -23), (torch.bfloat16, 2.0 ** -7)):
        xq, bq = x.to(dtype), (b.to(dtype) if bias else None)
        want = xq.double() @ wd.t() + (bq.double() if bias else 0.0)
        bound = (xq.double().abs() @ wd.abs().t()) * 41 * 2.0 ** -24 + want.abs() * out_eps
        dev = kern.device
        got = kern.w8_matmul(xq.to(dev), w8.to(dev), s_w.to(dev), bq.to(dev) if bias else None).cpu()
        assert got.dtype == dtype and got.shape == (rows, 48)
        assert ((got.double() - want).abs() <= bound).all(), dtype
        assert (got[rows // 2] == (bq if bias else 0.0)).all()  # the zero row: the bias alone
    with pytest.raises(ValueError, match="at most 16 rows"):
        kern.w8_matmul(torch.zeros(17, 40, device=kern.device), w8.to(kern.device), s_w.to(kern.device), None)


def test_a_modulation_call_through_the_op_runs_the_weight_only_kernel(kern, monkeypatch):
    if kern.device.type != "cpu":
        pytest.skip("routes CPU tensors to the interpreted kernel")
    torch.manual_seed(4)
    layer = FP8Linear.from_linear(torch.nn.Linear(32, 96), compute="scaled_mm", compute_dtype=torch.float32)
    temb = torch.randn(1, 32)
    calls = []
    real = kern.w8_matmul
    monkeypatch.setattr(kern, "w8_matmul", lambda *a: calls.append(1) or real(*a))
    want = layer(temb)
    monkeypatch.setattr(fp8_quant, "KERNELS_ON_CPU", True)
    got = layer(temb)
    assert calls == [1]
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
