"""resources and power: the devices a job runs on, and the power they may draw."""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import Field

from engine.config.declare import Strict, key


class PowerConfig(Strict):
    limit_w: Union[Annotated[int, Field(ge=1, le=2000)], Literal["auto"], None] = None
    max_slowdown: float = Field(0.10, gt=0.0, le=1.0)


class ResourcesConfig(Strict):
    """The devices one job trains on (engine/distributed/ddp.py, docs/distributed.md)."""

    # Processes per machine, one per GPU (on a machine without a GPU, CPU processes through gloo).
    gpus: int = Field(1, ge=1, le=64)
    # Machines the job spans (torchrun's rendezvous joins them; docs/distributed.md, "Several machines").
    nodes: int = Field(1, ge=1, le=64)
    # The fewest machines it may go on with when one is lost (torchrun --nnodes MIN:MAX); null = nodes.
    min_nodes: int | None = Field(None, ge=1, le=64)
    # The GPU memory this job may plan for, in GiB (engine/memory_plan/): block swap, which blocks keep their
    # activations, compile. Not identity: a plan changes where bytes live and what is recomputed, never the weights.
    # Unset: the daemon's free-VRAM figure (LORAD_VRAM_BUDGET_GB), else the card's free memory, else no limit (CPU).
    vram_gb: float | None = key(None, gt=0.0, le=4096.0, identity=False, dump_default=False)
