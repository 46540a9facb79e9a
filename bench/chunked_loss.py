"""Peak memory of the causal-LM loss step: the plain LM head + cross-entropy vs train.chunked_loss, in one run.

    .venv/bin/python bench/chunked_loss.py                       # vocab 262,144, seq 2048, hidden 64, CPU
    .venv/bin/python bench/chunked_loss.py --vocab 128256 --hidden 256

The step is what the family's loss does after the decoder: from final hidden
states [1, seq, hidden] (requiring grad, as under a LoRA) and a frozen LM head
weight [vocab, hidden], the loss and its backward to the hidden states.
`plain` is the model's own path: logits = hidden · Wᵀ, then transformers'
ForCausalLMLoss. `chunked` is engine.training.chunked_loss.chunked_cross_entropy.

Measurement. On the CPU, tracemalloc does not see torch's allocations, so the
torch profiler records them: with `profile_memory=True` every allocation and
free made through torch's allocator is an event carrying the running total of
bytes allocated (`Total Allocated`). Peak = the largest running total during
the step minus the total just before it (inputs, weights and the model are
allocated before and not counted). On a GPU (when one is present) the same
step is also measured with torch.cuda.max_memory_allocated after
reset_peak_memory_stats, the two modes again in one run. The hidden size only
scales the inputs and W (not the logits), so a small one keeps this on a CPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.training.chunked_loss import chunked_cross_entropy, rows_per_chunk  # noqa: E402


def plain_step(hidden, weight, labels):
    from transformers.loss.loss_utils import ForCausalLMLoss

    loss = ForCausalLMLoss(hidden @ weight.T, labels, vocab_size=weight.shape[0])
    loss.backward()
    return loss.detach()


def chunked_step(hidden, weight, labels):
    loss = chunked_cross_entropy(hidden, weight, labels)
    loss.backward()
    return loss.detach()


def cpu_peak_bytes(fn, *args) -> tuple[int, float, torch.Tensor]:
    """Peak bytes torch allocated during fn(*args) above what was allocated before, from the profiler's events."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        t0 = time.perf_counter()
        loss = fn(*args)
        seconds = time.perf_counter() - t0
    with tempfile.TemporaryDirectory() as d:
        trace = Path(d) / "trace.json"
        prof.export_chrome_trace(str(trace))
        events = [e["args"] for e in json.loads(trace.read_text())["traceEvents"] if e.get("name") == "[memory]"]
    cpu = [a for a in events if a.get("Device Type") == 0]
    before = cpu[0]["Total Allocated"] - cpu[0]["Bytes"]
    return max(a["Total Allocated"] for a in cpu) - before, seconds, loss


def cuda_peak_bytes(fn, *args) -> tuple[int, float, torch.Tensor]:
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    loss = fn(*args)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base, time.perf_counter() - t0, loss


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", type=int, default=262_144)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    print(f"vocab {args.vocab}, seq {args.seq}, hidden {args.hidden}, {args.dtype}; "
          f"chunk {rows_per_chunk(args.vocab)} rows; torch {torch.__version__}")
    for dev in devices:
        g = torch.Generator().manual_seed(0)
        weight = (torch.randn(args.vocab, args.hidden, generator=g) / args.hidden ** 0.5).to(dev, dtype)
        labels = torch.randint(0, args.vocab, (1, args.seq), generator=g).to(dev)
        measure = cpu_peak_bytes if dev == "cpu" else cuda_peak_bytes
        how = "torch.profiler allocation events" if dev == "cpu" else "torch.cuda.max_memory_allocated"
        results = {}
        for name, fn in (("plain", plain_step), ("chunked", chunked_step)):
            hidden = torch.randn(1, args.seq, args.hidden, generator=g.manual_seed(1)).to(dev, dtype).requires_grad_()
            peak, seconds, loss = measure(fn, hidden, weight, labels)
            results[name] = (peak, seconds, float(loss), hidden.grad)
        print(f"\n{dev} ({how})")
        print("| loss step | peak MiB | seconds | loss |")
        print("|---|---:|---:|---:|")
        for name, (peak, seconds, loss, _) in results.items():
            print(f"| {name} | {peak / 2**20:.1f} | {seconds:.3f} | {loss:.6f} |")
        p, c = results["plain"], results["chunked"]
        err = (p[3] - c[3]).abs().max().item()
        print(f"chunked/plain peak memory: {c[0] / p[0]:.3f}x (target <= 0.25x); time {c[1] / p[1]:.2f}x; "
              f"max |grad difference| {err:.2e}")


if __name__ == "__main__":
    main()
