"""The daemon config's `notify:` section: a webhook and/or a command when a job ends or a checkpoint is slow."""

from __future__ import annotations

import shlex
from typing import Any, Literal, Union
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

EVENTS = ("succeeded", "failed", "stopped_by_power", "checkpoint_slow", "gpu_quarantined", "captions_ready")


class NotifySettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    webhook_url: str | None = None  # http(s)://...: a JSON POST per event
    command: Union[str, list[str], None] = None  # argv (a list, or a string split like a shell would; no shell runs it)
    on: list[Literal["succeeded", "failed", "stopped_by_power", "checkpoint_slow", "gpu_quarantined",
                     "captions_ready"]] = Field(
        default_factory=lambda: list(EVENTS))
    timeout_s: float = Field(10.0, gt=0, le=300)  # per try, webhook and command alike
    retries: int = Field(3, ge=0, le=20)  # tries after the first failure, with backoff 1, 2, 4 ... s (at most 30)

    @model_validator(mode="before")
    @classmethod
    def _yaml_on(cls, v: Any) -> Any:
        # YAML 1.1 (PyYAML) reads the bare key `on:` as the boolean true; it means this section's `on`.
        if isinstance(v, dict) and True in v:
            v = {("on" if k is True else k): val for k, val in v.items()}
        return v

    @field_validator("webhook_url")
    @classmethod
    def _url(cls, v: str | None) -> str | None:
        if v is not None and (urlsplit(v).scheme not in ("http", "https") or not urlsplit(v).netloc):
            raise ValueError(f"must be an http:// or https:// URL (got {v!r})")
        return v

    @field_validator("command")
    @classmethod
    def _argv(cls, v: str | list[str] | None) -> str | list[str] | None:
        if v is not None and not (shlex.split(v) if isinstance(v, str) else v):
            raise ValueError("must name a program")
        return v

    def argv(self) -> list[str] | None:
        if self.command is None:
            return None
        return shlex.split(self.command) if isinstance(self.command, str) else list(self.command)
