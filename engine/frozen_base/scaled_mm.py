"""torch._scaled_mm as CUDA runs it: its layout rules checked before every call, and where row-wise scaling runs.

CUDA's `_scaled_mm` rejects layouts its CPU kernel accepts, so `check_scaled_mm` enforces CUDA's rules in our
own code and a CPU test fails on a layout bug a GPU would reject. engine/frozen_base/fp8.py uses `scaled_mm`
for the FP8 layer's forward and input-gradient GEMMs.
"""

from __future__ import annotations

import torch

FP8_TYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
ALIGN = 16
E4M3 = torch.float8_e4m3fn


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
