"""Out of GPU memory while the frozen base is put on the device is a re-plan too: the trainer says how many blocks
the model has and how many it swapped, the re-plan swaps more (nothing else helps a base that does not fit), and
the job loads and trains once enough of its blocks stay on the host. A real torch.OutOfMemoryError, raised while
the base is placed ($LORAD_DEBUG_OOM_AT_LOAD=N: while fewer than N blocks are swapped)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from daemon.supervisor.oom_replan import after_oom
from engine.frozen_base.placing import LoadOutOfMemory, placing
from engine.memory_plan.attempt import AttemptMemory, replan
from engine.recipe import train
from tests.helpers.jobs import adapter_bytes, read_events, tiny_job


def attempt(cfg, wd, monkeypatch, memory: str | None) -> tuple[int, dict | None]:
    """One attempt under the daemon's floors `memory`: its exit code and its out_of_memory event (or None)."""
    if memory is not None:
        monkeypatch.setenv("LORAD_MEMORY_PLAN", memory)
    code = train(cfg, wd, progress="none")
    ooms = [e for e in read_events(wd) if e["event"] == "out_of_memory"]
    return code, ooms[-1] if code == 69 else None


def test_a_base_that_does_not_fit_is_loaded_again_with_more_blocks_swapped_until_it_trains(
        micro_model, tmp_path, monkeypatch):
    cfg = tiny_job(micro_model, tmp_path, train={"steps": 4})
    ref = tmp_path / "ref"
    assert train(cfg, ref, progress="none") == 0
    monkeypatch.setenv("LORAD_DEBUG_OOM_AT_LOAD", "2")  # the micro Llama's 2 blocks: it fits with both swapped

    wd, memory, levers = tmp_path / "w", None, []
    for _ in range(3):
        code, oom = attempt(cfg, wd, monkeypatch, memory)
        if oom is None:
            break
        assert (oom["phase"], oom["step"], oom["needed_bytes"]) == ("load", 0, 1 << 30)
        nxt = after_oom(memory, oom)
        assert nxt.failure is None, nxt.failure
        memory, levers = nxt.memory, [*levers, (nxt.before, nxt.lever)]
    assert code == 0
    assert levers == [("swap 0/2 blocks while loading", "blocks_to_swap 0→1"),
                      ("swap 1/2 blocks while loading", "blocks_to_swap 1→2")]
    assert [(p["swap"], p["replan_level"]) for p in read_events(wd) if p["event"] == "memory_plan"] == [(2, 2)]
    assert not (wd / "checkpoints").exists() or not list((wd / "checkpoints").glob("*.tmp-*"))
    assert adapter_bytes(wd) == adapter_bytes(ref)  # swapping changes no number


def test_with_every_block_swapped_a_load_out_of_memory_fails_naming_what_was_tried():
    floors = AttemptMemory(swap_at_least=2, tried=["blocks_to_swap 0→1", "blocks_to_swap 1→2"])
    oom = {"phase": "load", "step": 0, "needed_bytes": 1 << 30, "plan": LoadOutOfMemory("x", 2, 2).plan()}
    assert replan(oom["plan"], floors, "load") is None
    line = after_oom(floors.to_json(), oom).failure
    assert line == ("out of GPU memory in load at step 0, needed 1.00 GiB more with no lever left; tried: "
                    "blocks_to_swap 0→1; blocks_to_swap 1→2; last plan: swap 2/2 blocks while loading")


def test_a_load_out_of_memory_pulls_no_lever_but_swap():
    # a plan that would otherwise re-plan checkpointing or the micro-batch first: at load, neither helps
    ran = {"blocks": 4, "swap": 4, "keep": 4, "micro_batch": 4, "samples": "on"}
    assert replan(ran, AttemptMemory(), "load") is None
    assert replan(ran, AttemptMemory(), "step")[1] == "activation checkpointing: attention outputs only"


class Blocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))


def test_placing_names_the_blocks_of_an_out_of_memory_and_lets_other_errors_through():
    model = Blocks()
    with pytest.raises(LoadOutOfMemory) as e:
        with placing(model, 1):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 3.00 GiB.")
    assert (e.value.blocks, e.value.swapped) == (3, 1)
    assert e.value.plan()["summary"] == "swap 1/3 blocks while loading"
    with pytest.raises(ValueError):
        with placing(model, 1):
            raise ValueError("not memory")
    assert LoadOutOfMemory("no blocks", 0, 0).plan() is None  # nothing to swap: no re-plan
