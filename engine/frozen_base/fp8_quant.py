"""Row-wise e4m3 quantisation with power-of-two scales and the weight-only matmul: torch references and their ops.

`quantize_rows` is the readable reference (and the fallback on the CPU, ROCm, or without Triton) for the
fused kernel in fp8_triton.py; `quantize_rows_op` (`lorad::quantize_rows_e4m3`) picks between them, so eager
code calls one op and torch.compile sees one. `quantize_activation` lets linears that read the same input
(Q, K, V) quantise it once. `w8_matmul_op` (`lorad::w8_matmul`) is the weight-only path's forward, likewise
fp8_triton's kernel or `w8_matmul`. engine/frozen_base/fp8.py's docstring has the maths.
"""

from __future__ import annotations

import os
import threading
import weakref

import torch

E4M3 = torch.float8_e4m3fn
E4M3_MAX = float(torch.finfo(E4M3).max)  # 448.0
# amax floor: a zero row quantises to zeros with a tiny finite scale instead of dividing by zero.
AMAX_EPS = 1e-12


def pow2_scale(amax: torch.Tensor) -> torch.Tensor:
    """The smallest power of two s with amax / s ≤ 448, elementwise, for fp32 amax > 0.

    amax = m · 2^e with m in [0.5, 1) (frexp), and 448 = 0.875 · 2^9: s = 2^(e - 9), doubled when m > 0.875."""
    mant, exp = torch.frexp(amax)
    return torch.ldexp(torch.ones_like(amax), exp - 9 + (mant > 0.875).to(exp.dtype))


