"""sample: preview images rendered during training (image families)."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from engine.config.declare import Strict, key

Text = Annotated[str, Field(min_length=1, max_length=2000)]
Seed = Annotated[int, Field(ge=0, le=2**31 - 1)]


class SamplePrompt(Strict):
    """One sample prompt with its own negative prompt and seed (a plain string takes sample's defaults)."""

    prompt: Text
    negative: Annotated[str, Field(max_length=2000)] = ""  # "" = none: guidance pushes from the empty caption
    seed: Seed | None = None  # None: sample.seed + the prompt's index
    # an edit job's control image(s) for this prompt (a file, or one per data.control_path slot)
    control: str | Annotated[list[str], Field(min_length=1, max_length=4)] | None = key(None, dump_default=False)


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

    def controls(self) -> list[list[str]]:
        """Each prompt's control images (data.control_path's edit jobs), [] where it names none."""
        out = []
        for p in self.prompts:
            c = p.control if isinstance(p, SamplePrompt) else None
            out.append([] if c is None else [c] if isinstance(c, str) else list(c))
        return out
