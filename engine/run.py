"""The training recipe: config → model → LoRA → optimizer → resume → loop (step, log, save, stop).

    python -m engine.run --job jobs/ID/job.yaml --workdir jobs/ID

is exactly how the daemon starts a trainer; `lorad run` calls `train()` in the
foreground with a progress bar. Running it again after any interruption
resumes from the newest checkpoint that verifies.

Exit codes: 0 finished, 65 invalid job, 74 disk full / unwritable, 75 stopped
cleanly after a checkpoint (resumable), anything else is a crash.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.checkpoint.cadence import SLOW_SAVE, Save, SaveCadence
from engine.checkpoint.host_copy import to_host
from engine.checkpoint.store import AsyncCheckpointer, CheckpointStore, SaveResult, Snapshot
from engine.config import policy as job_policy
from engine.config.job import JobConfig, load_job
from engine.data.order import Cursor
from engine.distributed.ddp import (
    BatchShare,
    Ranks,
    die_with_parent,
    plan_grad_accum,
    sample_log,
    seed_micro_batch,
    world_from_env,
)
from engine.distributed.fsdp import (
    ShardedCheckpointer,
    adapter_swapped_in,
    gather_adapter,
    load_shards,
    rng_snapshot,
)
from engine.distributed.liveness import Liveness
from engine.errors import ConfigMismatch, DiskError, JobInvalid
from engine.families import get_family
from engine.families.base import Family, hub_refusal
from engine.families.image.sample import sample_due
from engine.frozen_base.prefetch import Prefetcher
from engine.frozen_base.speedups import apply_train_speedups
from engine.report.events import EventLog
from engine.report.progress import make_progress
from engine.report.quiet import quiet_libraries, warnings_to_events
from engine.report.tensorboard import TrainingBoard
from engine.report.tensorboard import available as tensorboard_available
from engine.storage.fsio import FileLayer, RealFs, ensure_dir_durable, is_disk_full, normal_file_mode
from engine.training.adapters import compute_autocast
from engine.training.dtypes import pick_device
from engine.training.ema import AdapterEMA
from engine.training.heldout import due as validation_due
from engine.training.heldout import evaluate
from engine.training.lr_schedule import LrPlan, resume_plan
from engine.training.optim import (
    build_optimizer,
    eval_weights,
    join_tree,
    load_optimizer_state,
    optimizer_advice,
    optimizer_state,
    split_tree,
    use_eval_weights,
)
from engine.training.rng import capture, restore, seed_everything
from engine.training.stop import EXIT_INVALID, EXIT_IO, EXIT_OK, EXIT_STOPPED, StopFlag


def _version() -> str:
    try:
        return importlib.metadata.version("lorad")
    except importlib.metadata.PackageNotFoundError:
        return "0+source"  # a source tree that was never installed


VERSION = _version()


def peak_memory_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def trainable(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def snapshot(step: int, params, optimizer, generator, state: dict[str, Any], ema: AdapterEMA | None = None) -> Snapshot:
    """Host copies at a step boundary (on a GPU still landing: `ready`); the background writer serialises them."""
    opt_tensors: dict[str, torch.Tensor] = {}
    tree = split_tree(optimizer_state(optimizer), "", opt_tensors)
    (adapter, opt_tensors, ema_tensors), ready = to_host([dict(params), opt_tensors,
                                                          dict(ema.shadow or {}) if ema is not None else {}])
    rng_meta, rng_tensors = capture(generator)
    return Snapshot(step, adapter, opt_tensors, tree, rng_tensors, {**state, "rng": rng_meta},
                    extra={"ema": ema_tensors} if ema is not None else {}, ready=ready)


def restore_checkpoint(loaded, params, optimizer, generator, log=None, ema: AdapterEMA | None = None) -> dict[str, Any]:
    """Everything but a sharded checkpoint's shards, which every rank loads together after (engine/distributed/fsdp.py)."""
    if loaded.shards is None:
        missing = set(params) ^ set(loaded.adapter)
        if missing:
            raise JobInvalid(f"checkpoint {loaded.path.name} does not match the model's LoRA parameters: "
                             f"{sorted(missing)[:3]}")
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(loaded.adapter[n])
        load_optimizer_state(optimizer, join_tree(loaded.optimizer_tree, loaded.optimizer_tensors))
    if ema is not None:
        ema.load(loaded.extra.get("ema", {}))
    warning = restore(loaded.state["rng"], loaded.rng_tensors, generator)
    if warning and log is not None:
        log.warning("rng_mismatch", message=warning)
    return loaded.state


