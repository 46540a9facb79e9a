"""The learning-rate schedule across attempts whose `train.steps` differ (engine/training/lr_schedule.py).

`steps` may change between attempts, and it is where the decay reaches 0: the plan in effect travels in
each checkpoint's state.json, and a changed total re-plans the rest of the decay from the resume step
without a jump in the learning rate.
"""

from __future__ import annotations

import math

import pytest

from engine.config.train import TrainConfig
from engine.training.lr_schedule import LrPlan, resume_plan


def train(**kw) -> TrainConfig:
    return TrainConfig(**({"lr": 1e-3, "schedule": "cosine", "steps": 1000} | kw))


def test_a_fresh_plan_is_warm_up_then_the_decay_to_zero_at_train_steps():
    t = train(warmup_steps=100)
    plan = LrPlan.fresh(t)
    assert plan.lr_at(0, t) == pytest.approx(1e-5) and plan.lr_at(99, t) == pytest.approx(1e-3)
    assert plan.lr_at(100, t) == 1e-3
    assert plan.lr_at(550, t) == 1e-3 * 0.5 * (1 + math.cos(math.pi * 450 / 900))
    assert plan.lr_at(1000, t) == 0.0 and plan.lr_at(1200, t) == 0.0
    lin = train(schedule="linear")
    assert LrPlan.fresh(lin).lr_at(250, lin) == pytest.approx(0.75e-3)
    const = train(schedule="constant")
    assert LrPlan.fresh(const).lr_at(999, const) == 1e-3


@pytest.mark.parametrize("schedule", ["cosine", "linear"])
@pytest.mark.parametrize("new_steps", [2000, 800])
def test_a_changed_total_goes_on_from_the_lr_of_the_resume_step_and_reaches_zero_at_the_new_total(schedule,
                                                                                                  new_steps):
    old, new = train(schedule=schedule, warmup_steps=50), train(schedule=schedule, warmup_steps=50, steps=new_steps)
    before = LrPlan.fresh(old)
    plan, said = resume_plan({"lr_plan": before.to_state()}, 600, new)
    assert plan.lr_at(600, new) == pytest.approx(before.lr_at(600, old), rel=1e-12)  # no jump
    lrs = [plan.lr_at(s, new) for s in range(600, new_steps + 1)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:], strict=False)) and lrs[-1] == pytest.approx(0.0, abs=1e-15)
    # what happens is said, with both totals and the value the schedule goes on from
    assert f"train.steps changed 1000 → {new_steps}" in said and f"{before.lr_at(600, old):.4g}" in said
    assert "jumped to" in said


def test_replans_compose_across_several_changes_and_an_unchanged_total_keeps_its_plan():
    a, b, c = train(), train(steps=2000), train(steps=1500)
    p1, _ = resume_plan({"lr_plan": LrPlan.fresh(a).to_state()}, 600, b)
    p2, said = resume_plan({"lr_plan": p1.to_state()}, 900, c)
    assert p2.lr_at(900, c) == pytest.approx(p1.lr_at(900, b), rel=1e-12) and p2.lr_at(1500, c) == 0.0
    same, nothing = resume_plan({"lr_plan": p2.to_state()}, 1000, c)
    assert same == p2 and nothing is None


def test_an_extended_finished_decay_restarts_from_lr_and_says_so():
    old, new = train(steps=1000), train(steps=1500)
    plan, said = resume_plan({"lr_plan": LrPlan.fresh(old).to_state()}, 1000, new)
    assert plan.lr_at(1000, new) == 1e-3 and plan.lr_at(1500, new) == 0.0
    assert "warm restart" in said and "already reached 0 at step 1000" in said


def test_nothing_to_replan_in_the_warm_up_for_a_constant_schedule_or_for_an_old_checkpoint():
    new = train(steps=2000, warmup_steps=100)
    plan, said = resume_plan({"lr_plan": LrPlan.fresh(train(warmup_steps=100)).to_state()}, 50, new)
    assert plan == LrPlan.fresh(new) and said is None
    const = train(steps=2000, schedule="constant")
    assert resume_plan({"lr_plan": LrPlan.fresh(train(schedule="constant")).to_state()}, 600, const)[1] is None
    # a checkpoint written before plans were stored: the schedule of the current steps, as before
    assert resume_plan({"step": 600}, 600, new) == (LrPlan.fresh(new), None)
