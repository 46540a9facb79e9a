"""The learning-rate schedule, and how it goes on when `train.steps` changes between attempts.

    lr(t) = lr · (t + 1) / warmup_steps           while t < warmup_steps
    lr(t) = lr · shape(p(t))                      after: shape(p) = 1 (constant), 1 − p (linear),
                                                  ½(1 + cos πp) (cosine); p(t) = progress of the decay

`train.steps` may change between attempts (it is outside the config hash: a job can be extended or cut
short while it runs), yet it is where the decay reaches 0. Recomputing p from the new total at resume
would make the learning rate jump: a cosine at step 600 of 1000 is at 0.35·lr, the same step of 2000 at
0.79·lr. So each checkpoint's state.json keeps the plan in effect (`lr_plan`), and a changed total
re-plans only what is left: from the resume step s the progress runs on from where it is, p(s), to 1 at
the new total, so the curve keeps its value at s and its shape, stretched or squeezed over the rest:

    p(t) = p0 + (1 − p0) · (t − start) / (total − start)     (start = warmup_steps, p0 = 0 at first)

Two cases have nothing to continue: a resume still in the warm-up (the decay has not begun: it simply
uses the new total) and one after the decay reached 0 (an extended finished job: continuing would train
every new step at lr 0, so the decay starts again from `lr` at s — a warm restart, said as such).
Checkpoints written before plans were stored carry none; they resume on the schedule of the current
`train.steps`, as they always did.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from engine.config.train import TrainConfig


@dataclass(frozen=True)
class LrPlan:
    total: int  # the step at which the decay reaches 0
    start: int  # the step from which the progress below runs linearly to 1 at `total`
    progress: float  # the decay's progress at `start` (0 = not decayed yet)

    @staticmethod
    def fresh(train: TrainConfig) -> LrPlan:
        return LrPlan(total=train.steps, start=train.warmup_steps, progress=0.0)

    def progress_at(self, step: int) -> float:
        return min(1.0, self.progress + (1.0 - self.progress) * (step - self.start) / max(1, self.total - self.start))

    def lr_at(self, step: int, train: TrainConfig) -> float:
        """Learning rate for optimizer step `step` (0-based)."""
        if train.warmup_steps and step < train.warmup_steps:
            return train.lr * (step + 1) / train.warmup_steps
        if train.schedule == "constant":
            return train.lr
        p = self.progress_at(step)
        if train.schedule == "linear":
            return train.lr * (1.0 - p)
        return train.lr * 0.5 * (1.0 + math.cos(math.pi * p))

    def to_state(self) -> dict[str, Any]:
        return {"total": self.total, "start": self.start, "progress": self.progress}


def resume_plan(state: dict[str, Any], step: int, train: TrainConfig) -> tuple[LrPlan, str | None]:
    """The plan to go on with from a checkpoint's state at `step`, and what changed in plain words (or None)."""
    stored = state.get("lr_plan")
    if not isinstance(stored, dict):
        return LrPlan.fresh(train), None  # written before plans were kept: the current steps, as before
    was = LrPlan(int(stored["total"]), int(stored["start"]), float(stored["progress"]))
    if was.total == train.steps or step >= train.steps or train.schedule == "constant":
        return (was if was.total == train.steps else LrPlan.fresh(train)), None
    change = f"train.steps changed {was.total} → {train.steps} since the checkpoint of step {step}"
    if step < train.warmup_steps:
        return LrPlan.fresh(train), None  # the decay has not begun: nothing to keep continuous
    p = was.progress_at(step)
    if p >= 1.0:
        plan = LrPlan(total=train.steps, start=step, progress=0.0)
        return plan, (f"{change}: the {train.schedule} decay had already reached 0 at step {was.total}, so it "
                      f"starts again from lr {train.lr:g} at step {step} down to 0 at step {train.steps} "
                      "(a warm restart)")
    plan = LrPlan(total=train.steps, start=step, progress=p)
    jump = LrPlan.fresh(train).lr_at(step, train)
    return plan, (f"{change}: the {train.schedule} decay goes on from lr {plan.lr_at(step, train):.4g} at step "
                  f"{step} and now reaches 0 at step {train.steps} (recomputed from the new total it would have "
                  f"jumped to {jump:.4g})")