OUTPUT_STAMP = "lorad-output.json"  # in output/: the step and settings the adapter was exported from


def output_step(workdir: Path, cfg: JobConfig) -> int | None:
    """The step output/ holds, if it was exported from this job's settings; None if absent, foreign or unreadable."""
    try:
        stamp = json.loads((workdir / "output" / OUTPUT_STAMP).read_text())
        return int(stamp["step"]) if stamp.get("config_hash") == cfg.identity_hash() else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def export_output(family, model, cfg: JobConfig, workdir: Path, fs: FileLayer, meta: dict[str, Any], log,
                  ema: AdapterEMA | None = None) -> Path:
    """Write the final adapter to output.tmp-*, make it durable, and rename it to output/.

    output/ gets a stamp with the step it holds, so that a run whose `steps` was raised after the job
    finished, and that died between its final checkpoint and its export, exports again instead of
    calling the older adapter done.
    """
    out = workdir / "output"
    # Leftovers of exports killed half-way (one trainer per job directory, so none is in use).
    for stale in workdir.glob("output.tmp-*"):
        fs.rmtree(stale)
    tmp = workdir / f"output.tmp-{os.getpid()}"
    fs.mkdir(tmp)
    raw = []
    if ema is not None and cfg.train.ema.export_raw:
        fs.mkdir(tmp / "raw")
        raw = [f"raw/{n}" for n in family.export(model, cfg, tmp / "raw", meta)]
    with ema.swapped_in() if ema is not None else nullcontext():  # train.ema: the average is the output
        names = family.export(model, cfg, tmp, meta)
    fs.write(tmp / OUTPUT_STAMP, [json.dumps({"step": meta["steps"], "config_hash": cfg.identity_hash(),
                                              "files": sorted(names)}).encode()])
    names = [*names, *raw, OUTPUT_STAMP]
    mode = normal_file_mode()
    for name in names:
        log.info("heartbeat", phase="export", file=name)  # fsyncing a large file on a slow disk takes a while
        if (tmp / name).is_file():
            # safetensors creates its files 0600; the adapter must be as readable as anything else the user
            # writes (the service's group shares job directories through its umask).
            os.chmod(tmp / name, mode)
            fs.fsync(tmp / name)
    if raw:
        fs.fsync_dir(tmp / "raw")
    fs.fsync_dir(tmp)
    if out.exists():
        shutil.rmtree(out)
    fs.rename(tmp, out)
    fs.fsync_dir(workdir)
    return out


