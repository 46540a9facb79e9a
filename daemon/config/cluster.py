"""The daemon config's `cluster:` section: where jobs that span machines meet and train.

Trust model: torchrun's c10d rendezvous store is not authenticated, and what the ranks exchange through it is
unpickled. Anyone who can reach HOST:PORT can join a job's rendezvous or feed its ranks data; the store listens
on every interface of the machine that hosts it (torch offers no bind address). So it belongs on a trusted
private network, behind a firewall that keeps the port to the cluster's machines. A `rendezvous` on a public
address is refused unless `allow_public_rendezvous: true` says the operator has put something in front of it.
"""

from __future__ import annotations

import ipaddress
import os
import re
import socket

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

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
    # The rendezvous is unauthenticated (module docstring): a public address is refused unless this says so.
    allow_public_rendezvous: bool = False

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

    @model_validator(mode="after")
    def _private_unless_allowed(self) -> ClusterSettings:
        if self.allow_public_rendezvous:
            return self
        public = [a for a in rendezvous_addresses(self.rendezvous) if a.is_global]
        if public:
            raise ValueError(f"rendezvous: {self.rendezvous} is a public address ({public[0]}); torchrun's "
                             "rendezvous is unauthenticated and unpickles what it receives, so it belongs on a "
                             "private network. Use a private address, or set allow_public_rendezvous: true if a "
                             "firewall or VPN keeps the port to the cluster's machines")
        return self


def rendezvous_addresses(endpoint: str) -> list[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    """The addresses HOST of HOST:PORT stands for: itself if it is one, else what the resolver says now (nothing if
    it cannot resolve it: the launch reports an unreachable rendezvous later)."""
    host = endpoint.rsplit(":", 1)[0].strip("[]")
    try:
        return [ipaddress.ip_address(host)]
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except OSError:
        return []
    return [ipaddress.ip_address(info[4][0].split("%")[0]) for info in infos]
