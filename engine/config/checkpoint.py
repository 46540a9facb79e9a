"""checkpoint: how often a run saves what it needs to resume."""

from __future__ import annotations

from pydantic import Field, model_validator

from engine.config.declare import Strict


class CheckpointConfig(Strict):
    every_steps: int | None = Field(100, ge=1)
    every_seconds: float | None = Field(60.0, gt=0)
    keep: int = Field(3, ge=1, le=1000)

    @model_validator(mode="after")
    def _some_trigger(self):
        if self.every_steps is None and self.every_seconds is None:
            raise ValueError("every_steps and every_seconds are both null: nothing would be "
                             "saved before the end, and an outage would lose the whole run; set at least one")
        return self
