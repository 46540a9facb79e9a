"""The daemon config's `cluster:` section: where jobs that span machines meet and train."""

from __future__ import annotations

import os
import re

from pydantic import BaseModel, ConfigDict, Field, field_validator

ENDPOINT = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9][A-Za-z0-9.-]*):(\d{1,5})$")


class ClusterSettings(BaseModel):
    """The daemon config's `cluster` section (configs/daemon.yaml documents each key)."""

    model_config = ConfigDict(extra="forbid")

    rendezvous: str  # HOST:PORT of torchrun's c10d rendezvous store: the same on every machine
    # Whether this machine runs the rendezvous store; null = torchrun decides (HOST is one of this machine's
    # addresses). Set it where that cannot tell (two daemons on one machine, NAT).
    hosts_rendezvous: bool | None = None
    shared_dir: str  # where jobs that span machines train: the same path on every machine, on shared storage
    assume_shared: bool = False  # trust shared_dir without checking its filesystem type (tests, unknown types)
    max_restarts: int = Field(3, ge=0, le=100)  # torchrun's new rounds after a lost machine, per attempt
    join_timeout_s: float = Field(600.0, gt=0, le=86400)  # wait this long for the other machines to join

    @field_validator("rendezvous")
    @classmethod
    def _endpoint(cls, v: str) -> str:
        m = ENDPOINT.match(v)
        if not m or not 1 <= int(m.group(2)) <= 65535:
            raise ValueError(f"must be HOST:PORT (e.g. node-a:29400), got {v!r}")
        return v

    @field_validator("shared_dir")
    @classmethod
    def _absolute(cls, v: str) -> str:
        if not os.path.isabs(os.path.expanduser(v)):
            raise ValueError(f"must be an absolute path (the same on every machine), got {v!r}")
        return os.path.expanduser(v)
