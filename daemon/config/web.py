"""The daemon config's `web:` section: the dashboard and /metrics listener.

Loopback by default. A listen address that other machines can reach is a
config error unless `allow_remote: true` says it is meant (and then every page
still needs the token).
"""

from __future__ import annotations

import ipaddress
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

DEFAULT_LISTEN = "127.0.0.1:8742"


def split_listen(listen: str) -> tuple[str, int]:
    """'HOST:PORT' (IPv6 as '[::1]:PORT') → (host, port); ValueError naming what is wrong."""
    host, sep, port = listen.rpartition(":")
    if not sep or not host:
        raise ValueError(f"must be HOST:PORT (got {listen!r})")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"port must be 0..65535 (got {port!r})")
    return host, int(port)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name other than localhost: it may resolve to anything


class WebSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    enabled: bool = True  # serve the dashboard and /metrics from `lorad serve`
    listen: str = DEFAULT_LISTEN  # HOST:PORT; port 0 picks a free one (`lorad web-url` shows it)
    allow_remote: bool = False  # needed for a listen address other machines can reach (the token is still required)
    metrics_auth: Literal["token", "loopback"] = "token"  # /metrics: the token, or any client on loopback only
    poll_s: float = Field(2.0, ge=0.2, le=600)  # how often open pages refresh their live parts
    # names (Host headers) the dashboard answers to besides localhost, the machine's own names and IP addresses:
    # a proxy's or a DNS alias's; others are refused (DNS rebinding). ["*"] turns the check off.
    hosts: list[str] = Field(default_factory=list, max_length=64)
    header_timeout_s: float = Field(10.0, gt=0, le=600)  # a request's headers must arrive whole within this long

    @field_validator("listen")
    @classmethod
    def _listen(cls, v: str) -> str:
        split_listen(v)
        return v

    @model_validator(mode="after")
    def _remote(self) -> WebSettings:
        host, _ = split_listen(self.listen)
        if not is_loopback(host) and not self.allow_remote:
            raise ValueError(f"listen {self.listen!r} is reachable from other machines; "
                             "set web.allow_remote: true to allow it (the token is still required)")
        return self

    def host_port(self) -> tuple[str, int]:
        return split_listen(self.listen)
