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
torch.compile sees one op. `quantize_rows` (fp8_quant.py) is the reference and runs everywhere else.
The bias goes into `_scaled_mm` and the forward GEMM accumulates fast (`use_fast_accum`, as torchao and
TransformerEngine do for the forward; the input-gradient GEMM keeps the exact accumulation).
Linears that read the same input one after the other (Q, K, V; a single block's proj_mlp and Q) quantise
it once (`quantize_activation`). A call with few rows (`fp8_compute_pays`: the modulation linears, M = the
batch) takes the weight-only path: no activation quantisation; on CUDA fp8_triton's few-row kernel reads
W8 once as e4m3 (`lorad::w8_matmul`), elsewhere a bf16 matmul on W8 with s_w applied to the result.
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
(`check_scaled_mm`, scaled_mm.py), because the CPU kernel accepts layouts CUDA rejects and
CPU tests must catch such bugs before a GPU does.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn as nn

from engine.frozen_base.fp8_quant import (  # noqa: F401 - quantize_rows & co. are also this module's names
    AMAX_EPS,
    E4M3,
    E4M3_MAX,
    WEIGHT_CHUNK,
    forget_quantised,
    prescale_rows,
    quantize_activation,
    quantize_rows,
    quantize_rows_op,
    quantize_weight_rows,
    w8_matmul_op,
)
from engine.frozen_base.scaled_mm import (  # noqa: F401 - the checked _scaled_mm call, also by this module's names
    ALIGN,
    ScaledMMRejected,
    check_scaled_mm,
    scaled_mm,
    scaled_mm_rowwise_supported,
)

Compute = Literal["auto", "scaled_mm", "dequant"]


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
    bias = layer.bias.to(x2d.dtype) if layer.bias is not None else None
    return w8_matmul_op(x2d, layer.weight, layer.weight_scale, bias)  # s_w, powers of two, applied to the result


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
