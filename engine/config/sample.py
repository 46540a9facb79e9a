"""sample: preview images rendered during training (image families)."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from engine.config.declare import Strict


class SampleConfig(Strict):
    """Preview images rendered during training: every_steps, with fixed seeds, into WORKDIR/samples/step-N/."""

    every_steps: int | None = Field(None, ge=1)
    prompts: list[Annotated[str, Field(min_length=1, max_length=2000)]] = Field(default_factory=list, max_length=64)
    seed: int = Field(42, ge=0, le=2**31 - 1)
    steps: int = Field(20, ge=1, le=200)
    guidance: float = Field(3.5, ge=0.0, le=100.0)
    width: int = Field(1024, ge=32, le=4096)
    height: int = Field(1024, ge=32, le=4096)