def train(
    cfg: JobConfig,
    workdir: Path,
    progress: str = "json",
    fs: FileLayer | None = None,
    stop: StopFlag | None = None,
) -> int:
    """Train (or resume) the job in `workdir`; return the process exit code."""
    fs = fs or RealFs()
    stop = stop or StopFlag()
    workdir = Path(workdir).resolve()
    quiet_libraries()  # before the model libraries are imported: they read their switches then
    try:
        ensure_dir_durable(fs, workdir)
        # One event stream per job, rank 0's: the other ranks train the same steps; their errors go to stderr. The
        # first rank of each machine prints the heartbeats too, for the daemon that supervises that machine's part.
        world = world_from_env()
        log = EventLog(workdir / "events.jsonl" if world.is_main else None,
                       to_stdout=(progress == "json" and world.local_rank == 0), job=cfg.name)
    except OSError as e:
        # No events file to write to yet: the one line on stderr is the whole report.
        _say(f"lorad: cannot create the job directory {workdir} ({e.strerror or e})")
        return EXIT_IO
    try:
        if progress == "json":  # a daemon child: real library warnings stay on stderr, i.e. in trainer.log
            return _train(cfg, workdir, progress, fs, stop, log)
        with warnings_to_events(log):  # a terminal: lorad's own lines only
            return _train(cfg, workdir, progress, fs, stop, log)
    except JobInvalid as e:
        log.error("invalid_job", message=str(e))
        _say(f"lorad: invalid job: {e}")
        return EXIT_INVALID
    except ConfigMismatch as e:
        log.error("invalid_job", message=str(e))
        _say(f"lorad: {e}")
        return EXIT_INVALID
    except DiskError as e:
        log.error("disk_error", message=str(e))
        _say(f"lorad: {e}")
        return EXIT_IO
    except OSError as e:
        if is_disk_full(e):  # outside the checkpoint writer: the latent cache, sample images, the export
            msg = (f"disk full ({e.filename or workdir}); committed checkpoints are intact — free space and run "
                   "again")
            log.error("disk_error", message=msg)
            _say(f"lorad: {msg}")
            return EXIT_IO
        if (why := hub_refusal(e, cfg)) is None:
            raise
        log.error("invalid_job", message=why)
        _say(f"lorad: invalid job: {why}")
        return EXIT_INVALID
    finally:
        log.close()


def _say(line: str) -> None:
    """A line for the person at the terminal (`lorad run`); under the daemon it lands in trainer.log."""
    print(line, file=sys.stderr, flush=True)


@dataclass
class Position:
    """Where training stands: what a checkpoint records besides the weights, the optimizer and the RNGs."""

    step: int = 0
    consumed: int = 0  # samples drawn, over all epochs: the data order's cursor
    train_seconds: float = 0.0
    lr_plan: LrPlan | None = None  # None: the schedule of train.steps (engine/training/lr_schedule.py)
    shards: Path | None = None  # resumed from a sharded checkpoint: its shards, still to be loaded by every rank

    def lr(self, cfg: JobConfig) -> float:
        return (self.lr_plan or LrPlan.fresh(cfg.train)).lr_at(self.step, cfg.train)

    def state(self, dataset_size: int, cfg: JobConfig) -> dict[str, Any]:
        c = Cursor(self.consumed, dataset_size)
        return {"step": self.step, "samples_consumed": self.consumed, "epoch": c.epoch, "position": c.position,
                "dataset_size": dataset_size, "train_seconds": self.train_seconds,
                "config_hash": cfg.identity_hash(),
                "lr_plan": (self.lr_plan or LrPlan.fresh(cfg.train)).to_state()}


