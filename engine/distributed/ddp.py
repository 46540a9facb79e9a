"""One job on several processes (DDP through accelerate over torch.distributed), resumable on any world size.

What stays the same whatever the number of processes W:

- The data order. The global batch of a step is the `global_batch` samples at
  global positions consumed .. consumed+global_batch-1 (engine/data/order.py:
  a pure function of (seed, position)). It is cut into micro-batches of
  `train.batch_size`; micro-batch k of the step goes to rank k % W as its
  accumulation round k // W. The count of samples consumed alone therefore
  says where to continue, on 1 process or on 8.
- The global batch. batch_size × grad_accum × W is kept: when W changes,
  grad_accum is re-planned (`plan_grad_accum`); batch_size never is, so the
  micro-batches are the same groups of samples on any W.
- The randomness. Each micro-batch's draws (LoRA dropout, noise, timesteps,
  flips, caption dropout) come from a seed derived from (seed, step, global
  position of the micro-batch's first sample) — not from a stream that
  depends on which rank drew what before. accelerate's `save_state` keeps one
  RNG file per rank and cannot restore them on another world size; keying
  every draw by position makes there nothing to restore.

Only rank 0 writes (checkpoints, output, events.jsonl, stdout); with DDP the
adapter and optimizer state are identical on every rank. Decisions taken at a
step boundary — stop, "checkpoint now" — are agreed by all ranks through one
small all-reduce, so every rank stops after the same optimizer step.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.errors import JobInvalid
from engine.training.stop import EXIT_OK, EXIT_STOPPED


@dataclass(frozen=True)
class World:
    """This process's place in the job, as torchrun's environment gives it (1 process without torchrun)."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def world_from_env(env: dict[str, str] | None = None) -> World:
    env = os.environ if env is None else env
    return World(int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1)), int(env.get("LOCAL_RANK", 0)))


def plan_grad_accum(global_batch: int, batch_size: int, world_size: int) -> int:
    """The grad_accum that keeps `global_batch` on `world_size` processes; JobInvalid (exit 65) when none does."""
    per_round = batch_size * world_size
    if global_batch % per_round:
        raise JobInvalid(
            f"train.batch_size, train.grad_accum, resources.gpus: the global batch of this job is {global_batch} "
            f"samples (batch_size × grad_accum × processes), which {world_size} process(es) × batch_size "
            f"{batch_size} cannot divide; run it on a number of processes that divides "
            f"{global_batch // batch_size}, or start a new job")
    return global_batch // per_round


def micro_positions(consumed: int, batch_size: int, grad_accum: int, world: World) -> list[int]:
    """Global positions of the first sample of each micro-batch `world.rank` takes in the step starting at
    `consumed`, in accumulation order."""
    return [consumed + (k * world.size + world.rank) * batch_size for k in range(grad_accum)]


@dataclass(frozen=True)
class BatchShare:
    """This rank's part of every global batch: which micro-batches, with how many accumulation rounds."""

    world: World
    batch_size: int
    grad_accum: int

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.grad_accum * self.world.size

    def positions(self, consumed: int) -> list[int]:
        return micro_positions(consumed, self.batch_size, self.grad_accum, self.world)


def draw_seeds(seed: int, step: int, position: int) -> tuple[int, int]:
    """Two independent 63-bit seeds for the micro-batch at global `position` in optimizer step `step`."""
    a, b = np.random.SeedSequence([seed, step, position]).generate_state(2, dtype=np.uint64)
    return int(a >> np.uint64(1)), int(b >> np.uint64(1))


def seed_micro_batch(seed: int, step: int, position: int) -> torch.Generator:
    """Seed torch's global RNG (dropout, on the CPU and every GPU) for this micro-batch and return the
    generator its family draws noise and timesteps from; both depend on the position only, never on the rank."""
    global_seed, draw_seed = draw_seeds(seed, step, position)
    torch.manual_seed(global_seed)
    g = torch.Generator()
    g.manual_seed(draw_seed)
    return g


def ranks_disagree(every: list[dict[str, str]]) -> str | None:
    """One line naming what differs between the ranks (lorad version, job settings), or None."""
    for key, what in (("version", "lorad version"), ("config_hash", "job settings (config hash)")):
        values = {r[key] for r in every}
        if len(values) > 1:
            where = ", ".join(f"rank {i} on {r['host']}: {r[key]}" for i, r in enumerate(every))
            return (f"the processes of this job run different {what} ({where}); install the same lorad and use the "
                    "same job file on every node")
    return None


