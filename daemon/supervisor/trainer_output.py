"""What a trainer says on stdout, bounded and checked before the daemon believes a word of it.

The trainer runs job code (a custom model, a data loader), so its stdout is input from a less-trusted process:
    lines       read in chunks of READ_CHUNK bytes; a line longer than MAX_LINE_BYTES is skipped to its end
                without ever being held whole (a 100 MB line costs the reader MAX_LINE_BYTES + READ_CHUNK)
    fields      the events the daemon acts on are checked for type and range (pydantic, strict): a string
                loss or a step of 10**100 would otherwise reach state.db and break `lorad status` or every tick
    refusals    a refused line is dropped, and each kind of refusal is said once per attempt (a trainer that
                repeats a bad line a million times is one log line, with the count at its exit)
Lines that do not start with `{` are not events (a library printing to stdout) and are skipped silently.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import IO, Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic_core import from_json

MAX_LINE_BYTES = 1 << 20  # the engine's longest line (an invalid_job's message) is a few KiB
READ_CHUNK = 1 << 16
MAX_STEP = 2 ** 53  # exact as a float (the dashboard's charts) and within SQLite's INTEGER
MAX_TEXT = 16 << 10  # a message or a path

Step = Annotated[int, Field(ge=0, le=MAX_STEP)]
Seconds = Annotated[float, Field(ge=0, allow_inf_nan=False)]
Text = Annotated[str, Field(max_length=MAX_TEXT)]


class _Event(BaseModel):
    # strict: no "1" for 1, no true for 1. A NaN or infinite loss is a real (diverged) value and is kept.
    model_config = ConfigDict(strict=True, extra="allow")
    event: Annotated[str, Field(max_length=64)]


class _Step(_Event):
    step: Step = 0
    total: Annotated[int, Field(ge=1, le=MAX_STEP)] = 1
    loss: float | None = None
    s_per_step: Seconds | None = None
    eta_s: Seconds | None = None


class _Validation(_Event):
    step: Step = 0
    loss: float | None = None


class _Resumed(_Event):
    from_step: Step = 0


class _Committed(_Event):
    step: Step = 0
    path: Text | None = None


class _AtStep(_Event):  # done, checkpoint_slow
    step: Step = 0
    seconds: Seconds | None = None


class _Message(_Event):  # invalid_job, disk_error
    message: Text = ""


class _Phase(_Event):
    phase: Annotated[str, Field(max_length=64)] = ""


class _PlanReport(BaseModel):
    """The memory plan an attempt ran under (engine/memory_plan/choose.py MemoryPlan.report), as far as the
    daemon's re-plan reads it."""
    model_config = ConfigDict(strict=True, extra="ignore")
    blocks: Annotated[int, Field(ge=0, le=100_000)] = 0
    swap: Annotated[int, Field(ge=0, le=100_000)] = 0
    keep: Annotated[int, Field(ge=0, le=100_000)] = 0
    attention: Annotated[int, Field(ge=0, le=100_000)] = 0
    recompute: Annotated[int, Field(ge=0, le=100_000)] = 0
    samples: Annotated[str, Field(max_length=16)] = "none"
    micro_batch: Annotated[int, Field(ge=1, le=4096)] = 1
    grad_accum: Annotated[int, Field(ge=1, le=1 << 20)] = 1
    summary: Text = ""


class _MemoryPlan(_Event, _PlanReport):
    pass


class _OutOfMemory(_Event):
    step: Step = 0
    phase: Annotated[str, Field(max_length=64)] = ""
    needed_bytes: Annotated[int, Field(ge=0, le=1 << 60)] | None = None
    plan: _PlanReport | None = None
    message: Text = ""


# The events whose fields the daemon reads (daemon/supervisor/trainer.py Child.heard, the loop, the power policy).
CHECKED: dict[str, type[_Event]] = {
    "step": _Step, "validation": _Validation, "resumed": _Resumed, "checkpoint_committed": _Committed,
    "done": _AtStep, "checkpoint_slow": _AtStep, "invalid_job": _Message, "disk_error": _Message, "phase": _Phase,
    "memory_plan": _MemoryPlan, "out_of_memory": _OutOfMemory,
}


class Refused(ValueError):
    """A line the daemon will not act on; `kind` groups the refusals that are said once."""

    def __init__(self, kind: str, reason: str):
        super().__init__(reason)
        self.kind = kind
        self.reason = reason


@dataclass(frozen=True)
class TooLong:
    """A line cut at MAX_LINE_BYTES: only its length is known."""
    size: int


def lines(stream: IO[bytes], cap: int = MAX_LINE_BYTES) -> Iterator[bytes | TooLong]:
    """The stream's lines without their newline; a line longer than `cap` is skipped to its end (TooLong)."""
    buf = bytearray()
    skipped = 0  # > 0 while skipping the rest of an over-long line
    while chunk := stream.read1(READ_CHUNK):  # type: ignore[attr-defined]
        start = 0
        while (nl := chunk.find(b"\n", start)) >= 0:
            piece = chunk[start:nl]
            if skipped:
                yield TooLong(skipped + len(piece))
                skipped = 0
            elif len(buf) + len(piece) > cap:
                yield TooLong(len(buf) + len(piece))
                buf.clear()
            else:
                yield bytes(buf + piece) if buf else piece
                buf.clear()
            start = nl + 1
        rest = chunk[start:]
        if skipped:
            skipped += len(rest)
        elif len(buf) + len(rest) > cap:
            skipped = len(buf) + len(rest)
            buf.clear()
        else:
            buf += rest
    if skipped:
        yield TooLong(skipped)
    elif buf:
        yield bytes(buf)


def checked(ev: Any) -> dict[str, Any]:
    """An event the daemon may act on, its numbers as their declared types; Refused if it is not one."""
    if not isinstance(ev, dict):
        raise Refused("not_an_object", "a line starting with { is not a JSON object")
    if "event" not in ev:
        return ev  # not an event (a library's JSON); a heartbeat all the same, as before
    kind = ev["event"] if isinstance(ev["event"], str) and ev["event"] in CHECKED else "event"
    try:
        return CHECKED.get(kind, _Event).model_validate(ev).model_dump(exclude_unset=True)
    except ValidationError as e:
        # Said in lorad's words, never with the input (it may be huge); the kind is ours too (bounded).
        problems = "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors())
        first = ".".join(map(str, e.errors()[0]["loc"]))
        raise Refused(f"{kind}.{first}", f"{kind} line refused: {problems}") from None


def parse(item: bytes | TooLong) -> dict[str, Any] | None:
    """One stdout line → a checked event, None for a line that is not an event; Refused for a bad one."""
    if isinstance(item, TooLong):
        raise Refused("too_long", f"a line of {item.size} bytes (more than {MAX_LINE_BYTES}) was dropped unread")
    line = item.strip()
    if not line.startswith(b"{"):
        return None
    try:
        ev = from_json(line)  # nesting is capped (about 200 levels), as on the socket
    except ValueError as e:
        raise Refused("not_json", f"a line starting with {{ is not JSON: {str(e)[:200]}") from None
    return checked(ev)


@dataclass
class Refusals:
    """The refusals of one attempt: each kind said once, all counted."""
    counts: dict[str, int] = field(default_factory=dict)

    def first(self, r: Refused) -> bool:
        """Count it; True the first time its kind is seen."""
        n = self.counts.get(r.kind, 0)
        self.counts[r.kind] = n + 1
        return n == 0

    def total(self) -> int:
        return sum(self.counts.values())
