"""Where training stands: the step, the data order's cursor and the LR plan a checkpoint records with the weights.

The data order is a pure function of (seed, samples consumed), so the cursor alone puts a resumed run back on
the sample it would have drawn next, on any number of processes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.config.job import JobConfig
from engine.data.order import Cursor
from engine.training.lr_schedule import LrPlan


@dataclass
class Position:
    """Where training stands: what a checkpoint records besides the weights, the optimizer and the RNGs."""

    step: int = 0
    consumed: int = 0  # samples drawn, over all epochs: the data order's cursor
    train_seconds: float = 0.0
    lr_plan: LrPlan | None = None  # None: the schedule of train.steps (engine/training/lr_schedule.py)
    shards: Path | None = None  # resumed from a sharded checkpoint: its shards, still to be loaded by every rank

    def lr(self, cfg: JobConfig) -> float:
        return (self.lr_plan or LrPlan.fresh(cfg.train)).lr_at(self.step, cfg.train)

    def state(self, dataset_size: int, cfg: JobConfig) -> dict[str, Any]:
        c = Cursor(self.consumed, dataset_size)
        return {"step": self.step, "samples_consumed": self.consumed, "epoch": c.epoch, "position": c.position,
                "dataset_size": dataset_size, "train_seconds": self.train_seconds,
                "config_hash": cfg.identity_hash(),
                "lr_plan": (self.lr_plan or LrPlan.fresh(cfg.train)).to_state()}