def _train(cfg: JobConfig, workdir: Path, progress: str, fs: FileLayer, stop: StopFlag, log: EventLog) -> int:
    t_start = time.monotonic()
    world = world_from_env()  # torchrun's; one process without it
    # Before any rank waits on another: a global batch this world size cannot keep is refused at once (exit 65).
    share = BatchShare(world, cfg.train.batch_size, plan_grad_accum(cfg.global_batch(), cfg.train.batch_size, world.size))
    sharded = cfg.train.sharding == "fsdp"  # checkpoints in shards (DCP), on any number of processes
    ranks = Ranks.start(world, cfg.train.sharding)
    ranks.check_same_job(VERSION, cfg.identity_hash())
    ranks.check_shared_dir(workdir)
    device = ranks.device(pick_device())
    family = get_family(cfg.model.family)
    log.info("start", version=VERSION, pid=os.getpid(), device=str(device), family=cfg.model.family,
             steps=cfg.train.steps, config_hash=cfg.identity_hash(), processes=world.size,
             global_batch=share.global_batch, grad_accum=share.grad_accum)
    if world.size != cfg.processes():
        log.warning("world_size", processes=world.size, written_for=cfg.processes(), grad_accum=share.grad_accum,
                    message=f"running on {world.size} process(es), the job is written for {cfg.processes()} "
                            f"(resources.gpus × resources.nodes): grad_accum is {share.grad_accum} to keep the "
                            f"global batch {share.global_batch}")
    for key, use in cfg.deprecated_keys():
        log.warning("deprecated_key", key=key, use=use, message=f"{key} is deprecated: write {use} instead")
        _say(f"lorad: warning: {key} is deprecated: write {use} instead")

    # -- data
    log.info("phase", phase="prepare")
    with ranks.main_first():  # one-off work on shared files (caches, built-in models): rank 0 first, then the rest
        family.prepare(cfg, workdir, log)
    dataset = family.build_dataset(cfg, workdir, log)
    validation = family.validation_set(cfg, workdir, log) if cfg.data.validation is not None else None
    generator = seed_everything(cfg.train.seed)

    # -- model and optimizer
    log.info("phase", phase="load_model")
    model = family.load_model(cfg, workdir, device, log)
    apply_train_speedups(model, cfg.train, device, log)  # blocks_to_swap, compile
    if (blocks := ranks.shard(model)) is not None:  # fsdp: before the optimizer, which must hold the shards
        log.info("sharded", blocks=blocks, processes=world.size)
    params = trainable(model)
    optimizer = build_optimizer(list(params.values()), cfg.train)
    ema = AdapterEMA(params, **cfg.train.ema.model_dump(exclude={"export_raw"})) if cfg.train.ema else None
    if (advice := optimizer_advice(cfg.train)) is not None:
        log.warning("optimizer_advice", message=advice)
        _say(f"lorad: warning: {advice}")

    # -- resume
    store = CheckpointStore(workdir / "checkpoints", cfg.identity_hash(), cfg.checkpoint.keep, fs, cfg.identity())
    with ranks.main_first():  # rank 0 sets invalid checkpoints aside; the others then find the same newest valid one
        at = resume(store, params, optimizer, generator, len(dataset), cfg, log, progress, t_start, ema, ranks.is_main)
    if at.shards is not None:  # every rank reads its part together, resharded to this world size
        load_shards(model, optimizer, at.shards)
    if at.step >= cfg.train.steps and output_step(workdir, cfg) == at.step:
        log.info("done", step=at.step, output=str(workdir / "output"), already=True)
        return EXIT_OK

    # -- loop: step, log, save, stop
    ddp_model = ranks.wrap(model)  # after the restore: DDP starts from rank 0's (identical) weights
    board = None  # rank 0 alone writes
    if ranks.is_main and (cfg.logging.tensorboard or (cfg.logging.tensorboard is None and tensorboard_available())):
        board = TrainingBoard(workdir / "tb", at.step)  # a resumed attempt hides what the last one wrote after it
    saver = ShardedCheckpointer(store, ranks, model, optimizer) if sharded else AsyncCheckpointer(store)
    cadence = SaveCadence(cfg.checkpoint.every_steps, cfg.checkpoint.every_seconds, last_step=cfg.train.steps,
                          saved_step=at.step, now=time.monotonic())
    bar = make_progress(progress, total=cfg.train.steps, start=at.step)
    seed, micro = cfg.train.seed, cfg.train.batch_size
    # On a GPU the batch at the next cursor is built and copied on a side stream while this step's kernels run;
    # on the CPU a passthrough.
    pick = sample_log(dataset.indices_at, world)
    batches = Prefetcher(lambda cursor: dataset.collate(pick(seed, cursor, micro)), device)

    def checkpoint() -> Snapshot:
        if sharded:  # adapter and optimizer go to the shards every rank writes
            return rng_snapshot(at.step, generator, at.state(len(dataset), cfg))
        return snapshot(at.step, params, optimizer, generator, at.state(len(dataset), cfg), ema)

    step_times: list[float] = []
    model.train()
    try:
        # Every rank takes the same decision at every step boundary; a stop asked for during the last step's samples
        # or save is seen here, before another step.
        while at.step < cfg.train.steps and not ranks.agree(stop.requested)[0]:
            t0 = time.monotonic()
            loss, lr, grad_norm = train_step(family, ddp_model, optimizer, params, batches, at, cfg, share, ranks)
            at.step += 1
            if ema is not None:
                ema.update(at.step)
            step_times.append(time.monotonic() - t0)
            at.train_seconds += step_times[-1]
            s_per_step = statistics.median_high(step_times[-20:])
            log.info("step", step=at.step, total=cfg.train.steps, loss=round(loss, 6), lr=lr,
                     s_per_step=round(s_per_step, 4), eta_s=round(s_per_step * (cfg.train.steps - at.step), 1),
                     samples=at.consumed)
            bar.update(at.step, loss, s_per_step)
            if board is not None:
                board.step(at.step, **{"train/loss": loss, "train/lr": lr,
                                       "train/grad_norm": None if grad_norm is None else float(grad_norm),
                                       "perf/s_per_step": s_per_step, "perf/peak_memory_gib": peak_memory_gib(device)})
            if validation is not None and validation_due(cfg.data.validation.every_steps, at.step):
                # Every rank evaluates its share, before the stop decision: a step that is checkpointed has its value.
                with eval_weights(optimizer, params), ema.swapped_in() if ema is not None else nullcontext():
                    val_loss, n = evaluate(family, model, validation, cfg, device, ranks, log, at.step)
                log.info("validation", step=at.step, loss=val_loss, batches=n)
                if board is not None:
                    board.step(at.step, **{"validation/loss": val_loss})
            stopping, urgent = ranks.agree(stop.requested, stop.take_save_request())
            if not ranks.is_main and not saver.collective:  # rank 0 alone renders samples and writes checkpoints
                continue
            if not stopping and ranks.is_main:  # rendering samples could outlast the stop grace period: checkpoint first
                samples = sample_due(cfg, at.step)
                if samples and at.step > cadence.saved_step:
                    # Committed before the samples render: a render that is killed (a hang, an OOM) never costs
                    # the step, and the retry goes on past it.
                    record_saves(saver.wait(), cadence, store, log, board)
                    if at.step > cadence.saved_step:
                        saver.submit(checkpoint())
                        cadence.started(time.monotonic())
                        record_saves(saver.wait(), cadence, store, log, board)
                with eval_weights(optimizer, params) if samples else nullcontext(), \
                        ema.swapped_in() if ema is not None and samples else nullcontext():
                    family.on_step_end(model, at.step, cfg, workdir, log)
                if board is not None and samples:
                    board.images(at.step, sorted((workdir / "samples" / f"step-{at.step:08d}").glob("*.png")))

            save_if_due(at.step, urgent, saver, cadence, checkpoint, log, board)

        # -- final or stop checkpoint, written synchronously by rank 0; no rank exits before it is committed
        record_saves(saver.wait(), cadence, store, log, board)
        if at.step > cadence.saved_step and (ranks.is_main or saver.collective):
            log.info("phase", phase="final_checkpoint", step=at.step)
            saver.submit(checkpoint())
            record_saves(saver.wait(), cadence, store, log, board)
        ranks.barrier()
    finally:
        bar.close()
        if board is not None:
            board.close()
        # Never leave a writer thread behind on an exception.
        if saver.busy():
            saver.wait()

    if at.step < cfg.train.steps:
        log.info("stopped", step=at.step, reason=stop.reason or "another rank was stopped", checkpoint=cadence.saved_step)
        return EXIT_STOPPED
    whole = gather_adapter(model) if ranks.sharded else {}  # every rank takes part; rank 0 receives it
    if not ranks.is_main:
        ranks.barrier()  # while rank 0 exports
        return EXIT_OK

    meta = {"steps": at.step, "lorad_version": VERSION, "base_model": cfg.model.path, "rank": cfg.lora.rank,
            "alpha": cfg.lora.alpha, "config_hash": cfg.identity_hash()}
    use_eval_weights(optimizer)  # schedule-free: export the averaged weights, not the training iterate
    try:
        with adapter_swapped_in(model, whole):  # fsdp: the whole adapter, not rank 0's shard
            out = export_output(family, model, cfg, workdir, fs, meta, log, ema)
    except OSError as e:
        if is_disk_full(e):
            raise DiskError(f"disk full while writing the final adapter to {workdir / 'output'}; "
                            f"checkpoint step-{at.step:08d} is committed, free space and run again") from None
        raise
    log.info("done", step=at.step, output=str(out), train_seconds=round(at.train_seconds, 2))
    ranks.barrier()
    return EXIT_OK


