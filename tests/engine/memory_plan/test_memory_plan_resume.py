"""A plan is an input of the attempt, not of the job: one job trained over three attempts under three memory plans
(an out-of-memory in the first) ends bit-identical, on the CPU, to an uninterrupted run under none."""

from __future__ import annotations

import json

import pytest
import torch

from engine.memory_plan.attempt import AttemptMemory, replan
from engine.recipe import train
from engine.training.stop import StopFlag
from tests.helpers.jobs import adapter_bytes, read_events, tiny_job

STEPS = 6


def job(micro_model, tmp_path):
    # dropout 0.1 (the tiny job's): a recomputed block must draw the same mask
    return tiny_job(micro_model, tmp_path, train={"steps": STEPS}, checkpoint={"every_steps": 1, "keep": 2})


@pytest.fixture(scope="module")
def reference(micro_model, tmp_path_factory) -> dict[str, bytes]:
    tmp = tmp_path_factory.mktemp("plan-ref")
    assert train(job(micro_model, tmp), tmp / "w", progress="none") == 0
    return adapter_bytes(tmp / "w")


def stop_during(monkeypatch, step: int) -> StopFlag:
    """A stop flag raised while optimizer step `step` computes its loss (one micro-batch per step here)."""
    from engine.families.causal_lm import CausalLM

    stop, calls, real = StopFlag(), [0], CausalLM.loss

    def loss(self, model, batch, generator):
        calls[0] += 1
        if calls[0] == step:
            stop.request("SIGTERM")
        return real(self, model, batch, generator)

    monkeypatch.setattr(CausalLM, "loss", loss)
    return stop


def plans(wd) -> list[dict]:
    return [e for e in read_events(wd) if e["event"] == "memory_plan"]


def test_a_job_resumed_under_other_memory_plans_ends_bit_identical(micro_model, tmp_path, monkeypatch, reference):
    wd = tmp_path / "w"
    cfg = job(micro_model, tmp_path)

    # 1. no budget, no floors; a real torch.OutOfMemoryError inside step 3, after its first backward
    monkeypatch.setenv("LORAD_DEBUG_OOM_AT_STEP", "3")
    assert train(cfg, wd, progress="none") == 69
    (oom,) = [e for e in read_events(wd) if e["event"] == "out_of_memory"]
    assert (oom["phase"], oom["step"], oom["needed_bytes"]) == ("step", 3, 2 << 30)
    assert oom["plan"]["swap"] == 0 and oom["plan"]["keep"] == 2  # the plan it ran under, for the daemon
    # nothing of step 3 committed (its gradients were half accumulated); the saves before it may have been
    # skipped while the writer was busy (one save in flight)
    ckpts = sorted(p.name for p in (wd / "checkpoints").iterdir())
    assert ckpts and all(".tmp-" not in c for c in ckpts) and ckpts[-1] <= "step-00000002", ckpts
    at = int(ckpts[-1].split("-")[1])

    # 2. the re-plan's floors (one more swapped block), and checkpointing that keeps attention outputs; stopped
    #    during its third step. The hook is still set: the floors' level (1) is past it.
    floors, lever = replan(oom["plan"], AttemptMemory())
    assert lever == "blocks_to_swap 0→1"
    floors = floors.model_copy(update={"activations_at_least": "attention"})
    monkeypatch.setenv("LORAD_MEMORY_PLAN", floors.to_json())
    assert train(cfg, wd, progress="none", stop=stop_during(monkeypatch, 3)) == 75
    monkeypatch.undo()

    # 3. a budget too small for anything: every block swapped and recomputed; to the end
    monkeypatch.setenv("LORAD_VRAM_BUDGET_GB", "0.0001")
    assert train(cfg, wd, progress="none") == 0

    seen = [(p["swap"], p["keep"], p["attention"], p["recompute"], p["source"]) for p in plans(wd)]
    assert seen == [(0, 2, 0, 0, "none"), (1, 0, 2, 0, "none"), (2, 0, 0, 2, "LORAD_VRAM_BUDGET_GB")]
    assert [e["from_step"] for e in read_events(wd) if e["event"] == "resumed"] == [at, at + 3]
    hashes = {e["config_hash"] for e in read_events(wd) if e["event"] == "start"}
    assert hashes == {cfg.identity_hash()}  # the job's identity never saw a plan
    assert adapter_bytes(wd) == reference
    assert json.loads(floors.to_json())["tried"] == ["blocks_to_swap 0→1"]


def _out_of_memory(*a, **k):
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 512.00 MiB. GPU 0 has a total capacity of ...")


@pytest.mark.parametrize("phase", ["sample", "validation"])
def test_out_of_memory_in_a_sample_or_validation_pass_is_exit_69_naming_the_phase(micro_model, tmp_path, monkeypatch,
                                                                                  phase):
    from engine.families.causal_lm import CausalLM

    if phase == "sample":
        monkeypatch.setattr(CausalLM, "on_step_end", lambda self, model, step, *a: step == 2 and _out_of_memory())
        cfg = tiny_job(micro_model, tmp_path, train={"steps": 4})
    else:
        monkeypatch.setattr("engine.recipe.evaluate", _out_of_memory)
        cfg = tiny_job(micro_model, tmp_path, train={"steps": 4}, data={"validation": {"fraction": 0.2, "every_steps": 2}})
    assert train(cfg, tmp_path / "w", progress="none") == 69
    (oom,) = [e for e in read_events(tmp_path / "w") if e["event"] == "out_of_memory"]
    assert (oom["phase"], oom["step"], oom["needed_bytes"]) == (phase, 2, 512 << 20)
    assert oom["plan"]["summary"].startswith("swap 0/2 blocks")
    assert not [e for e in read_events(tmp_path / "w") if e["event"] in ("done", "stopped")]
