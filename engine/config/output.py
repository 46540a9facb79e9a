"""output and logging: what a run writes besides checkpoints."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from engine.config.declare import Strict, key


class OutputConfig(Strict):
    # Unset for an image family: by lora.type (engine/config/defaults.py).
    formats: list[Literal["peft", "diffusers", "comfyui"]] = Field(default_factory=lambda: ["peft"])
    # The daemon's mirror (its config's `mirrors:`) this job's checkpoints are copied to; null: the daemon's
    # default_mirror. Not identity (the whole output section is not): a job may move to another mirror.
    # Unset, neither is in the normalised job (dump_default=False): the dumps of jobs from before them stay as
    # they were (tests/engine/config/pinned_jobs.yaml).
    mirror: str | None = key(None, min_length=1, max_length=64, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$",
                             dump_default=False)
    # A Hugging Face Hub repo (USER/NAME) the final output is pushed to once the job succeeded (daemon/mirror/hub.py);
    # never required for success.
    push_to_hub: str | None = key(None, max_length=200, pattern=r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$",
                                  dump_default=False)


class LoggingConfig(Strict):
    # TensorBoard event files in jobs/ID/tb/ (engine/report/tensorboard.py); null = on when the package is installed.
    tensorboard: bool | None = None
