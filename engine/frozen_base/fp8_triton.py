"""Triton kernels for the FP8 base, beside their torch forms in engine/frozen_base/fp8_quant.py.

`quantize_rows`: one read of the input, one write of e4m3 and scales (below). `w8_matmul`: the weight-only
path's few-row matmul, W8 read once as e4m3 and never widened to a bf16 copy (at the end of this file).

`quantize_rows` in fp8_quant.py is the readable torch reference and the fallback (CPU, ROCm, no Triton). Its chain
(`x.float()`, `abs`, `amax`, `clamp`, the scale, the division, `clamp`, the cast; for a gradient also
`* weight_scale`) is eight or nine kernels and as many passes over memory; this is one kernel, one program
per row:

    v      = x[row, :] (· col_scale, the weight scale folded into a gradient)     read once, in fp32
    scale  = the smallest power of two with max|v| / scale ≤ 448                   (fp8_quant.pow2_scale)
    q      = e4m3(clamp(v / scale, ±448))                                         written once

A row that fits one block (`ONE_PASS`, up to MAX_BLOCK columns: every FLUX and Llama width) stays in
registers between the amax and the cast; a wider row is read a second time (from L2, mostly).

Exactness. The scale is a power of two, built from amax's bits, so `v · (1 / scale)` is the same fp32 number
as the reference's `v / scale`, and the weight scale folded into a gradient is a power of two too. The kernel
then rounds to the e4m3 grid itself, in fp32 (to nearest, ties to even, as torch's cast does) and the cast
only converts numbers e4m3 holds exactly. That last step is there for Triton's interpreter
(`TRITON_INTERPRET=1`, which the CPU tests use): its float-to-e4m3 conversion rounds ties away from zero,
loses the carry when rounding up crosses into an odd exponent (1.9375 becomes 1.0, not 2.0), and flushes
e4m3's smallest subnormals to zero. Pre-rounded, the bytes equal torch's in the interpreter and on a GPU.
`precast=True` writes the fp32 values before rounding instead of e4m3, for the tests.

Imported only where it runs: on a CUDA GPU by fp8_quant's op, or by the tests with TRITON_INTERPRET=1 set before
the import (triton picks the interpreter when it decorates the kernel).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

E4M3 = torch.float8_e4m3fn
E4M3_MAX = float(torch.finfo(E4M3).max)  # 448.0
AMAX_EPS = 1e-12  # fp8_quant.AMAX_EPS (this module imports nothing of lorad's; a test holds the two equal)

MAX_BLOCK = 16384  # columns kept in registers in one pass (FLUX's widest input, 15360, fits)


@triton.jit
def _pow2_scale_bits(amax):
    """(scale, 1 / scale) for amax > 0: the smallest power of two s with amax / s ≤ 448, from amax's bits.

    amax = 1.f · 2^(e - 127); 448 = 1.75 · 2^8, so s = 2^(e - 135) · 2 when 1.f > 1.75 (f > 0x600000)."""
    bits = amax.to(tl.int32, bitcast=True)
    e = (bits >> 23) & 0xFF
    c = ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
    scale = ((e - 8 + c) << 23).to(tl.float32, bitcast=True)  # biased exponent (e - 135 + c) + 127
    inv = ((262 - e - c) << 23).to(tl.float32, bitcast=True)  # 127 - (e - 135 + c)
    return scale, inv


@triton.jit
def _round_to_e4m3_grid(p):
    """p (|p| ≤ 448) rounded to the nearest e4m3 value, ties to even, still in fp32.

    e4m3's spacing at |p| is 2^(max(E, -6) - 3) (3 mantissa bits; subnormals below 2^-6). Adding and taking
    away C = spacing · 2^23 makes fp32's own round-to-nearest-even round at that spacing."""
    bits = p.to(tl.int32, bitcast=True)
    mag_bits = bits & 0x7FFFFFFF
    sign = bits ^ mag_bits
    e = mag_bits >> 23
    c = ((tl.maximum(e, 121) + 20) << 23).to(tl.float32, bitcast=True)
    r = (mag_bits.to(tl.float32, bitcast=True) + c) - c
    return (r.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _quantize_rows_kernel(x_ptr, col_ptr, q_ptr, s_ptr, n_cols, stride_x, stride_q, amax_eps, e4m3_max,
                          HAS_COL: tl.constexpr, PRECAST: tl.constexpr, BLOCK: tl.constexpr,
                          ONE_PASS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    q_row = q_ptr + row * stride_q
    offs = tl.arange(0, BLOCK)
    if ONE_PASS:
        mask = offs < n_cols
        v = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_COL:
            v = v * tl.load(col_ptr + offs, mask=mask, other=0.0)
        amax = tl.max(tl.abs(v), axis=0)
    else:
        run = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, n_cols, BLOCK):
            mask = start + offs < n_cols
            w = tl.load(x_row + start + offs, mask=mask, other=0.0).to(tl.float32)
            if HAS_COL:
                w = w * tl.load(col_ptr + start + offs, mask=mask, other=0.0)
            run = tl.maximum(run, tl.abs(w))
        amax = tl.max(run, axis=0)
    scale, inv = _pow2_scale_bits(tl.maximum(amax, amax_eps))
    tl.store(s_ptr + row, scale)
    if ONE_PASS:
        p = tl.minimum(tl.maximum(v * inv, -e4m3_max), e4m3_max)
        if PRECAST:
            tl.store(q_row + offs, p, mask=mask)
        else:
            tl.store(q_row + offs, _round_to_e4m3_grid(p).to(tl.float8e4nv), mask=mask)
    else:
        for start in range(0, n_cols, BLOCK):
            mask = start + offs < n_cols
            w = tl.load(x_row + start + offs, mask=mask, other=0.0).to(tl.float32)
            if HAS_COL:
                w = w * tl.load(col_ptr + start + offs, mask=mask, other=0.0)
            p = tl.minimum(tl.maximum(w * inv, -e4m3_max), e4m3_max)
            if PRECAST:
                tl.store(q_row + start + offs, p, mask=mask)
            else:
                tl.store(q_row + start + offs, _round_to_e4m3_grid(p).to(tl.float8e4nv), mask=mask)


def quantize_rows(x: torch.Tensor, col_scale: torch.Tensor | None = None, precast: bool = False,
                  block: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8_quant.quantize_rows(x, col_scale) in one kernel: (x8 row-major (or fp32 pre-cast values), scales (rows, 1)).

    `block` (a power of two) forces the column block, so a test can take the two-pass path on a narrow row."""
    if x.dim() != 2:
        raise ValueError(f"quantize_rows takes a 2-D tensor, got {tuple(x.shape)}")
    if x.stride(1) != 1:
        x = x.contiguous()
    rows, cols = x.shape
    q = torch.empty((rows, cols), dtype=torch.float32 if precast else E4M3, device=x.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    if rows == 0:
        return q, scale
    blk = block or min(triton.next_power_of_2(cols), MAX_BLOCK)
    col = col_scale.reshape(-1).to(torch.float32).contiguous() if col_scale is not None else scale
    if col_scale is not None and col.numel() != cols:
        raise ValueError(f"col_scale has {col.numel()} entries for {cols} columns")
    warps = 4 if blk <= 2048 else 8 if blk <= 8192 else 16
    _quantize_rows_kernel[(rows,)](x, col, q, scale, cols, x.stride(0), q.stride(0), AMAX_EPS, E4M3_MAX,
                                   HAS_COL=col_scale is not None, PRECAST=precast, BLOCK=blk,
                                   ONE_PASS=blk >= cols, num_warps=warps)
    return q, scale


# ----------------------------------------------------------------------------- the weight-only path's matmul
W8_MAX_ROWS = 16  # rows one program holds (padded to a power of two): the few-row calls fp8.fp8_compute_pays sends here


@triton.jit
def _w8_matmul_kernel(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                      HAS_BIAS: tl.constexpr, M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, M_PAD)
    n_ok, m_ok = offs_n < N, offs_m < M
    acc = tl.zeros([M_PAD, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        w = tl.load(w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :],
                    other=0.0).to(tl.float32)
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :],
                    other=0.0).to(tl.float32)
        acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
    y = acc * tl.load(s_ptr + offs_n, mask=n_ok, other=0.0)[None, :]
    if HAS_BIAS:
        y += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], y.to(y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def w8_matmul(x: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x (M ≤ W8_MAX_ROWS, K) @ (diag(w_scale) · W8)ᵀ (+ bias), W8 read as e4m3 once: a bf16 weight never exists.

    The weight-only path of a few-row call (fp8.py's size rule): a matrix-vector product bound by reading the
    weight, here 1 byte a parameter instead of the cast (1 read, 2 written) and the bf16 matmul (2 read)."""
    rows, k = x.shape
    if rows > W8_MAX_ROWS:
        raise ValueError(f"w8_matmul takes at most {W8_MAX_ROWS} rows, got {rows}")
    if x.stride(1) != 1:
        x = x.contiguous()
    n = w8.shape[0]
    y = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    if rows == 0:
        return y
    scale = w_scale.reshape(-1).to(torch.float32).contiguous()
    m_pad = max(triton.next_power_of_2(rows), 2)
    block_n, block_k = 32, 256 // m_pad  # m_pad · block_n · block_k products in flight per program: 8192
    _w8_matmul_kernel[(triton.cdiv(n, block_n),)](
        x, w8, scale, bias if bias is not None else scale, y, rows, n, k, x.stride(0), w8.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, M_PAD=m_pad, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4)
    return y
