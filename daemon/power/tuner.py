"""`power.limit_w: auto`: find the power limit with the lowest energy per step within a slowdown bound.

During the real run (no separate benchmark), the tuner walks candidate limits
from the GPU's maximum down to its minimum constraint. At each one it lets
`warmup_steps` pass (clocks and temperature settle), then measures
`measure_steps`: seconds per step from the heartbeats' arrival times and
joules per step from the GPU's energy counter. The limit with the lowest J/step
whose s/step is within (1 + max_slowdown) of the fastest (maximum-limit) point
wins — Zeus's MaxSlowdownConstraint, applied online.

Cost bound. Profiling steps are still real training steps; what they cost is
at most their own count. With the defaults (2 warm-up + 3 measured steps, at
most 8 candidates, budget 2% of the job) a 2000-step job gets
min(8, floor(0.02 * 2000 / 5)) = 8 candidates = 40 steps = 2.0% of the job,
and a shorter job gets fewer candidates (fewer than 2: no tuning, default limit).
Step time grows as the limit falls, so once a candidate is outside the
slowdown bound every lower one is too and profiling stops early.

The result is kept per (GPU model, job shape) in power_profiles, so a restart
or the next job of the same shape starts at the chosen limit at once.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any


@dataclass
class Point:
    limit_w: float
    s_per_step: float
    j_per_step: float

    def to_dict(self) -> dict[str, float]:
        return {"limit_w": self.limit_w, "s_per_step": self.s_per_step, "j_per_step": self.j_per_step}


def candidate_limits(min_w: float, max_w: float, total_steps: int, warmup_steps: int, measure_steps: int,
                     max_candidates: int, budget_fraction: float, round_w: int = 5) -> list[float]:
    """Evenly spaced limits from max_w down to min_w, as many as the profiling budget pays for."""
    per = warmup_steps + measure_steps
    n = min(max_candidates, int(budget_fraction * total_steps) // per)
    if n < 2 or max_w <= min_w:
        return []
    out: list[float] = []
    for i in range(n):
        w = max_w - (max_w - min_w) * i / (n - 1)
        w = min(max(round(w / round_w) * round_w, min_w), max_w)
        if w not in out:
            out.append(float(w))
    return out


def profiling_steps(n_candidates: int, warmup_steps: int, measure_steps: int) -> int:
    return n_candidates * (warmup_steps + measure_steps)


def choose(points: list[Point], max_slowdown: float) -> Point | None:
    """The point with the lowest J/step among those no slower than (1 + max_slowdown) x the fastest point."""
    if not points:
        return None
    fastest = min(p.s_per_step for p in points)
    ok = [p for p in points if p.s_per_step <= fastest * (1.0 + max_slowdown)]
    return min(ok, key=lambda p: (p.j_per_step, -p.limit_w))


def job_shape_key(job: dict[str, Any]) -> str:
    """What decides a job's power/speed trade-off: model, LoRA, sequence length, batch, precision knobs.

    Not the name, data path, seed, learning rate or step count — those do not change the per-step load.
    """
    model = job.get("model") or {}
    train = job.get("train") or {}
    data = job.get("data") or {}
    shape = {
        "model": {k: v for k, v in model.items() if k not in ("revision",)},
        "lora": job.get("lora") or {},
        "seq_len": data.get("seq_len"),
        "train": {k: train.get(k) for k in ("batch_size", "grad_accum", "optimizer", "gradient_checkpointing",
                                           "blocks_to_swap", "compile")},
    }
    return hashlib.sha256(json.dumps(shape, sort_keys=True, default=str).encode()).hexdigest()[:16]


class Tuner:
    """One job's online profile. Feed it step heartbeats; `limit_w` is what the GPU should be set to now."""

    def __init__(self, candidates: list[float], warmup_steps: int, measure_steps: int, max_slowdown: float,
                 measured: list[Point] | None = None):
        # `measured`: points of an interrupted profile of the same shape; only the other candidates are run.
        self.points: list[Point] = list(measured or [])
        done_w = {p.limit_w for p in self.points}
        self.candidates = [w for w in candidates if w not in done_w]
        self.warmup_steps, self.measure_steps, self.max_slowdown = warmup_steps, measure_steps, max_slowdown
        self.chosen: Point | None = None
        self._i = 0
        self._switch_step: int | None = None  # first step seen at the current candidate
        self._mark: tuple[int, float, float] | None = None  # (step, t, energy mJ) where measuring began
        self.done = not self.candidates

    @classmethod
    def from_profile(cls, points: list[dict], max_slowdown: float) -> Tuner:
        t = cls([], 0, 1, max_slowdown)
        t.points = [Point(**p) for p in points]
        t.chosen = choose(t.points, max_slowdown)
        return t

    @property
    def limit_w(self) -> float | None:
        if self.done:
            return self.chosen.limit_w if self.chosen else None
        return self.candidates[self._i]

    def observe(self, step: int, t: float, energy_mj: float, applied_w: float | None) -> bool:
        """One heartbeat. Returns True when the profile just finished (the caller persists it)."""
        if self.done:
            return False
        if applied_w is not None and applied_w != self.candidates[self._i]:
            # Something else (a schedule or UPS cap) holds the GPU below the candidate: do not measure it.
            self._switch_step, self._mark = None, None
            return False
        if self._switch_step is None:
            self._switch_step = step
        if self._mark is None:
            if step - self._switch_step >= self.warmup_steps:
                self._mark = (step, t, energy_mj)
            return False
        s0, t0, e0 = self._mark
        if step - s0 < self.measure_steps:
            return False
        n = step - s0
        p = Point(self.candidates[self._i], (t - t0) / n, (energy_mj - e0) / 1000.0 / n)
        self.points.append(p)
        fastest = min(q.s_per_step for q in self.points)
        too_slow = p.s_per_step > fastest * (1.0 + self.max_slowdown)
        self._i += 1
        # The caller sets the next limit right after this heartbeat, so step+1 is the first step at it.
        self._switch_step, self._mark = step, None
        if too_slow or self._i >= len(self.candidates):
            self.done = True
            self.chosen = choose(self.points, self.max_slowdown)
            return True
        return False