def resume(store: CheckpointStore, params, optimizer, generator, dataset_size: int, cfg: JobConfig, log,
           progress: str, t_start: float, ema: AdapterEMA | None = None, set_aside_invalid: bool = True) -> Position:
    """Load the newest checkpoint that verifies into the parameters, optimizer and generator; where to go on from."""
    loaded, skipped = store.load_latest(set_aside_invalid)
    for s in skipped:
        log.warning("checkpoint_skipped", checkpoint=s.name, reason=s.reason)
        # Also on stderr: `lorad run` shows a progress bar, not the event stream, and a skipped save must be seen.
        _say(f"lorad: warning: skipped checkpoint {s.name}: {s.reason}")
    if loaded is None:
        return Position()
    state = restore_checkpoint(loaded, params, optimizer, generator, log, ema)
    at = Position(state["step"], state["samples_consumed"], state.get("train_seconds", 0.0), shards=loaded.shards)
    at.lr_plan, replanned = resume_plan(state, at.step, cfg.train)
    if replanned is not None:
        log.warning("lr_replanned", message=replanned)
        _say(f"lorad: warning: {replanned}")
    if state.get("dataset_size") != dataset_size:
        log.warning("dataset_changed", was=state.get("dataset_size"), now=dataset_size,
                    message="the dataset changed since this checkpoint; the order continues by sample count")
    log.info("resumed", from_step=at.step, checkpoint=loaded.path.name, skipped=[s.name for s in skipped],
             seconds_since_start=round(time.monotonic() - t_start, 3))
    if progress != "json" and at.step < cfg.train.steps:  # `lorad run`: said when it happens, not after
        _say(f"lorad: resumed job {cfg.name} from step {at.step} (checkpoint {loaded.path.name})")
    return at


