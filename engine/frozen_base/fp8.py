"""A frozen linear layer whose weight lives in FP8 and whose matmuls run on FP8 tensor cores.

Storage
-------
The frozen base weight W (out × in) is stored as float8_e4m3fn with one fp32
scale per output channel (row of W):

    s_w[o] = pow2(max(amax(|W[o, :]|), eps))        pow2(a): the smallest power of two s with a / s ≤ 448
    W8[o, k] = e4m3(W[o, k] / s_w[o])                  so  W ≈ diag(s_w) · W8

(448 is the largest finite e4m3 value.) Every scale, weight, activation and gradient, is a power of two:
dividing by one is exact, so the fused Triton kernels (fp8_triton.py) give the torch reference's bytes, and
dequantising is exact too (W8 · s_w is a bf16 number), which makes the weight-only path below the same
numbers as a matmul with the dequantised weight. A row's largest value lands in (224, 448]: e4m3 is a
floating-point format, so this costs no resolution except at the bottom of its range.

One byte per parameter plus 4 bytes per output channel. The weight never
receives a gradient: it is a `requires_grad=False` parameter and the autograd
function below returns no gradient for it (LoRA trains the adapters only).

Forward (y = x Wᵀ)
------------------
The activation is quantised per token (per row of the flattened input), with
its amax clamped away from zero so an all-zero row (padding) gives scale eps,
not a division by zero:

    s_x[t] = pow2(max(amax(|x[t, :]|), eps)),    x8 = e4m3(x / s_x)
    y[t, o] = s_x[t] · s_w[o] · Σ_k x8[t, k] · W8[o, k]

Per-token scales keep one outlier token from crushing the resolution of every
other token (a per-tensor scale would). On the GPU this is one
`torch._scaled_mm(x8, W8ᵀ, scale_a=s_x (T×1), scale_b=s_wᵀ (1×O))` with bf16
output ("row-wise" scaling). `W8ᵀ` is a free view: W8 is stored row-major
(O × K), so its transpose is exactly the column-major K × O operand cuBLASLt
wants. Where row-wise scaling is not available (older torch/CUDA, or a
non-bf16 output) we call the tensor-wise kernel with unit scales, take an fp32
result and multiply by s_x · s_w afterwards.

Input gradient (dx = dy W)
--------------------------
    dx[t, k] = Σ_o dy[t, o] · s_w[o] · W8[o, k]

Here the weight scale lies along the *contracted* dimension, where a GEMM
cannot apply it as an output scale. So we fold it into the gradient first,
g = dy · s_w (broadcast over tokens), quantise g per token (s_g, g8) exactly
like an activation, and compute

    dx[t, k] = s_g[t] · Σ_o g8[t, o] · W8[o, k]  =  _scaled_mm(g8, W8_colmajor, s_g, ones(1×K))

The second operand must be W8 (O × K) in column-major order, i.e. the bytes
of W8ᵀ laid out row-major. We build that transposed FP8 copy on the fly in
each backward (one O·K byte read and write, ~1/(T) of the GEMM's work at
thousands of tokens) instead of keeping a persistent copy: a persistent copy
would double the base weight's memory to 2 bytes/param — as much as bf16 —
and throw away the memory saving that is half the point of FP8. The
`transposed_copy=True` option keeps the copy for those who have the memory
and want the last few percent; bench/engine_speed.py can measure both. (The
kept copy lives on the GPU and is not streamed by block swapping: do not
combine the two.)
We quantise gradients to e4m3 (not e5m2): per-token scaling already gives
the range, and e4m3's extra mantissa bit halves the rounding error.

Nothing but the module itself is saved for backward: the input gradient needs
only W, not x, so the FP8 base keeps no activations alive at all (the LoRA
branch saves its own small ones). Reading the weight from the module at
backward time (instead of saving the tensor) is also what lets block
swapping (engine/frozen_base/blockswap.py) move it between host and GPU in between.

Fused quantisation, the size rule, LoRA in the same function
-------------------------------------------------------------
On a CUDA GPU with Triton the activation's and the gradient's quantisation is one kernel each
(fp8_triton.py: one read of bf16, one write of e4m3 and scales; the gradient read once with s_w folded in),
registered as the torch.library op `lorad::quantize_rows_e4m3`, so eager calls the kernel and
torch.compile sees one op. `quantize_rows` below is the reference and runs everywhere else.
The bias goes into `_scaled_mm` and the forward GEMM accumulates fast (`use_fast_accum`, as torchao and
TransformerEngine do for the forward; the input-gradient GEMM keeps the exact accumulation).
Linears that read the same input one after the other (Q, K, V; a single block's proj_mlp and Q) quantise
it once (`quantize_activation`). A call with few rows (`fp8_compute_pays`: the modulation linears, M = the
batch) takes the weight-only path: FP8 storage, a bf16 matmul on W8 with s_w applied to the result.
With peft's LoRA on top, engine/frozen_base/fp8_lora.py puts base and adapter into this module's one
autograd function (`FrozenFP8Function`).

Fallbacks
---------
- `dequant` compute (the weight-only path): a bf16 matmul on W8 cast to bf16, s_w applied to its
  result (forward) or folded into dy (input gradient); with power-of-two scales these are the numbers a
  matmul with the dequantised weight gives. Used on the CPU and on GPUs without FP8 tensor cores
  (before sm_89); same storage, same gradients' maths, bf16 speed.
- Per layer: a layer whose in/out features are not multiples of 16 cannot be
  fed to `_scaled_mm` on CUDA and uses `dequant` (the choice is made once at
  construction, and `FP8Linear.compute` says which).

CUDA's rules for `_scaled_mm` are checked in our own code before every call
(`check_scaled_mm`), because the CPU kernel accepts layouts CUDA rejects and
CPU tests must catch such bugs before a GPU does.
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import Literal

import torch
import torch.nn as nn

E4M3 = torch.float8_e4m3fn
E4M3_MAX = float(torch.finfo(E4M3).max)  # 448.0
# amax floor: a zero row quantises to zeros with a tiny finite scale instead of dividing by zero.
AMAX_EPS = 1e-12
FP8_TYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
ALIGN = 16

Compute = Literal["auto", "scaled_mm", "dequant"]


class ScaledMMRejected(ValueError):
    """The operands break a rule CUDA's `torch._scaled_mm` enforces."""


