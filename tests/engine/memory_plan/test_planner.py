"""The memory planner as tables: budgets → choices, the job's keys and the daemon's floors, the budget's sources,
and the out-of-memory ladder from a plan to no lever left. No model, no training: the byte model's inputs are
written out, so each expected row can be checked by hand."""

from __future__ import annotations

import pytest
import torch

from engine.memory_plan.attempt import AttemptMemory, attempt_memory, parse, replan
from engine.memory_plan.budget import GIB, Budget, vram_budget
from engine.memory_plan.choose import choose_plan
from engine.memory_plan.costs import RESERVE, BlockCosts

MIB = 1 << 20
# 4 blocks of 100 MiB of frozen weights, 50 MiB fixed; activations per block: 40 MiB kept, 5 attention-only,
# 2 recomputed; compile's buffers 40 MiB.
COSTS = BlockCosts(block_weights=(100 * MIB,) * 4, fixed=50 * MIB, act_keep=40 * MIB, act_attn=5 * MIB,
                   act_none=2 * MIB, compile_extra=40 * MIB)


def budget_for(peak_mib: float) -> Budget:
    """The budget whose usable part (after RESERVE) is exactly `peak_mib`."""
    return Budget(int(peak_mib * MIB / (1 - RESERVE)) + 1, "resources.vram_gb")


def shape(plan) -> tuple[int, str, bool]:
    return plan.swap, "".join(a[0] for a in plan.activations), plan.compile  # k(eep) a(ttention) r(ecompute)