def train_step(family: Family, model, optimizer, params, batches: Prefetcher, at: Position, cfg: JobConfig,
               share: BatchShare, ranks: Ranks) -> tuple[float, float, torch.Tensor | None]:
    """One optimizer step over this rank's micro-batches of the global batch at `at.consumed` (advanced past it).

    Returns (loss over the whole global batch, lr, grad norm before clipping — None without train.max_grad_norm —
    still on the device)."""
    train = cfg.train
    lr = at.lr(cfg)
    for g in optimizer.param_groups:
        g["lr"] = lr
    loss_sum = None  # on the device: read once per optimizer step, never per micro-batch (a host sync)
    mine = share.positions(at.consumed)
    for k, pos in enumerate(mine):
        batch = batches.get(pos)
        # Draws keyed by the micro-batch's global position: the same dropout and noise on any world size.
        with ranks.no_sync(model, last_round=k == len(mine) - 1):  # DDP all-reduces on the last round only
            with compute_autocast(cfg.model.dtype, cfg.lora.dtype, batches.device):
                loss = family.loss(model, batch, seed_micro_batch(train.seed, at.step, pos)) / share.grad_accum
            loss.backward()
        # The next batch is collated and copied while the GPU works.
        batches.prefetch(mine[k + 1] if k + 1 < len(mine) else share.positions(at.consumed + share.global_batch)[0])
        part = loss.detach().double()  # summed in double, as float() and Python's sum did
        loss_sum = part if loss_sum is None else loss_sum + part
    at.consumed += share.global_batch
    grad_norm = None
    if train.max_grad_norm is not None:
        grad_norm = torch.nn.utils.clip_grad_norm_(list(params.values()), train.max_grad_norm)
        if hasattr(grad_norm, "full_tensor"):  # fsdp: a DTensor; made whole on every rank (a collective)
            grad_norm = grad_norm.full_tensor()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return ranks.mean(float(loss_sum)), lr, grad_norm  # the mean over every rank's share