def check_scaled_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                    out_dtype: torch.dtype, bias: torch.Tensor | None = None) -> str:
    """Enforce CUDA's `_scaled_mm(a, b, scale_a, scale_b, out_dtype)` rules; return "tensorwise" or "rowwise".

    The rules (torch's ScaledBlas.cpp and cuBLASLt on sm_89/sm_90):
    both operands 2-D float8 with matching inner size, not both e5m2; `a`
    row-major and `b` column-major (the only combination H100 cuBLASLt runs);
    a's inner dim and both of b's dims multiples of 16; 16-byte aligned
    storage; scales fp32 and either single-element (tensor-wise) or a
    contiguous (M, 1) and (1, N) pair (row-wise); row-wise output bf16 (the
    only dtype every torch release since 2.4 accepts) and second operand e4m3
    (CUTLASS's row-wise kernel); a bias of the output's dtype (bf16/fp16),
    never with an fp32 output.
    """
    def no(msg: str) -> None:
        raise ScaledMMRejected(msg)

    if a.dim() != 2 or b.dim() != 2:
        no(f"_scaled_mm takes 2-D operands, got {tuple(a.shape)} and {tuple(b.shape)}")
    if a.dtype not in FP8_TYPES or b.dtype not in FP8_TYPES:
        no(f"_scaled_mm operands must be float8, got {a.dtype} and {b.dtype}")
    if a.dtype == torch.float8_e5m2 and b.dtype == torch.float8_e5m2:
        no("_scaled_mm cannot multiply two float8_e5m2 matrices")
    m, k = a.shape
    k2, n = b.shape
    if k != k2:
        no(f"_scaled_mm shapes cannot be multiplied: {m}x{k} and {k2}x{n}")
    if k % ALIGN:
        no(f"_scaled_mm needs the inner dimension of the first operand divisible by 16, got {m}x{k}")
    if k2 % ALIGN or n % ALIGN:
        no(f"_scaled_mm needs both dimensions of the second operand divisible by 16, got {k2}x{n}")
    if not (a.stride(1) == 1 and a.stride(0) >= max(k, 1)):
        no(f"_scaled_mm needs the first operand row-major, got strides {a.stride()} for shape {tuple(a.shape)}")
    if not (b.stride(0) == 1 and b.stride(1) >= max(k2, 1)):
        no(f"_scaled_mm needs the second operand column-major, got strides {b.stride()} for shape {tuple(b.shape)}")
    for name, t in (("first operand", a), ("second operand", b)):
        ld = t.stride(0) if t is a else t.stride(1)
        if ld % ALIGN:
            no(f"_scaled_mm needs the {name}'s leading dimension a multiple of 16 bytes, got {ld}")
        if not torch.compiler.is_compiling() and t.data_ptr() % ALIGN:
            no(f"_scaled_mm needs the {name}'s storage 16-byte aligned")
    if scale_a.dtype != torch.float32 or scale_b.dtype != torch.float32:
        no(f"_scaled_mm scales must be float32, got {scale_a.dtype} and {scale_b.dtype}")
    if scale_a.numel() == 1 and scale_b.numel() == 1:
        kind = "tensorwise"
    elif (scale_a.dim() == 2 and tuple(scale_a.shape) == (m, 1) and scale_a.is_contiguous()
          and scale_b.dim() == 2 and tuple(scale_b.shape) == (1, n) and scale_b.is_contiguous()):
        kind = "rowwise"
    else:
        no(f"_scaled_mm scales must be single-element (tensor-wise) or ({m}, 1) and (1, {n}) contiguous "
           f"(row-wise); got {tuple(scale_a.shape)} and {tuple(scale_b.shape)}")
    if out_dtype not in (torch.bfloat16, torch.float16, torch.float32):
        no(f"_scaled_mm output dtype must be bf16, fp16 or fp32 here, got {out_dtype}")
    if kind == "rowwise" and out_dtype != torch.bfloat16:
        no(f"row-wise _scaled_mm needs a bf16 output, got {out_dtype}")
    if kind == "rowwise" and b.dtype != torch.float8_e4m3fn:
        no(f"row-wise _scaled_mm needs the second operand float8_e4m3fn, got {b.dtype}")
    if bias is not None:
        if out_dtype == torch.float32:
            no("_scaled_mm cannot add a bias with a float32 output")
        if bias.dtype != out_dtype or bias.numel() != n:
            no(f"_scaled_mm bias must be {out_dtype} (the output dtype) of size {n}, "
               f"got {bias.dtype} of size {bias.numel()}")
    devs = {t.device for t in (a, b, scale_a, scale_b)}
    if len(devs) != 1:
        no(f"_scaled_mm operands and scales must be on one device, got {sorted(map(str, devs))}")
    return kind


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
    """fp8_triton's kernels run here: a CUDA (not ROCm) GPU, Triton importable, LORAD_FP8_KERNELS not "torch"."""
    if torch.device(device).type != "cuda" or torch.version.hip is not None:
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