def prescale_rows(x: torch.Tensor, col_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp32 values quantize_rows casts to e4m3, and their per-row scales: x (· col_scale) / s, clamped."""
    xf = x.float()
    if col_scale is not None:
        xf = xf * col_scale.reshape(1, -1).float()
    amax = xf.abs().amax(dim=1, keepdim=True).clamp_(min=AMAX_EPS)
    scale = pow2_scale(amax)
    return (xf / scale).clamp_(-E4M3_MAX, E4M3_MAX), scale


def quantize_rows(x: torch.Tensor, col_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row e4m3 quantisation of a 2-D tensor: (x8 row-major, fp32 power-of-two scales (rows, 1)).

    With `col_scale` (one per column), x · col_scale is quantised: the weight scale folded into a gradient.
    The readable reference: on a CUDA GPU the op `quantize_rows_e4m3` runs fp8_triton's kernel instead."""
    pre, scale = prescale_rows(x, col_scale)
    return pre.to(E4M3).contiguous(), scale.contiguous()


def triton_kernels_usable(device: torch.device) -> bool:
    """fp8_triton's kernels run here: an NVIDIA GPU of sm_89+ (Triton's e4m3 needs it), Triton importable,
    LORAD_FP8_KERNELS not "torch"."""
    device = torch.device(device)
    if device.type != "cuda" or torch.version.hip is not None or torch.cuda.get_device_capability(device) < (8, 9):
        return False
    if os.environ.get("LORAD_FP8_KERNELS", "triton") == "torch":
        return False
    if _TRITON_OK[0] is None:
        try:
            import engine.frozen_base.fp8_triton  # noqa: F401
            _TRITON_OK[0] = True
        except ImportError:
            _TRITON_OK[0] = False
    return _TRITON_OK[0]


_TRITON_OK: list[bool | None] = [None]
# Tests set this to run the kernels on CPU tensors under TRITON_INTERPRET=1, through the op like a GPU would.
KERNELS_ON_CPU = False


@torch.library.custom_op("lorad::quantize_rows_e4m3", mutates_args=(),
                         schema="(Tensor x, Tensor? col_scale) -> (Tensor, Tensor)")
def quantize_rows_op(x: torch.Tensor, col_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_rows as one op: fp8_triton's fused kernel on CUDA, the torch reference elsewhere."""
    if KERNELS_ON_CPU or triton_kernels_usable(x.device):
        from engine.frozen_base import fp8_triton

        return fp8_triton.quantize_rows(x, col_scale)
    return quantize_rows(x, col_scale)


@quantize_rows_op.register_fake
def _(x: torch.Tensor, col_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.empty(x.shape, dtype=E4M3, device=x.device),
            torch.empty((x.shape[0], 1), dtype=torch.float32, device=x.device))


class _LastQuantised(threading.local):
    """The last activation quantised, by the module input it came from: Q, K and V read one tensor in turn."""
    source = None  # weakref to the module input
    key: tuple = ()
    result: tuple[torch.Tensor, torch.Tensor] | None = None


_LAST = _LastQuantised()


def quantize_activation(x2d: torch.Tensor, source: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_rows_e4m3(x2d); reused when `source` (the module input x2d was read from) was just quantised.

    The reuse needs the same tensor object, unmodified (its version counter) and the same dtype and shape; one
    slot per thread, so at most one extra e4m3 copy stays alive. Compiled code quantises each time (inductor
    sees identical pure ops)."""
    x2d = x2d.detach()
    if torch.compiler.is_compiling() or source is None or source.is_inference():
        return quantize_rows_op(x2d, None)
    key = (source._version, source.data_ptr(), x2d.dtype, tuple(x2d.shape))
    cached = _LAST.source() if _LAST.source is not None else None
    if cached is source and _LAST.key == key:
        return _LAST.result
    result = quantize_rows_op(x2d, None)
    _LAST.source, _LAST.key, _LAST.result = weakref.ref(source), key, result
    return result


def forget_quantised() -> None:
    """Drop the shared slot's activation (tests; the end of a step need not call it: one slot is small)."""
    _LAST.source, _LAST.key, _LAST.result = None, (), None


WEIGHT_CHUNK = 1 << 24  # elements per slice when a weight is quantised: 16M fp32 temporaries, about 200 MB


def quantize_weight_rows(w: torch.Tensor, chunk: int = WEIGHT_CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_rows for a frozen weight, a slice of rows at a time: the same bytes, a bounded transient.

    Whole, quantize_rows holds about 12 bytes per parameter at once (fp32 copy, |x|, x / s, then e4m3), a
    few GB for one large layer on the GPU while the model loads. Row by row the result is identical."""
    rows = max(1, chunk // max(1, w.shape[1]))
    w8 = torch.empty(w.shape, dtype=E4M3, device=w.device)
    scale = torch.empty((w.shape[0], 1), dtype=torch.float32, device=w.device)
    for start in range(0, w.shape[0], rows):
        w8[start:start + rows], scale[start:start + rows] = quantize_rows(w[start:start + rows])
    return w8, scale


def w8_matmul(x: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ (diag(w_scale) · W8)ᵀ (+ bias) as a matmul on W8 cast to x's dtype, the scale applied to the result.

    With power-of-two scales these are the numbers a matmul on the dequantised weight gives."""
    y = x @ w8.to(x.dtype).t()
    s_w = w_scale.t().to(y.dtype)
    return torch.addcmul(bias.to(y.dtype), y, s_w) if bias is not None else y * s_w


@torch.library.custom_op("lorad::w8_matmul", mutates_args=(),
                         schema="(Tensor x, Tensor w8, Tensor w_scale, Tensor? bias) -> Tensor")
def w8_matmul_op(x: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The weight-only forward: fp8_triton's kernel (W8 read once, as e4m3) for a few rows on CUDA, else w8_matmul."""
    if KERNELS_ON_CPU or triton_kernels_usable(x.device):
        from engine.frozen_base import fp8_triton

        if x.shape[0] <= fp8_triton.W8_MAX_ROWS:
            return fp8_triton.w8_matmul(x, w8, w_scale, bias)
    return w8_matmul(x, w8, w_scale, bias)


@w8_matmul_op.register_fake
def _(x: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((x.shape[0], w8.shape[0]))
