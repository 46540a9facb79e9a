"""train.sharding: fsdp — the base and the adapter sharded over the ranks (FSDP2), for a base too big for one GPU.

- Sharding: torch.distributed.fsdp.fully_shard on every transformer block (the classes the model names in
  `_no_split_modules`, transformers' and diffusers' units to keep whole), then on the whole model. The process
  group is accelerate's (engine/distributed/ddp.py); fully_shard is called directly, after peft has wrapped the
  model and before the optimizer is built, because accelerate's FSDP2 path prepares the model and the
  optimizer together, which our order (load, shard, optimizer, restore) does not fit.
- Checkpoints: every rank writes its shard of the adapter and of the optimizer state with
  torch.distributed.checkpoint (DCP, which fsyncs each file) into the checkpoint's temporary directory
  (`shards/`); after a barrier rank 0 adds rng and state, writes the manifest with the checksum of every shard
  and renames the directory (engine/checkpoint/store.py). A save torn by a kill is a temporary directory without a
  manifest: never loaded.
- Resume: DCP reshards at load time, so a checkpoint written by 2 ranks loads on 1 or on 4. On one process
  nothing is sharded (there is nothing to shard over), but checkpoints keep this format, so the job can go back
  to more processes.
- Saves are synchronous: every rank takes part, at the step rank 0's cadence picks. A LoRA adapter and its
  optimizer state are small beside the base; the base is never saved.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch

from engine.checkpoint.cadence import Save
from engine.checkpoint.store import SHARDS, CheckpointStore, Snapshot, step_dir_name
from engine.checkpoint.writer import SaveResult
from engine.training.rng import capture


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def shard_model(model: torch.nn.Module) -> int:
    """fully_shard every block, then the model; the number of blocks sharded on their own."""
    from torch.distributed.fsdp import fully_shard

    kinds: set[str] = set()
    for m in model.modules():
        kinds.update(getattr(m, "_no_split_modules", None) or ())
    blocks = [m for m in model.modules() if type(m).__name__ in kinds]
    for b in reversed(blocks):  # inner blocks first: a block sharded later must not take a sharded one's parameters
        fully_shard(b)
    fully_shard(model)
    return len(blocks)


def _state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The adapter (the base is frozen: never saved) and the optimizer state, keyed by parameter name, as this rank
    holds them (sharded tensors under fsdp)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    adapter, optim = get_state_dict(model, optimizer, options=StateDictOptions(ignore_frozen_params=True))
    return {"adapter": adapter, "optimizer": optim}


def save_shards(model: torch.nn.Module, optimizer: torch.optim.Optimizer, dest: Path) -> None:
    """Every rank writes its shards into `dest` (a collective)."""
    import torch.distributed.checkpoint as dcp

    dcp.save(_state(model, optimizer), checkpoint_id=dest, no_dist=not _distributed())


def load_shards(model: torch.nn.Module, optimizer: torch.optim.Optimizer, src: Path) -> None:
    """Load the adapter and optimizer state from `src`, resharded to this world size (a collective)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    state = _state(model, optimizer)  # the shapes and placements to load into
    dcp.load(state, checkpoint_id=src, no_dist=not _distributed())  # fails naming any key the shards lack
    # Not strict: the frozen base is not in a checkpoint (it comes from model.path).
    set_state_dict(model, optimizer, model_state_dict=state["adapter"], optim_state_dict=state["optimizer"],
                   options=StateDictOptions(ignore_frozen_params=True, strict=False))


def gather_adapter(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole adapter on rank 0, on the host (empty on the other ranks); every rank must call it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    if not _distributed():
        return {}  # one process: the parameters are whole already
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True,
                                                                ignore_frozen_params=True))


@contextmanager
def adapter_swapped_in(model: torch.nn.Module, whole: dict[str, torch.Tensor]) -> Iterator[None]:
    """The whole adapter tensors in place of this rank's shards while the export reads them (families export
    from the model's own modules); the shards are put back after."""
    swapped = []
    try:
        for name, tensor in whole.items():
            module_name, _, attr = name.rpartition(".")
            owner = model.get_submodule(module_name)
            swapped.append((owner, attr, owner._parameters[attr]))
            owner._parameters[attr] = torch.nn.Parameter(tensor, requires_grad=False)
        yield
    finally:
        for owner, attr, param in reversed(swapped):
            owner._parameters[attr] = param


def rng_snapshot(step: int, generator: torch.Generator, state: dict[str, Any]) -> Snapshot:
    """What rank 0 adds to the shards: the RNGs and the loop's state."""
    rng_meta, rng_tensors = capture(generator)
    return Snapshot(step, {}, {}, None, rng_tensors, {**state, "rng": rng_meta}, sharded=True)


@dataclass
class ShardedCheckpointer:
    """AsyncCheckpointer's interface (engine/checkpoint/writer.py) for sharded saves, which every rank writes, at once."""

    store: CheckpointStore
    ranks: Any  # engine.distributed.ddp.Ranks
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    _done: list[SaveResult] = field(default_factory=list)
    in_flight_step: int | None = None
    started: float = 0.0
    collective: ClassVar[bool] = True  # every rank calls submit, at the same step

    def busy(self) -> bool:
        return False

    def agreed(self, due: Save | None) -> Save | None:
        """Rank 0's decision, on every rank."""
        (take,) = self.ranks.agree(self.ranks.is_main and due is not None)
        return Save.URGENT if take else None

    def submit(self, snap: Snapshot, background: bool = False) -> None:
        t0 = self.started = time.monotonic()
        try:
            # Rank 0 names the temporary directory; every rank writes its shards into it.
            tmp = Path(self.ranks.share(str(self.store.begin(snap.step)) if self.ranks.is_main else None))
            save_shards(self.model, self.optimizer, tmp / SHARDS)
            self.ranks.barrier()  # every shard is written and synced before rank 0 lists them in the manifest
            path = self.store.commit(snap, tmp) if self.ranks.is_main else tmp.with_name(step_dir_name(snap.step))
            self._done.append(SaveResult(snap.step, path, time.monotonic() - t0))
        except BaseException as e:  # reported like the background writer's errors: record_saves raises it
            self._done.append(SaveResult(snap.step, None, time.monotonic() - t0, e))

    def poll(self) -> list[SaveResult]:
        out, self._done = self._done, []
        return out

    def wait(self) -> list[SaveResult]:
        return self.poll()