def scaled_mm(a8: torch.Tensor, a_scale: torch.Tensor, b8: torch.Tensor, b_scale: torch.Tensor,
              out_dtype: torch.dtype, rowwise: bool, bias: torch.Tensor | None = None,
              fast_accum: bool = False) -> torch.Tensor:
    """(a_scale ⊙ a8) @ (b8 ⊙ b_scale) (+ bias) for per-row a_scale (M,1) and per-column b_scale (1,N).

    Row-wise: one `_scaled_mm` call with the scales and the bias fused. Otherwise: the tensor-wise kernel
    with unit scales into fp32, then the scales and bias applied after the GEMM (the fp32 accumulator
    result loses nothing before scaling). `fast_accum`: cuBLASLt's faster, less exact accumulation.
    """
    if rowwise and out_dtype == torch.bfloat16:
        bias = bias.to(out_dtype) if bias is not None else None
        check_scaled_mm(a8, b8, a_scale, b_scale, out_dtype, bias)
        return torch._scaled_mm(a8, b8, scale_a=a_scale, scale_b=b_scale, bias=bias, out_dtype=out_dtype,
                                use_fast_accum=fast_accum)
    one = torch.ones((), dtype=torch.float32, device=a8.device)
    check_scaled_mm(a8, b8, one, one, torch.float32)
    out = torch._scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=torch.float32, use_fast_accum=fast_accum)
    out = out * a_scale * b_scale
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


