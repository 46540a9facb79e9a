"""Causal-LM cross-entropy that never holds the full logits (train.chunked_loss).

The plain loss builds logits [tokens, vocab] in the model dtype, an fp32 copy,
the log-softmax saved for backward and its gradient: at vocabulary 262,144 and
2,048 tokens that is 2 GiB per fp32 copy, more than a small model's whole
activations. Here the LM head and the cross-entropy run over `rows` tokens at
a time:

    forward:  for each chunk, z = h·Wᵀ (fp32), keep only lse = logsumexp(z)
              and add Σ (lse − z[y]) over the labelled rows
    backward: recompute z per chunk; dz = (softmax(z) − onehot(y)) · g / n,
              dh = dz·W (and dW = dzᵀ·h only when W itself trains)

so the memory held is one chunk's logits (and its gradient) plus one float per
token. The result equals transformers' ForCausalLMLoss (mean over labelled
tokens, ignore_index −100, logits upcast to fp32) within fp32 rounding.

Written in plain torch (an autograd.Function) because the libraries that do
this (Liger's fused linear cross-entropy, Apple's cut-cross-entropy) need
Triton and a GPU; this path must run on the CPU and anywhere torch runs.
"""

from __future__ import annotations

import torch

IGNORE = -100
# The fp32 logits of one chunk stay near this size (the backward holds two such buffers).
CHUNK_BYTES = 64 << 20
# train.chunked_loss: auto turns the chunked loss on from this vocabulary size (Llama 3's 128k, Qwen's 152k
# and Gemma's 262k are above it; Llama 2 / Mistral's 32k are below, where the logits cost little).
AUTO_MIN_VOCAB = 65_536


def rows_per_chunk(vocab: int) -> int:
    return max(16, CHUNK_BYTES // (4 * vocab))


def _logits(h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    # In the LM head's dtype, as the model's own lm_head computes them, then fp32 as transformers' loss upcasts.
    # Explicit rather than left to autocast (lora.dtype wider than the base): the backward runs outside it, and
    # the recomputed logits must be the forward's.
    with torch.autocast(device_type=h.device.type, enabled=False):
        return (h.to(weight.dtype) @ weight.T).float()


class _LMHeadCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, rows):  # hidden [N, H], weight [V, H], labels [N]
        n = hidden.shape[0]
        lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for s in range(0, n, rows):
            y = labels[s:s + rows]
            z = _logits(hidden[s:s + rows], weight)
            lse[s:s + rows] = torch.logsumexp(z, dim=-1)
            picked = z.gather(1, y.clamp(min=0)[:, None])[:, 0]
            total += ((lse[s:s + rows] - picked) * (y != IGNORE)).sum()
            del z
        count = (labels != IGNORE).sum()
        ctx.save_for_backward(hidden, weight, labels, lse, count)
        ctx.rows = rows
        # As transformers: the mean over labelled tokens (0/0 = nan when nothing is labelled).
        return total / count

    @staticmethod
    def backward(ctx, grad):
        hidden, weight, labels, lse, count = ctx.saved_tensors
        rows = ctx.rows
        grad_h = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if ctx.needs_input_grad[1] else None
        scale = grad.float() / count
        for s in range(0, hidden.shape[0], rows):
            h, y = hidden[s:s + rows], labels[s:s + rows]
            dz = _logits(h, weight)
            dz.sub_(lse[s:s + rows, None]).exp_()  # softmax, in place: one chunk-sized buffer
            valid = y != IGNORE
            dz[valid.nonzero()[:, 0], y[valid]] -= 1.0
            dz.mul_((valid.float() * scale)[:, None])
            if grad_h is not None:
                grad_h[s:s + rows] = (dz.to(weight.dtype) @ weight).to(hidden.dtype)
            if grad_w is not None:
                grad_w += dz.T @ h.float()
            del dz
        return grad_h, (grad_w.to(weight.dtype) if grad_w is not None else None), None, None


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                          rows: int | None = None) -> torch.Tensor:
    """Mean next-token cross-entropy of lm_head(hidden) against labels, without the full logits.

    hidden [B, T, H] (the decoder's final hidden states), weight [V, H] (lm_head's), labels [B, T] as the model
    takes them (not yet shifted; −100 = not trained on).
    """
    h = hidden[:, :-1].reshape(-1, hidden.shape[-1])
    y = labels[:, 1:].reshape(-1).to(hidden.device)
    return _LMHeadCrossEntropy.apply(h, weight, y, rows or rows_per_chunk(weight.shape[0]))
