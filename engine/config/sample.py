"""sample: preview images rendered during training (image families)."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from engine.config.declare import Strict

Text = Annotated[str, Field(min_length=1, max_length=2000)]
Seed = Annotated[int, Field(ge=0, le=2**31 - 1)]


class SamplePrompt(Strict):
    """One sample prompt with its own negative prompt and seed (a plain string takes sample's defaults)."""

    prompt: Text
    negative: Annotated[str, Field(max_length=2000)] = ""  # "" = none: guidance pushes from the empty caption
    seed: Seed | None = None  # None: sample.seed + the prompt's index


class SampleConfig(Strict):
    """Preview images rendered during training: every_steps, with fixed seeds, into WORKDIR/samples/step-N/."""

    every_steps: int | None = Field(None, ge=1)
    prompts: list[Text | SamplePrompt] = Field(default_factory=list, max_length=64)
    seed: Seed = 42
    steps: int = Field(20, ge=1, le=200)
    guidance: float = Field(3.5, ge=0.0, le=100.0)
    width: int = Field(1024, ge=32, le=4096)
    height: int = Field(1024, ge=32, le=4096)

    def entries(self) -> list[tuple[str, str, int]]:
        """(prompt, negative prompt, seed) for each of `prompts`, the defaults filled in."""
        out = []
        for i, p in enumerate(self.prompts):
            p = p if isinstance(p, SamplePrompt) else SamplePrompt(prompt=p)
            out.append((p.prompt, p.negative, self.seed + i if p.seed is None else p.seed))
        return out