FP8_MIN_ROWS = 16


def fp8_compute_pays(rows: int) -> bool:
    """The size rule: does FP8 compute (quantise x, `_scaled_mm`) run for a call with `rows` rows (tokens)?

    Below FP8_MIN_ROWS the weight-only path runs instead (FP8 storage, a bf16 matmul on W8): the
    modulation linears (`norm*.linear` at any depth; M = the batch) and the time/text embedders, where the
    GEMM is a matrix-vector product bound by reading the weight and quantising the activation buys nothing.
    FP8_MIN_ROWS = 16 is a placeholder that separates "rows = batch" from "rows = tokens", not a
    measurement: where FP8 compute starts to win (as a function of rows and the layer's size) is to be
    measured on a GPU (issue 45) and written here.
    """
    return rows >= FP8_MIN_ROWS


def _base_forward(layer: FP8Linear, x2d: torch.Tensor, path: str, x8: torch.Tensor | None,
                  sx: torch.Tensor | None) -> torch.Tensor:
    if path == "fp8":  # W8 is (O, K) row-major; .t() is the column-major (K, O) operand
        return scaled_mm(x8, sx, layer.weight.t(), layer.weight_scale.t(), x2d.dtype, layer.rowwise,
                         bias=layer.bias, fast_accum=True)
    y = x2d @ layer.weight.to(x2d.dtype).t()
    s_w = layer.weight_scale.t().to(y.dtype)  # powers of two: exact in bf16, and scaling the result is exact
    return torch.addcmul(layer.bias.to(y.dtype), y, s_w) if layer.bias is not None else y * s_w


def _base_backward(layer: FP8Linear, dy: torch.Tensor, path: str, out_dtype: torch.dtype) -> torch.Tensor:
    if path == "fp8":
        g8, sg = quantize_rows_op(dy, layer.weight_scale.reshape(-1))  # s_w[o] folded into the gradient
        w_col = layer.weight_colmajor()  # (O, K) column-major
        ones = torch.ones((1, w_col.shape[1]), dtype=torch.float32, device=dy.device)
        return scaled_mm(g8, sg, w_col, ones, out_dtype, layer.rowwise)
    dy = dy.to(out_dtype)
    return (dy * layer.weight_scale.t().to(dy.dtype)) @ layer.weight.to(dy.dtype)


