"""Power caps: set a GPU's limit, remember what it was, put it back.

The limit found the first time a GPU is touched is the one restored — at job
end (when no daemon-wide cap applies) and at daemon exit. A refused change is
reported once per GPU and per limit, and never raised: the job runs on at
whatever limit the driver keeps. A daemon that is not root sets limits through
the power helper (daemon/power/helper_client.py): its device says so.
"""

from __future__ import annotations

from typing import Any

from daemon.power.gpu import CapRefused, Device


class CapManager:
    def __init__(self, device: Device, log: Any):
        self.device, self.log = device, log
        self.original: dict[int, float] = {}  # gpu -> limit before lorad changed it
        self.applied: dict[int, float] = {}  # gpu -> limit lorad last set successfully
        self._refused: set[tuple[int, float]] = set()
        self.last_refusal: dict[int, str] = {}

    def clamp(self, gpu: int, watts: float) -> float:
        info = self.device.info(gpu)
        return min(max(watts, info.min_w), info.max_w)

    def apply(self, gpu: int, watts: float | None, reason: str) -> bool:
        """Make `watts` the GPU's limit (None: the original one). True when the driver took it."""
        if watts is None:
            return self.restore(gpu, reason)
        watts = self.clamp(gpu, watts)
        if self.applied.get(gpu) == watts:
            return True
        if (gpu, watts) in self._refused:
            return False  # already reported; do not hammer the driver every tick
        if gpu not in self.original:
            self.original[gpu] = self.device.limit_w(gpu)
        try:
            self.device.set_limit_w(gpu, watts)
        except CapRefused as e:
            self._refused.add((gpu, watts))
            self.last_refusal[gpu] = str(e)
            self.log.warning("power limit refused", gpu=gpu, limit_w=watts, reason=reason, error=str(e))
            return False
        self.applied[gpu] = watts
        self.log.info("power limit set", gpu=gpu, limit_w=watts, reason=reason)
        return True

    def restore(self, gpu: int, reason: str) -> bool:
        if gpu not in self.original or gpu not in self.applied:
            return True  # never changed by us
        before = self.original[gpu]
        try:
            # Through the power helper, the driver's default is restore-default: the helper then forgets the GPU.
            restore_default = getattr(self.device, "restore_default", None)
            if restore_default is not None and before == self.device.info(gpu).default_w:
                restore_default(gpu)
            else:
                self.device.set_limit_w(gpu, before)
        except CapRefused as e:
            self.log.warning("power limit restore refused", gpu=gpu, limit_w=before, reason=reason, error=str(e))
            return False
        del self.applied[gpu]
        self.log.info("power limit restored", gpu=gpu, limit_w=before, reason=reason)
        return True

    def restore_all(self, reason: str) -> None:
        for gpu in list(self.applied):
            self.restore(gpu, reason)