def sample_log(pick, world: World):
    """`pick` (seed, position, count) -> dataset indices, recording each micro-batch's indices when the
    LORAD_DEBUG_SAMPLE_LOG environment variable names a file prefix (tests: which rank took which samples)."""
    prefix = os.environ.get("LORAD_DEBUG_SAMPLE_LOG")
    if not prefix:
        return pick

    def logged(seed: int, position: int, count: int) -> list[int]:
        ids = pick(seed, position, count)
        with open(f"{prefix}.rank-{world.rank}.jsonl", "a", encoding="utf-8") as f:
            f.write(json.dumps({"position": position, "ids": [int(i) for i in ids]}) + "\n")
        return ids

    return logged


def ignore_frozen(model: torch.nn.Module) -> list[str]:
    """Mark every frozen parameter and every buffer for DDP to ignore; return their names.

    Every rank loads the same frozen base from the same files, so DDP's start-up broadcast of it is wasted
    (the whole base over NCCL), and with block swapping it is refused outright: DDP wants all the parameters
    it manages on one device type, and swapped blocks keep theirs in host memory. The buffers belong to that
    base too (FP8Linear.weight_scale, RoPE tables; a LoRA adds none) and nothing in training changes them, yet
    DDP would broadcast them from rank 0 before every synced forward (broadcast_buffers): about 12 MB per step
    for FLUX.1 in fp8. The trainable adapter is still broadcast from rank 0 and all-reduced every step."""
    names = [n for n, p in model.named_parameters() if not p.requires_grad]
    names += [n for n, _ in model.named_buffers()]
    model._ddp_params_and_buffers_to_ignore = names
    return names


class NcclMissing(JobInvalid):
    """A multi-process job on GPUs with a torch built without NCCL: no retry can help (exit 65)."""


