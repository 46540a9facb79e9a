"""The soak's oracle for committed work: a checkpoint lorad reported committed is never lost.

lorad's promise: once a trainer has reported a checkpoint committed (its `checkpoint_committed` event, the line
in events.jsonl that is also the heartbeat the daemon reads), no kill and no power cut takes it away: every later
trainer of the job resumes from that step or a newer one. A bit-identical final adapter cannot show a breach (a
job that lost a checkpoint redoes the steps from an older one and ends the same), so the soak replays each job's
story and checks every resume against what was promised by then.

The story of one job, in the order the soak saw it (bench/soak.py builds it): what the trainer reported
(`start`, `resumed`, `step`, `checkpoint_committed`, read from events.jsonl) and what the soak did (`corrupted`:
it flipped bytes of that step's checkpoint; `fault`: a fault of the schedule). Replayed against a model of the
job's checkpoint store (CheckpointStore: a commit prunes all but the newest `checkpoint.keep` step directories,
valid or not; a load sets aside the invalid ones newer than what it resumed from), the promise at each resume
is the newest committed checkpoint the store must still hold: not one the soak corrupted, not one pruned.

Where a trainer resumed from: its `resumed` event, or, when it trained from nothing or that line was lost (a full
disk drops the trainer's log lines), its first step event's step - 1.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

Entry = tuple[float, str, Any]  # (monotonic time the soak saw it, what, a step or the fault's record)
STORY = {"start": None, "resumed": "from_step", "step": "step", "checkpoint_committed": "step"}


def story(fresh: Iterable[tuple[float, dict[str, Any]]], corrupted: Iterable[tuple[float, int]],
          faults: Iterable[tuple[float, dict[str, Any]]]) -> list[Entry]:
    """One job's story: its events (Tail.fresh), the soak's corruptions of its checkpoints and every fault, by
    time (events first seen in one poll keep their order in the file)."""
    out: list[Entry] = [(t, e["event"], e.get(STORY[e["event"]]) if STORY[e["event"]] else None)
                        for t, e in fresh if e.get("event") in STORY]
    out += [(t, "corrupted", step) for t, step in corrupted]
    out += [(t, "fault", rec) for t, rec in faults]
    return sorted(out, key=lambda e: e[0])


class Ledger:
    """One job's checkpoint directories as the store must have them: step -> (valid, when it was committed)."""

    def __init__(self, keep: int):
        self.keep = keep
        self.dirs: dict[int, tuple[bool, float]] = {}
        # Steps the soak corrupted: a commit of that step reported by the same trainer is the one it corrupted (seen
        # late), not a new one; the next trainer's commit of that step replaces it.
        self.stale: set[int] = set()
        self.open = False  # a trainer started and has not yet said where from

    def promised(self) -> tuple[int, float]:
        """The newest valid committed step (0: none) and when it was reported."""
        return max(((s, t) for s, (ok, t) in self.dirs.items() if ok), default=(0, float("-inf")))

    def committed(self, step: int, t: float) -> None:
        if step in self.stale:
            return
        self.dirs[step] = (True, t)
        for i, s in enumerate(sorted(self.dirs, reverse=True)):
            if i >= self.keep and s != step:
                del self.dirs[s]

    def corrupted(self, step: int) -> None:
        self.dirs[step] = (False, self.dirs.get(step, (False, float("-inf")))[1])
        self.stale.add(step)

    def started(self) -> None:
        self.open, self.stale = True, set()

    def resumed(self, step: int, t: float) -> tuple[int, float] | None:
        """The trainer resumed from `step`: the promise it broke (step, when reported), or None."""
        if not self.open:
            return None
        self.open = False
        promise = self.promised()
        self.dirs = {s: v for s, v in self.dirs.items() if s <= step}  # newer: set aside as invalid (or lost)
        if step:
            self.dirs[step] = (True, self.dirs.get(step, (True, t))[1])
        return promise if step < promise[0] else None


def check(job: str, entries: list[Entry], keep: int) -> tuple[int, str | None]:
    """Replay one job's story: (the step promised now, the first broken promise as a sentence, or None)."""
    ledger = Ledger(keep)
    faults: list[tuple[float, dict[str, Any]]] = []
    for t, what, value in entries:
        if what == "fault":
            faults.append((t, value))
        elif what == "checkpoint_committed":
            ledger.committed(int(value), t)
        elif what == "corrupted":
            ledger.corrupted(int(value))
        elif what == "start":
            ledger.started()
        elif what in ("resumed", "step"):
            frm = int(value) if what == "resumed" else int(value) - 1
            if (broken := ledger.resumed(frm, t)) is not None:
                return ledger.promised()[0], breach(job, broken, frm, [f for f in faults if f[0] < t])
    return ledger.promised()[0], None


def breach(job: str, promise: tuple[int, float], frm: int, faults: list[tuple[float, dict[str, Any]]]) -> str:
    step, t_commit = promise
    after = [rec for t, rec in faults if t > t_commit]
    if after:  # the one that killed the trainer, if one did: the nearest to the restart
        f = ([rec for rec in after if rec.get("kills")] or after)[-1]
        return (f"job {job}: step {step} was reported committed before fault #{f['n']} ({f['kind']}) but the "
                f"trainer resumed from step {frm}")
    return (f"job {job}: step {step} was reported committed (no fault since) but the next trainer resumed "
            f"from step {frm}")
