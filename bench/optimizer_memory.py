"""Optimizer state per trainable parameter, for each optimizer lorad offers, on the quickstart shape.

    .venv/bin/python bench/optimizer_memory.py

The quickstart job (configs/examples/quickstart.yaml: builtin tiny-llama, LoRA rank 16 on all seven
projections) is loaded once; each optimizer is built on its LoRA parameters and takes two steps (state is
allocated on the first; scao's curvature factors exist from then on). We count the bytes of every tensor
in the optimizer's state as the checkpoint stores it (engine/training/optim.py optimizer_state: moments, 8-bit
states with their quantisation maps and absmax, Prodigy's s and p0, schedule-free's z, scao's curvature
factors), divided by the number of trainable parameters, and the ratio to torch AdamW. No GPU figure:
the state sizes are device-independent, this counts bytes, not time.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

OPTIMIZERS = ["adamw", "adamw8bit", "prodigy", "adamw_schedulefree", "scao"]


def main() -> int:
    import torch

    from engine.config.job import load_job
    from engine.families.causal_lm import CausalLM
    from engine.training.optim import build_optimizer, optimizer_state, split_tree

    class Quiet:
        def info(self, *a, **k):
            pass

    cfg = load_job(REPO / "configs" / "examples" / "quickstart.yaml")
    with tempfile.TemporaryDirectory() as tmp:
        model = CausalLM().load_model(cfg, Path(tmp), torch.device("cpu"), Quiet())
    params = [p for p in model.parameters() if p.requires_grad]
    n = sum(p.numel() for p in params)
    print(f"quickstart shape: {len(params)} LoRA tensors, {n} trainable parameters "
          f"(rank {cfg.lora.rank}, targets {', '.join(cfg.lora.targets)})")
    rows = []
    for name in OPTIMIZERS:
        train = cfg.train.model_copy(update={"optimizer": name, "optimizer_args": {}, "lr": 1e-3})
        with torch.no_grad():
            saved = [p.detach().clone() for p in params]
        opt = build_optimizer(params, train)
        g = torch.Generator().manual_seed(0)
        for _ in range(2):
            for p in params:
                p.grad = torch.randn(p.shape, generator=g)
            opt.step()
            opt.zero_grad(set_to_none=True)
        tensors: dict[str, torch.Tensor] = {}
        split_tree(optimizer_state(opt), "", tensors)
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        by_dtype: dict[str, int] = {}
        for t in tensors.values():
            by_dtype[str(t.dtype).removeprefix("torch.")] = by_dtype.get(str(t.dtype).removeprefix("torch."), 0) + t.numel() * t.element_size()
        rows.append((name, nbytes, by_dtype))
        with torch.no_grad():
            for p, s in zip(params, saved, strict=True):
                p.copy_(s)
    base = next(b for name, b, _ in rows if name == "adamw")
    print()
    print("| optimizer | state bytes | bytes / trainable param | ratio to adamw | by dtype (bytes) |")
    print("|---|---:|---:|---:|---|")
    for name, b, by in rows:
        print(f"| {name} | {b} | {b / n:.2f} | {b / base:.3f} | "
              f"{', '.join(f'{k} {v}' for k, v in sorted(by.items()))} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
