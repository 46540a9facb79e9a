"""Prodigy, schedule-free AdamW and SCAO: their state survives checkpoints bit-exactly, their defaults and
arguments are validated, and schedule-free's evaluation weights are what samples and the export see. The
SIGKILL/resume runs (real trainer processes) also cover the adapter types DoRA, LoKr and LoHa."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import yaml

from engine.checkpoint.state import restore_checkpoint, snapshot
from engine.checkpoint.store import CheckpointStore
from engine.config.job import load_job, parse_job
from engine.config.train import TrainConfig
from engine.errors import JobInvalid
from engine.recipe import train
from engine.report.events import read_events
from engine.training.optim import (
    build_optimizer,
    eval_weights,
    optimizer_advice,
    optimizer_state,
    split_tree,
    use_eval_weights,
)
from tests.helpers.forked import LM_PRELOAD, ForkedTrainer
from tests.helpers.jobs import QUICKSTART_DATA, adapter_bytes, deep_update, tiny_job, tiny_job_dict

NEW_OPTIMIZERS = ["prodigy", "adamw_schedulefree", "scao"]
# scao preconditions only after its own curvature warm-up (100 steps by default): short here so tests reach it.
ARGS = {"scao": {"warmup_steps": 2, "precond_freq": 2, "blend_steps": 2}}


def _train_config(name: str) -> TrainConfig:
    return TrainConfig(optimizer=name, lr=1.0 if name == "prodigy" else 1e-2, weight_decay=0.01,
                       optimizer_args=ARGS.get(name, {}))


def _params() -> dict[str, nn.Parameter]:
    torch.manual_seed(0)
    return {"a": nn.Parameter(torch.randn(64, 128)), "b": nn.Parameter(torch.randn(128, 64))}


def _step(params, optimizer, i: int) -> None:
    # a noisy pull towards 1.0: gradients that agree from step to step, so Prodigy's step size grows
    g = torch.Generator().manual_seed(100 + i)
    for p in params.values():
        p.grad = p.detach() - 1.0 + 0.1 * torch.randn(p.shape, generator=g)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _flat(optimizer):
    """The state as (JSON tree, {key: raw bytes}); a scalar tensor counts as its value (scao reloads its int8
    scales as Python floats of exactly the same value)."""
    tensors: dict[str, torch.Tensor] = {}
    tree = split_tree(_scalars_as_floats(optimizer_state(optimizer)), "", tensors)
    return tree, {k: v.contiguous().view(-1).view(torch.uint8).clone() for k, v in tensors.items()}


def _scalars_as_floats(tree):
    if isinstance(tree, torch.Tensor) and tree.dim() == 0 and tree.is_floating_point():
        return float(tree)
    if isinstance(tree, dict):
        return {k: _scalars_as_floats(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_scalars_as_floats(v) for v in tree)
    return tree


@pytest.mark.parametrize("name", NEW_OPTIMIZERS)
def test_optimizer_state_round_trips_a_checkpoint_bit_exactly_and_training_continues_identically(name, tmp_path):
    params, train_cfg = _params(), _train_config(name)
    optimizer = build_optimizer(list(params.values()), train_cfg)
    for i in range(5):
        _step(params, optimizer, i)
    tree, tensors = _flat(optimizer)
    if name == "prodigy":  # the step-size estimate has moved off its start and is part of the state
        group = optimizer.param_groups[0]
        assert group["d"] != group["d0"]
    if name == "scao":  # really preconditioning, with int8 curvature factors in the checkpoint
        assert optimizer.state[params["a"]]["scao_phase_started"]
        assert any(t.dtype == torch.int8 for t in _leaves(optimizer_state(optimizer)))
    store = CheckpointStore(tmp_path / "ck", "h", keep=2)
    store.commit(snapshot(5, params, optimizer, torch.Generator().manual_seed(5), {"step": 5}))

    params2 = _params()
    optimizer2 = build_optimizer(list(params2.values()), train_cfg)
    loaded, skipped = store.load_latest()
    assert skipped == []
    restore_checkpoint(loaded, params2, optimizer2, torch.Generator())
    tree2, tensors2 = _flat(optimizer2)
    assert [g.get("d") for g in optimizer2.param_groups] == [g.get("d") for g in optimizer.param_groups]
    assert tree2 == tree and sorted(tensors2) == sorted(tensors)
    assert [k for k in tensors if not torch.equal(tensors[k], tensors2[k])] == []
    for i in range(5, 9):
        _step(params, optimizer, i)
        _step(params2, optimizer2, i)
    for k in params:
        assert torch.equal(params[k].view(torch.uint8), params2[k].view(torch.uint8)), k


def _leaves(tree):
    tensors: dict[str, torch.Tensor] = {}
    split_tree(tree, "", tensors)
    return list(tensors.values())


def test_schedule_free_evaluates_its_averaged_weights_and_trains_on_exactly_the_same_values_afterwards():
    import schedulefree

    params = _params()
    optimizer = build_optimizer(list(params.values()), _train_config("adamw_schedulefree"))
    for i in range(4):
        _step(params, optimizer, i)
    before = {n: p.detach().clone() for n, p in params.items()}
    # the reference: schedule-free's own eval() on an identical twin
    twin = {n: nn.Parameter(p.detach().clone()) for n, p in params.items()}
    twin_opt = schedulefree.AdamWScheduleFree(list(twin.values()), lr=1e-2, weight_decay=0.01)
    twin_opt.load_state_dict(optimizer.state_dict())
    twin_opt.eval()
    with eval_weights(optimizer, params):
        for n in params:
            assert torch.equal(params[n], twin[n]) and not torch.equal(params[n], before[n])
    for n in params:
        assert torch.equal(params[n].view(torch.uint8), before[n].view(torch.uint8)), n
    use_eval_weights(optimizer)  # the export
    for n in params:
        assert torch.equal(params[n], twin[n])


@pytest.mark.parametrize("name", ["adamw", "prodigy", "scao"])
def test_eval_weights_is_a_no_op_for_optimizers_without_them(name):
    params = _params()
    optimizer = build_optimizer(list(params.values()), _train_config(name))
    _step(params, optimizer, 0)
    before = {n: p.detach().clone() for n, p in params.items()}
    with eval_weights(optimizer, params):
        assert all(torch.equal(params[n], before[n]) for n in params)
    use_eval_weights(optimizer)
    assert all(torch.equal(params[n], before[n]) for n in params)


# ----------------------------------------------------------------- defaults and validation
def test_prodigy_defaults_to_lr_1_and_warns_when_given_an_adamw_learning_rate(micro_model, tmp_path):
    d = deep_update(tiny_job_dict(micro_model, QUICKSTART_DATA), {"train": {"optimizer": "prodigy"}})
    del d["train"]["lr"]
    cfg = parse_job(d, tmp_path)
    assert cfg.train.lr == 1.0 and optimizer_advice(cfg.train) is None
    low = tiny_job(micro_model, tmp_path, train={"optimizer": "prodigy", "lr": 1e-4})
    assert "train.lr" in optimizer_advice(low.train) and "1.0" in optimizer_advice(low.train)
    assert optimizer_advice(tiny_job(micro_model, tmp_path, train={"optimizer": "adamw", "lr": 1e-4}).train) is None


def test_schedule_free_defaults_to_a_constant_schedule_and_refuses_a_decaying_one(micro_model, tmp_path):
    d = deep_update(tiny_job_dict(micro_model, QUICKSTART_DATA), {"train": {"optimizer": "adamw_schedulefree"}})
    del d["train"]["schedule"]
    assert parse_job(d, tmp_path).train.schedule == "constant"
    with pytest.raises(JobInvalid, match=r"train\.schedule: adamw_schedulefree .* constant"):
        tiny_job(micro_model, tmp_path, train={"optimizer": "adamw_schedulefree", "schedule": "cosine"})


@pytest.mark.parametrize("args,words", [
    ({"d_coef": 2.0, "momentum": 0.9}, ["train.optimizer_args.momentum", "prodigy", "d_coef"]),
    ({"betas": [0.9]}, ["train.optimizer_args.betas", "two numbers"]),
    ({"betas": [0.9, 1.5]}, ["train.optimizer_args.betas"]),
])
def test_optimizer_args_are_checked_against_what_the_optimizer_takes(micro_model, tmp_path, args, words):
    with pytest.raises(JobInvalid) as e:
        tiny_job(micro_model, tmp_path, train={"optimizer": "prodigy", "lr": 1.0, "optimizer_args": args})
    for w in words:
        assert w in str(e.value)
    # and what is allowed reaches the constructor
    cfg = tiny_job(micro_model, tmp_path, train={"optimizer": "prodigy", "lr": 1.0, "optimizer_args": {"d_coef": 2.0}})
    assert build_optimizer([nn.Parameter(torch.zeros(3))], cfg.train).param_groups[0]["d_coef"] == 2.0


# ----------------------------------------------------------------- a real job, SIGKILLed twice and resumed
# Each run pairs an optimizer with an adapter type, so four runs cover every optimizer and type (lora with adamw8bit
# and adamw is covered by tests/e2e/test_resume_exact.py's SIGKILL runs, which share every code path below but the
# optimizer and the tuner).
PAIRS = [("prodigy", "dora"), ("adamw_schedulefree", "lokr"), ("scao", "loha"), ("paged_adamw8bit", "lora")]


def _pair_job(root: Path, name: str, kind: str, micro_model) -> Path:
    job = root / f"{name}-{kind}.yaml"
    job.write_text(yaml.safe_dump(deep_update(tiny_job_dict(micro_model, QUICKSTART_DATA), {
        "train": {"optimizer": name, "steps": 8, "lr": 1.0 if name == "prodigy" else 2e-3,
                  "optimizer_args": ARGS.get(name, {}),
                  **({"schedule": "constant"} if name == "adamw_schedulefree" else {})},
        # rank 32 for lora: its A matrices reach the 4096 elements from which bitsandbytes keeps 8-bit state
        "lora": {"type": kind, "rank": 32 if kind == "lora" else 8, "dropout": 0.1 if kind in ("dora", "lora") else 0.0},
        "checkpoint": {"every_steps": 2}})))
    return job


def _checkpoint_being_written(workdir: Path) -> bool:
    ck = workdir / "checkpoints"
    return ck.is_dir() and any(".tmp-" in d.name and len(list(d.iterdir())) >= 2 for d in ck.iterdir())


def _kill_twice(job: Path, wd: Path) -> int:
    """Two real trainer processes SIGKILLed: a step past the first committed checkpoint, then while the resumed one
    half-writes its next checkpoint. Returns the step the second one resumed from."""
    slow = 500  # seconds: four trainers start side by side on a busy 2-core machine
    # Steps slowed to 0.2 s: the first commit is written by a niced thread and its event can come late, when an
    # 8-step job is nearly done (seen once: the trainer finished before the kill).
    t = ForkedTrainer(job, wd, preload=LM_PRELOAD, LORAD_DEBUG_STEP_DELAY_S="0.2")  # real processes, real kills
    t.wait_for(lambda: bool(t.named("checkpoint_committed")), timeout=slow)
    t.wait_step(t.named("checkpoint_committed")[0]["step"] + 1, timeout=slow)
    t.kill()
    t = ForkedTrainer(job, wd, preload=LM_PRELOAD, LORAD_DEBUG_CKPT_WRITE_DELAY_S="0.2")
    t.wait_for(lambda: _checkpoint_being_written(wd), timeout=slow)
    t.kill()
    resumed = t.named("resumed")
    assert resumed, t.events[-5:]
    return resumed[0]["from_step"]


@pytest.fixture(scope="module")
def killed(tmp_path_factory, micro_model):
    """The jobs and their kill chains, started together: a trainer spends most of its short life importing
    the libraries on one core, so side by side they take little more than one chain."""
    root = tmp_path_factory.mktemp("sigkill")
    jobs = {pair: _pair_job(root, *pair, micro_model) for pair in PAIRS}
    pool = ThreadPoolExecutor(max_workers=len(PAIRS))
    chains = {pair: pool.submit(_kill_twice, jobs[pair], root / f"{pair[0]}-{pair[1]}") for pair in PAIRS}
    yield {pair: (jobs[pair], root / f"{pair[0]}-{pair[1]}", chains[pair]) for pair in PAIRS}
    pool.shutdown(wait=True)


@pytest.mark.parametrize("name,kind", PAIRS, ids=[f"{o}+{t}" for o, t in PAIRS])
def test_a_job_sigkilled_twice_and_resumed_equals_the_uninterrupted_run(name, kind, killed, tmp_path):
    job, wd, chain = killed[(name, kind)]
    ref = tmp_path / "ref"
    assert train(load_job(job), ref, progress="none") == 0  # in-process, while the kill chains run
    assert chain.result(timeout=600) >= 2
    # resumed to the end (in-process), from the last checkpoint committed before the torn one
    assert train(load_job(job), wd, progress="none") == 0
    assert [e["from_step"] for e in read_events(wd) if e["event"] == "resumed"][-1] >= 2
    a, b = adapter_bytes(ref), adapter_bytes(wd)
    assert a and sorted(a) == sorted(b) and [k for k in a if a[k] != b[k]] == []


BNB_IMPORT = """
import os, sys
import torch
from engine.training.adapters import import_bitsandbytes
import_bitsandbytes()  # what a trainer calls before its first peft import (and the warm trainer before its imports)
import bitsandbytes
loaded = sorted(m for m in ("torch._inductor.compile_fx", "functorch.compile") if m in sys.modules)
compiled = torch.compile(lambda x: x * 2, backend="eager")
print(loaded, "TORCHDYNAMO_DISABLE" in os.environ, hasattr(compiled, "_torchdynamo_orig_callable"),
      compiled(torch.ones(1)).item())
"""


def test_a_trainer_imports_bitsandbytes_without_compiling_its_fallback_kernels_and_can_still_compile():
    """bitsandbytes torch.compiles four fallback kernels at import (TorchInductor's import: ~1 s of every trainer's
    start); lorad's devices never call them. A fresh process, as a trainer is."""
    import subprocess
    import sys

    from tests.helpers.processes import REPO, child_env

    out = subprocess.run([sys.executable, "-c", BNB_IMPORT], capture_output=True, text=True, env=child_env(),
                         cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[-2] == "[] False True 2.0"
