"""What the daemon asks of one attempt after an out-of-memory, and the ladder of levers it walks.

The daemon keeps an AttemptMemory per job in its store (never in the user's job.yaml, never in the job's
identity) and passes it to each attempt as JSON in $LORAD_MEMORY_PLAN. Its fields are floors the plan may not go
under (engine/memory_plan/choose.py), whatever the job or the budget says:

    swap_at_least          at least this many blocks swap
    activations_at_least   keep | attention | recompute: every block keeps no more than this
    samples                skip: no preview images rendered (they cost a pipeline's memory at a step's end)
    micro_batch            the micro-batch, smaller than train.batch_size; grad_accum grows so the effective batch
                           (batch_size × grad_accum × processes) stays the same
    tried                  what was pulled so far, in words (the one-line failure names it)

replan(): after an out-of-memory, the next lever from the plan the trainer ran with (its `out_of_memory` event
carries it), in this order: samples skipped first when the samples ran out of memory; more block swap (doubled,
up to every block); more activation checkpointing (attention outputs only, then whole blocks); samples skipped;
then a smaller micro-batch (halved, or its largest proper divisor). None: no lever left. An out-of-memory while
the frozen base was placed (phase `load`) has block swap alone.
"""

from __future__ import annotations

import json
import os
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

PLAN_ENV = "LORAD_MEMORY_PLAN"
BUDGET_ENV = "LORAD_VRAM_BUDGET_GB"  # the daemon's free-VRAM figure (engine/memory_plan/budget.py reads it)
MAX_TRIED = 32


class AttemptMemory(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    swap_at_least: int = Field(0, ge=0, le=100_000)
    activations_at_least: Literal["keep", "attention", "recompute"] = "keep"
    samples: Literal["on", "skip"] = "on"
    micro_batch: int | None = Field(None, ge=1, le=4096)
    tried: list[Annotated[str, Field(max_length=200)]] = Field(default_factory=list, max_length=MAX_TRIED)

    def level(self) -> int:
        """How many levers were pulled (0: the job as planned)."""
        return len(self.tried)

    def to_json(self) -> str:
        return self.model_dump_json(exclude_defaults=True)


def attempt_memory(env: dict[str, str] | None = None) -> tuple[AttemptMemory, str | None]:
    """This attempt's floors from $LORAD_MEMORY_PLAN (none: the defaults), and a warning when the value is bad."""
    raw = (os.environ if env is None else env).get(PLAN_ENV, "").strip()
    if not raw:
        return AttemptMemory(), None
    return parse(raw)


def parse(raw: str | None) -> tuple[AttemptMemory, str | None]:
    if not raw:
        return AttemptMemory(), None
    try:
        return AttemptMemory.model_validate(json.loads(raw)), None
    except (ValueError, ValidationError) as e:
        why = str(e).splitlines()[0][:200]
        return AttemptMemory(), f"{PLAN_ENV} ignored: not a memory plan ({why})"


def replan(ran: dict[str, Any], current: AttemptMemory, phase: str = "step") -> tuple[AttemptMemory, str] | None:
    """The next floors after an out-of-memory under the plan `ran` (MemoryPlan.report()), and what changed in
    words; None when no lever is left."""
    blocks, swap = int(ran.get("blocks", 0)), int(ran.get("swap", 0))
    keep, attn = int(ran.get("keep", 0)), int(ran.get("attention", 0))
    micro, samples = int(ran.get("micro_batch", 1)), ran.get("samples", "none")

    def skip_samples():
        if samples == "on":
            return {"samples": "skip"}, "samples skipped"
        return None

    def more_swap():
        if blocks and swap < blocks:
            new = min(blocks, max(1, swap * 2))
            return {"swap_at_least": new}, f"blocks_to_swap {swap}→{new}"
        return None

    def more_checkpointing():
        if keep:
            return {"activations_at_least": "attention"}, "activation checkpointing: attention outputs only"
        if attn:
            return {"activations_at_least": "recompute"}, "activation checkpointing: whole blocks"
        return None

    def smaller_micro_batch():
        if micro > 1:
            new = next(d for d in range(micro // 2, 0, -1) if micro % d == 0)
            accum = int(ran.get("grad_accum", 1)) * micro // new
            return {"micro_batch": new}, f"micro-batch {micro}→{new} (grad_accum {ran.get('grad_accum', 1)}→{accum})"
        return None

    ladder = [more_swap, more_checkpointing, skip_samples, smaller_micro_batch]
    if phase == "sample":
        ladder.insert(0, skip_samples)
    if phase == "load":  # the frozen base did not fit: only fewer of its blocks on the device helps
        ladder = [more_swap]
    for lever in ladder:
        if (step := lever()) is not None:
            change, words = step
            tried = [*current.tried, words][-MAX_TRIED:]
            return current.model_copy(update={**change, "tried": tried}), words
    return None
