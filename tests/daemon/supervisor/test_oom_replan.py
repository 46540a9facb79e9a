"""The daemon's side of an out-of-memory: the floors it stores from the trainer's checked event, or the one line
the job fails with (daemon/supervisor/oom_replan.py), and the event as the stdout reader checks it."""

from __future__ import annotations

import json

import pytest

from daemon.supervisor import trainer_output
from daemon.supervisor.oom_replan import after_oom

PLAN = {"blocks": 19, "swap": 4, "keep": 0, "attention": 19, "recompute": 0, "samples": "on", "micro_batch": 2,
        "grad_accum": 2, "summary": "swap 4/19 blocks; activations: 19 attention-only; ..."}


def oom_event(**over) -> dict:
    line = json.dumps({"event": "out_of_memory", "step": 900, "phase": "step", "needed_bytes": 3 << 29,
                       "plan": PLAN, "message": "out of GPU memory in step at step 900", **over}).encode()
    return trainer_output.parse(line)


def test_the_floors_grow_from_the_plan_the_trainer_ran_under_and_keep_what_was_tried():
    first = after_oom(None, oom_event())
    assert first.lever == "blocks_to_swap 4→8" and first.failure is None and first.before == PLAN["summary"]
    assert json.loads(first.memory) == {"swap_at_least": 8, "tried": ["blocks_to_swap 4→8"]}
    # the next attempt ran with every block swapped; then the checkpointing lever
    second = after_oom(first.memory, oom_event(plan={**PLAN, "swap": 19}))
    assert second.lever == "activation checkpointing: whole blocks"
    assert json.loads(second.memory)["tried"] == ["blocks_to_swap 4→8", "activation checkpointing: whole blocks"]
    # a sample render ran out: skipping samples first
    assert after_oom(None, oom_event(phase="sample")).lever == "samples skipped"


def test_no_lever_left_is_one_line_with_what_was_tried_and_what_it_needed():
    spent = {**PLAN, "swap": 19, "attention": 0, "recompute": 19, "samples": "skip", "micro_batch": 1}
    r = after_oom('{"tried": ["blocks_to_swap 4→19", "micro-batch 2→1 (grad_accum 2→4)"]}', oom_event(plan=spent))
    assert r.memory is None and r.lever is None
    assert r.failure == ("out of GPU memory in step at step 900, needed 1.50 GiB more with no lever left; tried: "
                         "blocks_to_swap 4→19; micro-batch 2→1 (grad_accum 2→4); last plan: " + PLAN["summary"])
    # a trainer that said nothing of its plan (it ran out while loading): no guess, the job fails with the line
    assert after_oom(None, oom_event(plan=None, phase="load", step=0)).failure.startswith(
        "out of GPU memory in load at step 0, needed 1.50 GiB more with no lever left; tried: nothing")


@pytest.mark.parametrize("bad", [{"plan": {"blocks": -1}}, {"plan": {"swap": "4"}}, {"needed_bytes": -5},
                                 {"plan": {"summary": "x" * 20000}}, {"step": 10 ** 30}])
def test_an_out_of_memory_line_out_of_bounds_is_refused_before_the_daemon_acts_on_it(bad):
    with pytest.raises(trainer_output.Refused):
        oom_event(**bad)