def save_if_due(step: int, urgent: bool, saver: AsyncCheckpointer | ShardedCheckpointer, cadence: SaveCadence,
                checkpoint: Callable[[], Snapshot], log, board: TrainingBoard | None = None) -> None:
    """After each step: note the saves that landed, start the one the cadence asks for, report a slow one.

    urgent: a "checkpoint now" arrived (SIGUSR1, the UPS is on battery).
    """
    record_saves(saver.poll(), cadence, saver.store, log, board)
    if urgent and step > cadence.saved_step:  # a step committed for its samples needs no second save
        cadence.urgent()
    now = time.monotonic()
    due = cadence.due(step, now, writing=saver.busy())
    if saver.collective:  # a sharded save: every rank writes, at the step rank 0's cadence picks
        due = saver.agreed(due)
    if due is Save.URGENT:  # the save in flight lands first: one save at a time
        record_saves(saver.wait(), cadence, saver.store, log, board)
        log.info("phase", phase="urgent_checkpoint", step=step)
    if due is not None:
        saver.submit(checkpoint(), background=due is Save.PERIODIC)
        cadence.started(time.monotonic())
    elif (late := cadence.slow(saver.in_flight_step if saver.busy() else None, saver.started, now)) is not None:
        log.warning("checkpoint_slow", step=saver.in_flight_step, seconds=round(late, 1), message=SLOW_SAVE)


def record_saves(results: list[SaveResult], cadence: SaveCadence, store: CheckpointStore, log,
                 board: TrainingBoard | None = None) -> None:
    """Tell the cadence, the log and TensorBoard about saves that landed; a failed save ends the run (DiskError).

    TensorBoard is flushed at each commit, so what a kill can lose of it is past the checkpoint anyway."""
    for r in results:
        if r.error is not None:
            _raise_save_error(r, store)
        cadence.saved(r.step, r.seconds)
        log.info("checkpoint_committed", step=r.step, path=str(r.path), seconds=round(r.seconds, 4))
        if board is not None:
            board.flush()


def _raise_save_error(r, store: CheckpointStore) -> None:
    e = r.error
    if isinstance(e, OSError):
        prev = [p.name for _, p in store.steps()]
        kept = f"the previous checkpoint {prev[0]} is intact" if prev else "no earlier checkpoint exists"
        free = ""
        try:
            st = os.statvfs(store.root)
            free = f" ({st.f_bavail * st.f_frsize // (1 << 20)} MiB free)"
        except OSError:
            pass
        what = "disk full" if is_disk_full(e) else f"cannot write ({e.strerror or e})"
        raise DiskError(f"{what} while saving checkpoint step-{r.step:08d} in {store.root}{free}; {kept}") from None
    raise e


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m engine.run", description="Run one lorad training job (resumes by itself).")
    ap.add_argument("--job", required=True, help="job YAML file")
    ap.add_argument("--workdir", required=True, help="the job's directory (checkpoints/, output/, events.jsonl)")
    ap.add_argument("--progress", choices=["json", "bar", "none"], default="json")
    job_policy.add_arguments(ap)
    args = ap.parse_args(argv)
    die_with_parent()  # a rank started by engine.launch: no orphan if the launcher is killed
    alive = Liveness.from_env()  # the daemon's: this rank's sign of life, even while it waits for the others
    if alive is not None:
        alive.start()
    stop = StopFlag()
    stop.install()
    try:
        # The daemon's policy, from our argv (which no one but the daemon set), over the job.yaml on disk now.
        cfg = load_job(args.job, policy=job_policy.from_args(args))
    except JobInvalid as e:
        _say(f"lorad: invalid job: {e}")
        return EXIT_INVALID
    try:
        return train(cfg, Path(args.workdir), progress=args.progress, stop=stop)
    finally:
        if alive is not None:
            alive.stop()  # a rank done before the others (rank 0 still exporting) is not a silent one


if __name__ == "__main__":
    sys.exit(main())