@pytest.mark.parametrize("peak_mib, expected", [
    # (usable MiB, (swap, activations per block, compile, estimate MiB)); 50 fixed + 400 weights + activations
    (650, (0, "kkkk", True, 650)),   # everything kept: 4·40 + compile 40
    (649, (0, "aakk", True, 620)),   # one attention-only block costs its recompute (40): 655; two pay for it
    (619, (0, "aaak", True, 585)),   # 3·5 + 40 + 40 (recompute) + 40 (compile)
    (584, (0, "aaaa", True, 550)),
    (549, (0, "raaa", True, 547)),   # whole recompute from the first block
    (540, (0, "rrrr", True, 538)),   # 4·2 + 40 + 40
    # one or two swapped blocks save nothing (the window holds two): three do, then four
    (537, (3, "rrrr", True, 438)),   # 100 resident + 200 window
    (437, (4, "rrrr", True, 338)),   # 200 window
    (337, (4, "rrrr", False, 298)),  # compile off, the last lever
    (297, (4, "rrrr", False, 298)),  # nothing fits: every lever pulled, and it says so
])
def test_a_smaller_budget_pulls_more_levers_in_order(peak_mib, expected):
    plan = choose_plan(COSTS, budget_for(peak_mib), compile_=True)
    assert (*shape(plan), plan.estimate // MIB) == expected
    assert plan.fits == (expected[3] <= peak_mib)
    assert plan.source == "resources.vram_gb" and "does not fit" in plan.summary() or plan.fits


def test_the_estimate_is_the_byte_model_of_the_choices():
    assert COSTS.peak(0, ("keep",) * 4, False) == (50 + 400 + 160) * MIB
    # two swapped blocks: both in the window; three: still two in the window, one more off the device
    assert COSTS.peak(2, ("keep",) * 4, False) == (50 + 200 + 200 + 160) * MIB
    assert COSTS.peak(3, ("keep",) * 4, False) == (50 + 100 + 200 + 160) * MIB
    # any recomputing block adds one block's kept activations (it holds them while it is recomputed)
    assert COSTS.peak(0, ("recompute",) * 4, False) == (50 + 400 + 8 + 40) * MIB
    assert COSTS.peak(0, ("keep",) * 4, True) == (50 + 400 + 160 + 40) * MIB


def test_no_budget_keeps_the_jobs_settings_and_a_large_one_pulls_nothing():
    for budget in (Budget(None, "none"), Budget(64 * GIB, "free VRAM")):
        plan = choose_plan(COSTS, budget, compile_=False)
        assert shape(plan) == (0, "kkkk", False) and plan.fits
    assert choose_plan(COSTS, Budget(None, "none"), swap=2, checkpointing=True).swap == 2


def test_the_jobs_keys_win_over_the_budget():
    tight = budget_for(100)
    # blocks_to_swap set: the swap stays; checkpointing is still the plan's
    plan = choose_plan(COSTS, tight, swap=1)
    assert plan.swap == 1 and set(plan.activations) == {"recompute"} and "train.blocks_to_swap" in plan.explicit
    # gradient_checkpointing: true: every block recomputes, through the family, and the plan swaps
    plan = choose_plan(COSTS, tight, checkpointing=True)
    assert plan.family_checkpointing and plan.swap == 4 and set(plan.activations) == {"recompute"}
    # compile explicit (the CPU): kept even when nothing fits
    assert choose_plan(COSTS, tight, compile_=True, compile_explicit=True).compile is True
    assert choose_plan(COSTS, tight, compile_=True, compile_explicit=False).compile is False


def test_the_daemons_floors_beat_the_jobs_keys_and_a_roomy_budget():
    floor = AttemptMemory(swap_at_least=2, activations_at_least="attention", samples="skip", micro_batch=1)
    plan = choose_plan(COSTS, Budget(None, "none"), swap=1, floor=floor, samples="on")
    assert shape(plan) == (2, "aaaa", False) and plan.samples == "skip"
    # a floor above the model's blocks is every block; samples a job does not render stay "none"
    plan = choose_plan(COSTS, Budget(None, "none"), floor=AttemptMemory(swap_at_least=99), samples="none")
    assert plan.swap == 4 and plan.samples == "none"


def test_the_budget_comes_from_the_daemon_then_the_job_then_the_card_then_nowhere():
    cpu = torch.device("cpu")
    assert vram_budget(8.0, cpu, {"LORAD_VRAM_BUDGET_GB": "2.5"}) == Budget(int(2.5 * GIB), "LORAD_VRAM_BUDGET_GB")
    assert vram_budget(8.0, cpu, {}) == Budget(8 * GIB, "resources.vram_gb")
    assert vram_budget(None, cpu, {}) == Budget(None, "none")
    for bad in ("", "nan", "-1", "lots"):  # not a figure the daemon writes: the next source
        assert vram_budget(8.0, cpu, {"LORAD_VRAM_BUDGET_GB": bad}).source == "resources.vram_gb"


def test_resources_vram_gb_is_not_the_jobs_identity(tmp_path, micro_model):
    from tests.helpers.jobs import tiny_job

    plain, planned = tiny_job(micro_model, tmp_path), tiny_job(micro_model, tmp_path, resources={"vram_gb": 24})
    assert planned.resources.vram_gb == 24 and plain.identity_hash() == planned.identity_hash()


def test_the_attempts_floors_come_from_the_environment_and_a_bad_value_is_said_not_fatal():
    assert attempt_memory({}) == (AttemptMemory(), None)
    got, warn = attempt_memory({"LORAD_MEMORY_PLAN": '{"swap_at_least": 3, "tried": ["blocks_to_swap 0→3"]}'})
    assert got.swap_at_least == 3 and got.level() == 1 and warn is None
    for bad in ('{"swap_at_least": -1}', '{"rm": 1}', "not json", '{"micro_batch": 0}'):
        got, warn = parse(bad)
        assert got == AttemptMemory() and warn.startswith("LORAD_MEMORY_PLAN ignored")


def ladder(ran: dict, phase: str = "step") -> list[str]:
    """Every lever replan pulls from the plan `ran`, each attempt running under the floors of the last."""
    floors, pulled = AttemptMemory(), []
    while (nxt := replan(ran, floors, phase)) is not None:
        floors, words = nxt
        pulled.append(words)
        ran = apply(ran, floors)
        phase = "step"
        assert floors.tried == pulled
    return pulled


def apply(ran: dict, f: AttemptMemory) -> dict:
    """The plan the next attempt reports under floors `f` (what choose_plan does with them, in short)."""
    n = ran["blocks"]
    acts = {"keep": (n, 0, 0), "attention": (0, n, 0), "recompute": (0, 0, n)}[f.activations_at_least]
    if f.activations_at_least == "keep":
        acts = (ran["keep"], ran["attention"], ran["recompute"])
    micro = f.micro_batch or ran["micro_batch"]
    return dict(ran, swap=max(ran["swap"], min(f.swap_at_least, n)), keep=acts[0], attention=acts[1],
                recompute=acts[2], samples="skip" if f.samples == "skip" else ran["samples"], micro_batch=micro,
                grad_accum=ran["grad_accum"] * ran["micro_batch"] // micro)


FRESH = dict(blocks=4, swap=0, keep=4, attention=0, recompute=0, samples="on", micro_batch=4, grad_accum=1)


@pytest.mark.parametrize("ran, phase, expected", [
    (FRESH, "step", ["blocks_to_swap 0→1", "blocks_to_swap 1→2", "blocks_to_swap 2→4",
                     "activation checkpointing: attention outputs only", "activation checkpointing: whole blocks",
                     "samples skipped", "micro-batch 4→2 (grad_accum 1→2)", "micro-batch 2→1 (grad_accum 2→4)"]),
    # the samples ran out of memory: skipping them comes first
    (FRESH, "sample", ["samples skipped", "blocks_to_swap 0→1", "blocks_to_swap 1→2", "blocks_to_swap 2→4",
                       "activation checkpointing: attention outputs only", "activation checkpointing: whole blocks",
                       "micro-batch 4→2 (grad_accum 1→2)", "micro-batch 2→1 (grad_accum 2→4)"]),
    # a micro-batch of 6 goes to 3, then 1: the effective batch always divides
    (dict(FRESH, swap=4, keep=0, recompute=4, samples="none", micro_batch=6), "step",
     ["micro-batch 6→3 (grad_accum 1→2)", "micro-batch 3→1 (grad_accum 2→6)"]),
    # every lever already pulled by the job itself: none left
    (dict(FRESH, swap=4, keep=0, recompute=4, samples="none", micro_batch=1), "step", []),
    # a model without repeated blocks: only the batch
    (dict(FRESH, blocks=0, keep=0, samples="none", micro_batch=2), "step", ["micro-batch 2→1 (grad_accum 1→2)"]),
])
def test_the_out_of_memory_ladder_walks_every_lever_in_order_to_none_left(ran, phase, expected):
    assert ladder(ran, phase) == expected


def test_the_out_of_memory_trigger_file_raises_once_in_the_step_that_finds_it(tmp_path, monkeypatch):
    """$LORAD_DEBUG_OOM_FILE (the soak's out_of_memory fault): the first step that finds the file removes it and
    raises the real torch.OutOfMemoryError, at any re-plan level; the next step trains on."""
    from engine.memory_plan.oom import OOM_FILE_ENV, debug_oom, needed_bytes

    trigger = tmp_path / "oom-now"
    monkeypatch.setenv(OOM_FILE_ENV, str(trigger))
    debug_oom(1, 0)  # no file: nothing
    trigger.write_text("job-1")
    with pytest.raises(torch.OutOfMemoryError) as e:
        debug_oom(2, 5)
    assert not trigger.exists() and needed_bytes(e.value) == 2 << 30
    debug_oom(3, 5)
