"""output and logging: what a run writes besides checkpoints."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from engine.config.declare import Strict


class OutputConfig(Strict):
    # Unset for an image family: by lora.type (engine/config/defaults.py).
    formats: list[Literal["peft", "diffusers", "comfyui"]] = Field(default_factory=lambda: ["peft"])
    # The daemon's mirror (its config's `mirrors:`) this job's checkpoints are copied to; null: the daemon's
    # default_mirror. Not identity (the whole output section is not): a job may move to another mirror.
    mirror: str | None = Field(None, min_length=1, max_length=64, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


class LoggingConfig(Strict):
    # TensorBoard event files in jobs/ID/tb/ (engine/report/tensorboard.py); null = on when the package is installed.
    tensorboard: bool | None = None
