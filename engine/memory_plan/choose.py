"""The pick: the plan that fits the budget at the least cost in speed, by the byte model of costs.py.

From everything resident, every activation kept and compile as the job has it, levers are pulled one block at a
time until the estimate fits `budget × (1 − RESERVE)`:
    1. a block keeps only its input and attention output (checkpointed, attention not recomputed), first blocks first
    2. a block keeps only its input (recomputed whole)
    3. one more block swaps (the last blocks first: engine/frozen_base/blockswap.py)
    4. compile off (its buffers)
A lever the job set is not pulled: train.gradient_checkpointing: true (every block recomputes, through the family),
train.blocks_to_swap above 0 (plan_for says why "set" means "not the default"). What the daemon asks after an
out-of-memory (AttemptMemory) is a floor under any of them. Nothing fits: the plan pulls every lever it may and
says `fits: false` with its estimate; the attempt runs, and an out-of-memory re-plans.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from engine.memory_plan.attempt import AttemptMemory
from engine.memory_plan.budget import GIB, Budget
from engine.memory_plan.costs import RESERVE, BlockCosts

CHOICES = ("keep", "attention", "recompute")  # least saving first


@dataclass(frozen=True)
class MemoryPlan:
    blocks: int
    swap: int  # the last `swap` blocks stream their frozen weights from host memory
    activations: tuple[str, ...]  # per block: keep | attention | recompute
    compile: bool
    samples: str  # on | skip | none (the job renders none)
    micro_batch: int
    grad_accum: int
    budget: int | None  # bytes; None: no limit
    source: str  # where the budget came from (budget.py)
    estimate: int  # bytes, the byte model's peak for this plan
    fits: bool
    explicit: tuple[str, ...] = ()  # the job's keys the plan kept as they are
    family_checkpointing: bool = False  # train.gradient_checkpointing: true; the family checkpoints every block

    def counts(self) -> dict[str, int]:
        return {c: self.activations.count(c) for c in CHOICES}

    def report(self) -> dict:
        """The plan as the `memory_plan` event and the out-of-memory event carry it (the daemon re-plans from it)."""
        d = asdict(self)
        d.pop("activations")
        d.update(self.counts(), explicit=list(self.explicit), summary=self.summary())
        return d

    def summary(self) -> str:
        c = self.counts()
        acts = ", ".join(f"{n} {w}" for w, n in (("kept", c["keep"]), ("attention-only", c["attention"]),
                                                  ("recomputed", c["recompute"])) if n)
        budget = "no limit" if self.budget is None else f"{size(self.budget)} ({self.source})"
        parts = [f"swap {self.swap}/{self.blocks} blocks", f"activations: {acts or 'no blocks'}",
                 f"compile {'on' if self.compile else 'off'}",
                 f"micro-batch {self.micro_batch} × {self.grad_accum}"]
        if self.samples == "skip":
            parts.append("samples skipped")
        return "; ".join(parts) + f"; budget {budget}, estimate {size(self.estimate)}" + \
            ("" if self.fits else " (does not fit)")


def choose_plan(costs: BlockCosts, budget: Budget, *, swap: int | None = None, checkpointing: bool | None = None,
                compile_: bool = False, compile_explicit: bool = False, floor: AttemptMemory | None = None,
                samples: str = "none", micro_batch: int = 1, grad_accum: int = 1) -> MemoryPlan:
    """The plan for `costs` under `budget`. swap / checkpointing: the job's explicit train.blocks_to_swap /
    train.gradient_checkpointing (None: not set, the plan picks); compile_: the job's train.compile."""
    floor = floor or AttemptMemory()
    n = costs.blocks
    explicit = tuple(k for k, v in (("train.blocks_to_swap", swap), ("train.gradient_checkpointing", checkpointing))
                     if v is not None) + (("train.compile",) if compile_explicit else ())
    s = max(min(swap or 0, n), min(floor.swap_at_least, n))
    base = "recompute" if checkpointing else "keep"
    lowest = max(CHOICES.index(base), CHOICES.index(floor.activations_at_least))
    acts = [CHOICES[lowest]] * n
    comp = compile_
    avail = None if budget.bytes is None else int(budget.bytes * (1 - RESERVE))

    def est() -> int:
        return costs.peak(s, tuple(acts), comp)

    while avail is not None and est() > avail:
        if checkpointing is None and (i := _first(acts, "keep")) is not None:
            acts[i] = "attention"
        elif checkpointing is None and (i := _first(acts, "attention")) is not None:
            acts[i] = "recompute"
        elif swap is None and s < n:
            s += 1
        elif comp and not compile_explicit:
            comp = False
        else:
            break
    return MemoryPlan(blocks=n, swap=s, activations=tuple(acts), compile=comp,
                      samples="skip" if floor.samples == "skip" and samples == "on" else samples,
                      micro_batch=micro_batch, grad_accum=grad_accum, budget=budget.bytes, source=budget.source,
                      estimate=est(), fits=avail is None or est() <= avail, explicit=explicit,
                      family_checkpointing=bool(checkpointing))


def size(n: int) -> str:
    """Bytes in words: GiB from one GiB up, MiB below (a test's micro model is a few MiB)."""
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / (1 << 20):.1f} MiB"


def _first(acts: list[str], choice: str) -> int | None:
    return next((i for i, a in enumerate(acts) if a == choice), None)


def plan_for(cfg, costs: BlockCosts, budget: Budget, floor: AttemptMemory, micro_batch: int, grad_accum: int,
             cuda: bool) -> MemoryPlan:
    """The plan for this job's attempt: its explicit keys, the daemon's floors, the budget.

    The daemon's jobs/ID/job.yaml is normalised, defaults written out, so "explicit" means "not the default":
    train.blocks_to_swap above 0 and train.gradient_checkpointing: true are kept as written; at their defaults the
    plan picks. train.compile: true may be turned off on CUDA when nothing else fits, as the last lever."""
    from engine.frozen_base.compiling import compile_wanted  # train.compile: auto is on CUDA only

    t = cfg.train
    samples = "on" if (cfg.sample.every_steps and cfg.sample.prompts) else "none"
    return choose_plan(costs, budget,
                       swap=t.blocks_to_swap or None,
                       checkpointing=True if t.gradient_checkpointing else None,
                       compile_=compile_wanted(t, "cuda" if cuda else "cpu"), compile_explicit=not cuda,
                       floor=floor, samples=samples, micro_batch=micro_batch, grad_accum=grad_accum)
