"""Optimizers, the learning-rate schedule, and a pickle-free form of optimizer state.

`train.optimizer` and what each one wants (docs/precision-and-speed.md, "Optimizers"):

    adamw8bit, paged_adamw8bit  bitsandbytes 8-bit AdamW (the default): 2 bytes of state per parameter
    adamw                       torch AdamW, 8 bytes per parameter
    prodigy                     prodigyopt: AdamW that estimates its own step size d; `lr` multiplies d and
                                wants 1.0 (the default when this optimizer is chosen; a warning below 0.1)
    adamw_schedulefree          schedulefree: AdamW with iterate averaging instead of a decaying schedule
                                (train.schedule must be constant, the default with it; warm-up still applies).
                                Its parameters during training (y) are not the ones to use (x): samples,
                                validation and the export see x (`eval_weights`, `use_eval_weights`)
    scao                        the `scao` package: AdamW fed with Kronecker-preconditioned gradients after
                                its own curvature warm-up, curvature kept as int8 (use_int8_ema)

`train.optimizer_args` passes the constructor arguments listed in OPTIMIZER_ARGS (engine/config/train.py);
the ones left out keep the library's defaults.

A parameter whose family gave it an `lr_scale` attribute (LR_SCALE; SDXL's text encoders with
lora.text_encoder_lr) trains in a parameter group of its own at that multiple of the schedule's lr; without any,
there is one group, as there always was (checkpoints of such jobs resume as before).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch

from engine.config.train import TrainConfig

# Prodigy's own advice: lr 1.0 (0.5 for a gentler run); an lr meant for AdamW (1e-4) leaves it barely moving.
PRODIGY_MIN_SENSIBLE_LR = 0.1


LR_SCALE = "lorad_lr_scale"  # a parameter's attribute: its learning rate as a multiple of the schedule's


def param_groups(params: list[torch.nn.Parameter], lr: float) -> list[torch.nn.Parameter] | list[dict[str, Any]]:
    """The parameters as they are, or groups by LR_SCALE (in order of first appearance) with their lr and scale."""
    scales = [getattr(p, LR_SCALE, 1.0) for p in params]
    if all(s == 1.0 for s in scales):
        return params
    groups: dict[float, list[torch.nn.Parameter]] = {}
    for p, s in zip(params, scales, strict=True):
        groups.setdefault(s, []).append(p)
    return [{"params": ps, "lr": lr * s, "lr_scale": s} for s, ps in groups.items()]


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """The schedule's lr for this step, times each group's lr_scale."""
    for g in optimizer.param_groups:
        g["lr"] = lr * g.get("lr_scale", 1.0)


def build_optimizer(params: list[torch.nn.Parameter], train: TrainConfig) -> torch.optim.Optimizer:
    args = {k: tuple(v) if isinstance(v, list) else v for k, v in train.optimizer_args.items()}
    kw = dict(lr=train.lr, weight_decay=train.weight_decay, betas=(0.9, 0.999), eps=1e-8) | args
    params = param_groups(params, train.lr)
    name = train.optimizer
    if name == "adamw":
        return torch.optim.AdamW(params, **kw)
    if name == "prodigy":
        import io

        import prodigyopt

        # It prints a line about weight decay to stdout, which is the trainer's JSON event stream.
        with contextlib.redirect_stdout(io.StringIO()):
            return prodigyopt.Prodigy(params, **kw)
    if name == "adamw_schedulefree":
        import schedulefree

        opt = schedulefree.AdamWScheduleFree(params, **kw)
        opt.train()  # no state yet: only sets the mode; a checkpoint's state brings its own mode flag
        return opt
    if name == "scao":
        import scao

        # int8 curvature EMA: the low-memory setting the package is made for (QLoRA); async updates off so
        # that a step's result never depends on when a side stream finished.
        return scao.SCAO(params, **({"use_int8_ema": True, "async_precond": False} | kw))
    import bitsandbytes as bnb

    cls = bnb.optim.PagedAdamW8bit if name == "paged_adamw8bit" else bnb.optim.AdamW8bit
    return cls(params, **kw)


def optimizer_advice(train: TrainConfig) -> str | None:
    """A warning for a setting that validates but will not train well; None if there is nothing to say."""
    if train.optimizer == "prodigy" and train.lr < PRODIGY_MIN_SENSIBLE_LR:
        return (f"train.lr is {train.lr:g} with prodigy: Prodigy finds the step size itself and lr only scales it; "
                "use 1.0 (the default with prodigy) or 0.5, or the run will barely move")
    return None


def optimizer_state(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """optimizer.state_dict() as plain containers, tensors and scalars (what split_tree stores).

    scao keeps a preconditioner object in each parameter's state; its tensors are already in the
    state dict under `_scao_precond`, so the object itself is left out here and rebuilt on load.
    """
    sd = optimizer.state_dict()
    if "_scao_precond" in sd:
        sd = {**sd, "state": {i: {k: v for k, v in s.items() if k != "preconditioner"}
                              for i, s in sd["state"].items()}}
    return sd


def load_optimizer_state(optimizer: torch.optim.Optimizer, sd: dict[str, Any]) -> None:
    """The inverse of optimizer_state, into a freshly built optimizer."""
    if "_scao_precond" in sd:
        # scao's load_state_dict fills the preconditioners it finds in the parameter states; give each
        # parameter a fresh one the way scao makes them (_init_state), so its saved factors land in it.
        params = [p for g in optimizer.param_groups for p in g["params"]]
        state = {}
        for i, s in sd["state"].items():
            p = params[int(i)]
            optimizer._init_state(p, next(g for g in optimizer.param_groups if any(q is p for q in g["params"])))
            state[i] = {**s, "preconditioner": optimizer.state.pop(p)["preconditioner"]}
        sd = {**sd, "state": state}
    optimizer.load_state_dict(sd)


def has_eval_weights(optimizer: torch.optim.Optimizer) -> bool:
    """Schedule-free optimizers train on one point (y) and evaluate another (x)."""
    return callable(getattr(optimizer, "eval", None)) and "train_mode" in optimizer.param_groups[0]


@contextlib.contextmanager
def eval_weights(optimizer: torch.optim.Optimizer, params: dict[str, torch.nn.Parameter]) -> Iterator[None]:
    """Within the block the parameters are the ones to evaluate (a no-op but for schedule-free).

    Afterwards the training values are put back bit for bit: schedule-free's own eval() then train()
    round trip is two floating-point interpolations and would change them slightly, so a run with
    samples or validation would drift from one without.
    """
    if not has_eval_weights(optimizer):
        yield
        return
    saved = {n: p.detach().clone() for n, p in params.items()}
    optimizer.eval()
    try:
        yield
    finally:
        optimizer.train()
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(saved[n])


def use_eval_weights(optimizer: torch.optim.Optimizer) -> None:
    """Before the export, after the final checkpoint: the parameters become the ones to evaluate, for good."""
    if has_eval_weights(optimizer):
        optimizer.eval()


# Optimizer state is a tree of dicts/lists/tuples with tensors and scalars as leaves
# (bitsandbytes nests its 8-bit state and quantisation maps one level deeper).
# We split it into a flat {path: tensor} map for safetensors and a JSON tree for the rest,
# so checkpoints hold no pickles and reload bit-exactly.

def split_tree(tree: Any, prefix: str, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(tree, torch.Tensor):
        key = prefix.lstrip("/")
        tensors[key] = tree
        return {"__tensor__": key}
    if isinstance(tree, dict):
        return {"__dict__": [[k, split_tree(v, f"{prefix}/{k}", tensors)] for k, v in tree.items()]}
    if isinstance(tree, tuple):
        return {"__tuple__": [split_tree(v, f"{prefix}/{i}", tensors) for i, v in enumerate(tree)]}
    if isinstance(tree, list):
        return [split_tree(v, f"{prefix}/{i}", tensors) for i, v in enumerate(tree)]
    if isinstance(tree, float) and not math.isfinite(tree):
        return {"__float__": repr(tree)}
    if tree is None or isinstance(tree, (bool, int, float, str)):
        return tree
    raise TypeError(f"cannot store optimizer state value of type {type(tree).__name__} at {prefix}")


def join_tree(node: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(node, dict):
        if "__tensor__" in node:
            return tensors[node["__tensor__"]]
        if "__dict__" in node:
            # [key, value] pairs keep integer keys (parameter indices) as ints through JSON.
            return {k: join_tree(v, tensors) for k, v in node["__dict__"]}
        if "__tuple__" in node:
            return tuple(join_tree(v, tensors) for v in node["__tuple__"])
        if "__float__" in node:
            return float(node["__float__"])
    if isinstance(node, list):
        return [join_tree(v, tensors) for v in node]
    return node