class Ranks:
    """The process group of one job: nothing to do on one process, accelerate's DDP on several.

    accelerate sets up torch.distributed from torchrun's environment (NCCL on GPUs, gloo on the CPU) and wraps
    the model in DistributedDataParallel. We use it for that and for no_sync; its save_state/load_state are not
    used (they keep per-rank RNG files tied to the world size and no data position: see the module docstring).
    """

    def __init__(self, world: World, accelerator: Any = None, sharded: bool = False):
        self.world = world
        self._acc = accelerator
        self.sharded = sharded  # train.sharding: fsdp (engine/distributed/fsdp.py) on several processes

    @classmethod
    def start(cls, world: World | None = None, sharding: str = "ddp") -> Ranks:
        world = world or world_from_env()
        if world.size == 1:
            return cls(world)
        if torch.cuda.is_available() and not torch.distributed.is_nccl_available():
            raise NcclMissing("this torch has no NCCL, which GPUs need to train one job on several processes: install "
                              "a CUDA build of torch (pip install torch from the CUDA index), or set resources.gpus: 1")
        from accelerate import Accelerator
        from accelerate.utils import DistributedDataParallelKwargs

        # LoRA trains every adapter parameter each step: no unused-parameter search (it costs a graph walk).
        # cpu=True on a machine without CUDA: accelerate's only way to take the gloo path (MULTI_CPU) under torchrun.
        acc = Accelerator(cpu=not torch.cuda.is_available(),
                          kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=False)])
        return cls(world, acc, sharded=sharding == "fsdp")

    @property
    def is_main(self) -> bool:
        return self.world.is_main

    def device(self, default: torch.device) -> torch.device:
        return self._acc.device if self._acc is not None else default

    def shard(self, model: torch.nn.Module) -> int | None:
        """train.sharding: fsdp on several processes: shard the model in place (before the optimizer is built);
        the number of blocks sharded, None when not sharded."""
        if not self.sharded:
            return None
        from engine.distributed.fsdp import shard_model

        return shard_model(model)

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """The model the forward and backward go through: DDP-wrapped on several processes (FSDP: as sharded).

        The family has already placed the model (engine/frozen_base/blockswap.place_model keeps swapped blocks'
        frozen weights in host memory), so accelerate must not move it: its device placement would put every
        swapped block on every GPU. DDP is told to leave the frozen base alone (see ignore_frozen)."""
        if self._acc is None or self.sharded:
            return model
        ignore_frozen(model)
        return self._acc.prepare_model(model, device_placement=False)

    def no_sync(self, model: torch.nn.Module, last_round: bool):
        """Skip DDP's gradient all-reduce on every accumulation round but the last. FSDP reduce-scatters every
        round: skipping it would keep whole gradients on each rank, the memory sharding is there to save."""
        if self._acc is None or last_round or self.sharded:
            return nullcontext()
        return self._acc.no_sync(model)

    def share(self, value: Any) -> Any:
        """Rank 0's `value` on every rank."""
        if self._acc is None:
            return value
        box = [value]
        torch.distributed.broadcast_object_list(box, src=0)
        return box[0]

    def agree(self, *flags: bool) -> tuple[bool, ...]:
        """Each flag true on any rank → true on every rank (one all-reduce): decisions at a step boundary."""
        if self._acc is None:
            return tuple(flags)
        t = torch.tensor([int(f) for f in flags], dtype=torch.int32, device=self._acc.device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        return tuple(bool(v) for v in t.tolist())

    def mean(self, value: float) -> float:
        """The mean of `value` over the ranks (the step's loss over the whole global batch)."""
        if self._acc is None:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=self._acc.device)
        torch.distributed.all_reduce(t)
        return float(t) / self.world.size

    def sum(self, *values: float) -> tuple[float, ...]:
        """Each value summed over the ranks (one all-reduce): the validation loss over every rank's batches."""
        if self._acc is None:
            return tuple(values)
        t = torch.tensor(values, dtype=torch.float64, device=self._acc.device)
        torch.distributed.all_reduce(t)
        return tuple(t.tolist())

    def check_same_job(self, version: str, config_hash: str) -> None:
        """Refuse to train when the ranks run different lorad versions or different job settings (a node with
        another install or another copy of the job file): they would compute different things in lock-step."""
        if self._acc is None:
            return
        import socket

        mine = {"host": socket.gethostname(), "version": version, "config_hash": config_hash}
        every: list[Any] = [None] * self.world.size
        torch.distributed.all_gather_object(every, mine)
        if (why := ranks_disagree(every)) is not None:
            raise JobInvalid(why)

    def check_shared_dir(self, workdir: Path) -> None:
        """Refuse a job directory the ranks do not share: rank 0 alone writes checkpoints, and every rank (on every
        machine) must load them. Rank 0 writes a probe file; each rank reads it back."""
        if self._acc is None:
            return
        import socket
        import uuid

        probe = Path(workdir) / f".lorad-shared-{os.getpid()}"  # distinct per launch; removed below
        names = [uuid.uuid4().hex if self.is_main else None, str(probe)]
        torch.distributed.broadcast_object_list(names, src=0)
        token, probe = names[0], Path(names[1])
        if self.is_main:
            probe.write_text(token)
        self.barrier()
        try:
            seen = probe.read_text() == token
        except OSError:
            seen = False
        every: list[Any] = [None] * self.world.size
        torch.distributed.all_gather_object(every, (seen, socket.gethostname()))
        self.barrier()
        if self.is_main:
            probe.unlink(missing_ok=True)
        blind = [f"rank {i} on {host}" for i, (ok, host) in enumerate(every) if not ok]
        if blind:
            raise JobInvalid(f"the job directory {workdir} is not shared: {', '.join(blind)} cannot read what rank 0 "
                             "writes there; put jobs on storage every node mounts at the same path (NFS, ...)")

    def barrier(self) -> None:
        if self._acc is not None:
            self._acc.wait_for_everyone()

    @contextmanager
    def main_first(self) -> Iterator[None]:
        """Rank 0 does the body first (one-off work on shared files: caches, set-aside checkpoints), then the rest."""
        if not self.is_main:
            self.barrier()
        yield
        if self.is_main:
            self.barrier()


def leave_process_group(code: int) -> None:
    """End a rank of a distributed run that is done, with `code`, so that the code is what the launcher sees.

    Left to interpreter shutdown, gloo's worker threads can still hold tensors while the interpreter is torn
    down, and the rank aborts instead ("terminate called without an active exception", SIGABRT: 5 exits in 30
    of a two-rank gloo script that skipped this, 0 in 30 with it; pytorch#190489): a finished job became a
    crash of rank 1, which CI saw. A clean end (0, 75: every rank past the last barrier) shuts the group down.
    A failed rank may leave another waiting inside a collective, where shutting down could block: it skips
    interpreter shutdown instead, its verdict (65, 69, 74) kept; the launcher stops the others.
    """
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return
    if code in (EXIT_OK, EXIT_STOPPED):
        torch.distributed.destroy_process_group()
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
