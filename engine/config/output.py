"""output and logging: what a run writes besides checkpoints."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from engine.config.declare import Strict


class OutputConfig(Strict):
    # Unset for an image family: by lora.type (engine/config/defaults.py).
    formats: list[Literal["peft", "diffusers", "comfyui"]] = Field(default_factory=lambda: ["peft"])


class LoggingConfig(Strict):
    # TensorBoard event files in jobs/ID/tb/ (engine/report/tensorboard.py); null = on when the package is installed.
    tensorboard: bool | None = None