class FrozenFP8Function(torch.autograd.Function):
    """y = x Wᵀ (+ b) (+ scaling · (x Aᵀ) Bᵀ): the frozen FP8 base and, if given, its LoRA, in one function.

    Gradients for x and the adapter (A, B) only. `path` is "fp8" (x8, sx: x quantised, maybe shared) or
    "weight_only". The base saves nothing (the input gradient needs only W, read from the module at backward
    time: block swapping may move it in between); the adapter saves x and h = x Aᵀ, as peft's layers do.
    The LoRA scaling is folded into the rank-sized operands, never a pass over the output.
    """

    @staticmethod
    def forward(ctx, x2d: torch.Tensor, lora_A: torch.Tensor | None, lora_B: torch.Tensor | None,
                layer: FP8Linear, scaling: float, path: str, x8: torch.Tensor | None,
                sx: torch.Tensor | None) -> torch.Tensor:
        ctx.layer, ctx.path, ctx.scaling, ctx.out_dtype = layer, path, scaling, x2d.dtype
        ctx.lora = lora_A is not None
        with torch.autocast(x2d.device.type, enabled=False):  # the caller chose the compute dtype
            y = _base_forward(layer, x2d, path, x8, sx)
            if ctx.lora:
                h = x2d @ lora_A.to(x2d.dtype).t()
                y = torch.addmm(y, h, lora_B.to(y.dtype).t(), alpha=scaling)
                ctx.save_for_backward(x2d, h, lora_A, lora_B)
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        dx = d_a = d_b = None
        if ctx.needs_input_grad[0]:
            dx = _base_backward(ctx.layer, dy, ctx.path, ctx.out_dtype)
        if ctx.lora:
            x2d, h, lora_A, lora_B = ctx.saved_tensors
            dy = dy.to(x2d.dtype)
            gh = dy @ (lora_B.to(dy.dtype) * ctx.scaling)  # (M, r): dL/dh
            d_a = (gh.t() @ x2d).to(lora_A.dtype)
            d_b = ((dy.t() @ h) * ctx.scaling).to(lora_B.dtype)
            if dx is not None:
                dx = torch.addmm(dx.to(gh.dtype), gh, lora_A.to(gh.dtype)).to(ctx.out_dtype)
        return dx, d_a, d_b, None, None, None, None, None


def scaled_mm_rowwise_supported(device: torch.device) -> bool:
    """Row-wise `_scaled_mm` runs here (CPU: yes; CUDA: probe once — it depends on the GPU, CUDA and torch build)."""
    device = torch.device(device)
    if device.type != "cuda":
        return True
    key = torch.cuda.get_device_capability(device)
    if key not in _ROWWISE_PROBED:
        try:
            a = torch.zeros((16, 16), dtype=E4M3, device=device)
            s = torch.ones((16, 1), dtype=torch.float32, device=device)
            torch._scaled_mm(a, a.t(), scale_a=s, scale_b=s.t().contiguous(), out_dtype=torch.bfloat16)
            _ROWWISE_PROBED[key] = True
        except (RuntimeError, ValueError, NotImplementedError):
            _ROWWISE_PROBED[key] = False
    return _ROWWISE_PROBED[key]


_ROWWISE_PROBED: dict[tuple[int, int], bool] = {}


def fp8_tensor_cores(device: torch.device) -> bool:
    """FP8 tensor cores we drive: an NVIDIA GPU of compute capability 8.9 (Ada) or newer.

    ROCm builds report their GPUs as "cuda" devices with capabilities like (9, 4) (MI300), but their FP8 is
    the e4m3fnuz format, which this layer does not store: they take the dequantising path (same memory)."""
    device = torch.device(device)
    if device.type != "cuda" or torch.version.hip is not None:
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


def shape_fits(in_features: int, out_features: int) -> bool:
    return in_features % ALIGN == 0 and out_features % ALIGN == 0


