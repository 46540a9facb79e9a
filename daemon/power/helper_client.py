"""The daemon's side of the power helper (daemon/power/helper.py): a Device whose limit changes go through it.

A daemon that is not root (the unit's User=lorad) cannot change an NVML limit itself: `through_helper` wraps
the NVML device so that CapManager's set_limit_w / restore_default become requests on the helper's socket, and
everything else (telemetry, constraints, the enforced limit) is read from NVML directly, which needs no root.
Without the helper every change is a CapRefused saying so: the caps are reported as refused (`lorad power`, the
dashboard), once per GPU and limit, and training goes on.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Any

from daemon.power.gpu import CapRefused, Device, GpuInfo, Sample
from daemon.power.helper import MAX_LINE, Reply

TIMEOUT_S = 10.0  # an NVML call takes milliseconds; a helper that does not answer is a refusal


class HelperLimits:
    """One request per connection on the helper's socket."""

    def __init__(self, path: Path | str, timeout_s: float = TIMEOUT_S):
        self.path, self.timeout_s = Path(path), timeout_s

    def unavailable(self) -> str | None:
        """Why caps cannot be set at all (no helper socket), or None."""
        if not self.path.exists():
            return (f"power caps unavailable: no power helper at {self.path} "
                    "(sudo systemctl enable --now lorad-power)")
        return None

    def call(self, request: dict[str, Any]) -> float:
        """The GPU's limit after the request; CapRefused with the helper's reason (or why it could not be asked)."""
        if why := self.unavailable():
            raise CapRefused(why)
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(self.timeout_s)
                s.connect(str(self.path))
                try:
                    s.sendall(json.dumps(request).encode() + b"\n")
                except (BrokenPipeError, ConnectionResetError):
                    pass  # refused before it read the request (busy): its answer is still ours to read
                data = s.makefile("rb").readline(MAX_LINE + 1)
        except OSError as e:
            raise CapRefused(f"power caps unavailable: the power helper at {self.path}: {e}") from None
        try:
            reply = Reply.model_validate_json(data)
        except ValueError:
            raise CapRefused(f"power helper at {self.path}: unreadable reply {data[:100]!r}") from None
        if not reply.ok or reply.limit_w is None:
            raise CapRefused(f"power helper: {reply.error}")
        return reply.limit_w

    def set_limit_w(self, gpu: int, watts: float) -> None:
        self.call({"op": "set-limit", "gpu": gpu, "watts": float(watts)})

    def restore_default(self, gpu: int) -> None:
        self.call({"op": "restore-default", "gpu": gpu})


class ThroughHelper:
    """An NVML device read directly, its limits set by the power helper."""

    def __init__(self, device: Device, limits: HelperLimits):
        self.device, self.limits = device, limits
        self.simulated = device.simulated

    def count(self) -> int:
        return self.device.count()

    def info(self, gpu: int) -> GpuInfo:
        return self.device.info(gpu)

    def sample(self, gpu: int) -> Sample:
        return self.device.sample(gpu)

    def energy_mj(self, gpu: int) -> float:
        return self.device.energy_mj(gpu)

    def limit_w(self, gpu: int) -> float:
        return self.device.limit_w(gpu)

    def set_limit_w(self, gpu: int, watts: float) -> None:
        self.limits.set_limit_w(gpu, watts)

    def restore_default(self, gpu: int) -> None:
        self.limits.restore_default(gpu)

    def caps_unavailable(self) -> str | None:
        return self.limits.unavailable()

    def close(self) -> None:
        self.device.close()


def caps_seam(device: Device | None, helper_socket: str, euid: int | None = None) -> Device | None:
    """The device CapManager should use: NVML itself as root, NVML through the helper otherwise. The simulated
    device is its own process's and needs no root (demos, tests)."""
    euid = os.geteuid() if euid is None else euid
    if device is None or device.simulated or euid == 0:
        return device
    return ThroughHelper(device, HelperLimits(helper_socket))
