"""resources and power: the devices a job runs on, and the power they may draw."""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import Field

from engine.config.declare import Strict


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