class FP8Linear(nn.Linear):
    """A frozen nn.Linear stored in FP8 (see the module docstring for the maths).

    It subclasses nn.Linear so that peft's LoRA wraps it like any Linear; its
    `compute_dtype` attribute is what peft reads to pick the adapters' dtype
    (it would otherwise copy the float8 weight dtype onto LoRA A/B).

    compute: "scaled_mm" (FP8 tensor cores), "dequant" (bf16 matmul), or
    "auto" = scaled_mm on sm_89+ GPUs for shapes that fit, dequant otherwise.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None,
                 compute_dtype: torch.dtype = torch.bfloat16, compute: Compute = "auto",
                 transposed_copy: bool = False):
        nn.Module.__init__(self)  # not nn.Linear.__init__: it would allocate a full-precision weight
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.zeros((out_features, in_features), dtype=E4M3, device=device),
                                   requires_grad=False)
        self.register_buffer("weight_scale", torch.ones((out_features, 1), dtype=torch.float32, device=device))
        self.bias = (nn.Parameter(torch.zeros(out_features, dtype=compute_dtype, device=device), requires_grad=False)
                     if bias else None)
        self.compute_dtype = compute_dtype
        self.requested_compute = compute
        self.transposed_copy = transposed_copy
        self._weight_t: torch.Tensor | None = None
        self.compute = self._resolve_compute(compute, self.weight.device)
        self.rowwise = scaled_mm_rowwise_supported(self.weight.device)

    def _resolve_compute(self, compute: Compute, device: torch.device) -> str:
        if not shape_fits(self.in_features, self.out_features):
            return "dequant"  # per-layer fallback: CUDA's _scaled_mm would reject these dims
        if compute == "auto":
            return "scaled_mm" if fp8_tensor_cores(device) else "dequant"
        return compute

    @classmethod
    def from_linear(cls, linear: nn.Linear, compute_dtype: torch.dtype | None = None, compute: Compute = "auto",
                    transposed_copy: bool = False) -> FP8Linear:
        w = linear.weight.detach()
        cdt = compute_dtype or (w.dtype if w.dtype in (torch.bfloat16, torch.float16, torch.float32) else torch.bfloat16)
        layer = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, device=w.device,
                    compute_dtype=cdt, compute=compute, transposed_copy=transposed_copy)
        w8, sw = quantize_weight_rows(w)
        layer.weight.data = w8
        layer.weight_scale.copy_(sw)
        if linear.bias is not None:
            layer.bias.data = linear.bias.detach().to(cdt).clone()
        return layer

    def _apply(self, fn, recurse=True):
        # Device moves must keep the weight in float8 (nn.Module.to(dtype) would cast it like any float).
        out = super()._apply(fn, recurse)
        if self.weight.dtype != E4M3:
            raise TypeError("FP8Linear's weight must stay float8_e4m3fn; move it with .to(device) only")
        self._weight_t = None
        # The scale buffer, not the weight, says where this layer computes: block swapping parks the weight in
        # host memory between uses (engine/frozen_base/blockswap.py) while the scale stays on the GPU.
        self.compute = self._resolve_compute(self.requested_compute, self.weight_scale.device)
        self.rowwise = scaled_mm_rowwise_supported(self.weight_scale.device)
        return out

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """W as `dtype` (exact: the scales are powers of two); the compute paths never build it."""
        return (self.weight.to(torch.float32) * self.weight_scale).to(dtype)

    def weight_colmajor(self) -> torch.Tensor:
        """W8 (O × K) in column-major order: a transposed FP8 copy (kept only with transposed_copy=True)."""
        if self._weight_t is not None and self._weight_t.device == self.weight.device:
            return self._weight_t.t()
        wt = self.weight.t().contiguous()  # (K, O) row-major bytes == (O, K) column-major
        if self.transposed_copy:
            self._weight_t = wt
        return wt.t()

    def path_for(self, rows: int) -> str:
        """"fp8" (quantised activation, `_scaled_mm`) or "weight_only" (bf16 matmul on W8) for `rows` rows."""
        return "fp8" if self.compute == "scaled_mm" and fp8_compute_pays(rows) else "weight_only"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2d = x.reshape(-1, self.in_features)
        if x2d.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            x2d = x2d.to(self.compute_dtype)
        path = self.path_for(x2d.shape[0])
        x8, sx = quantize_activation(x2d, source=x) if path == "fp8" else (None, None)
        y = FrozenFP8Function.apply(x2d, None, None, self, 1.0, path, x8, sx)
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"compute={self.compute}, rowwise={self.rowwise}")
