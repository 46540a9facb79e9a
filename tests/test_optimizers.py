"""Prodigy, schedule-free AdamW and SCAO: their state survives checkpoints bit-exactly, their defaults and
arguments are validated, and schedule-free's evaluation weights are what samples and the export see. The
stop/resume runs also cover the adapter types DoRA, LoKr and LoHa."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from engine.checkpoint import CheckpointStore
from engine.config import TrainConfig, parse_job
from engine.errors import JobInvalid
from engine.events import read_events
from engine.optim import (
    build_optimizer,
    eval_weights,
    optimizer_advice,
    optimizer_state,
    split_tree,
    use_eval_weights,
)
from engine.run import restore_checkpoint, snapshot, train
from engine.stop import StopFlag
from tests.conftest import QUICKSTART_DATA, adapter_bytes, deep_update, tiny_job, tiny_job_dict

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


# ----------------------------------------------------------------- a real job, stopped twice and resumed
def _stopping_at(monkeypatch, calls: list[int]) -> StopFlag:
    """A stop flag raised during the micro-batch numbered calls[0] (1-based), then calls[1], ... per train()."""
    from engine.families.causal_lm import CausalLM

    stop = StopFlag()
    real = CausalLM.loss
    count = {"n": 0}

    def loss(self, model, batch, generator):
        count["n"] += 1
        if calls and count["n"] == calls[0]:
            stop.request("test")
        return real(self, model, batch, generator)

    monkeypatch.setattr(CausalLM, "loss", loss)
    return stop


# Each run pairs a new optimizer with a new adapter type, so three runs cover all six (lora itself is covered by
# tests/test_resume_exact.py's SIGKILL runs, which share every code path below but the optimizer and the tuner).
PAIRS = [("prodigy", "dora"), ("adamw_schedulefree", "lokr"), ("scao", "loha")]


@pytest.mark.parametrize("name,kind", PAIRS, ids=[f"{o}+{t}" for o, t in PAIRS])
def test_a_job_stopped_twice_and_resumed_equals_the_uninterrupted_run(name, kind, micro_model, tmp_path, monkeypatch):
    cfg = tiny_job(micro_model, tmp_path, train={"optimizer": name, "steps": 6, "lr": 1.0 if name == "prodigy" else 2e-3,
                                                   "optimizer_args": ARGS.get(name, {}),
                                                   **({"schedule": "constant"} if name == "adamw_schedulefree" else {})},
                   lora={"type": kind, "rank": 8, "dropout": 0.1 if kind == "dora" else 0.0}, checkpoint={"every_steps": 2})
    ref = tmp_path / "ref"
    assert train(cfg, ref, progress="none") == 0
    wd = tmp_path / "stopped"
    for at in (2, 2):  # stopped during step 2, then during the 2nd step of the resumed run (step 4)
        assert train(cfg, wd, progress="none", stop=_stopping_at(monkeypatch, [at])) == 75
    monkeypatch.undo()
    assert train(cfg, wd, progress="none") == 0
    events = read_events(wd)
    assert [e["from_step"] for e in events if e["event"] == "resumed"] == [2, 4]
    a, b = adapter_bytes(ref), adapter_bytes(wd)
    assert a and sorted(a) == sorted(b) and [k for k in a if a[k] != b[k]] == []
