"""The training recipe: set up → resume → loop (step, report, samples, save, stop) → final checkpoint → export.

`python -m engine.run` (engine/run.py) is how the daemon starts a trainer, and `lorad run` calls `train()` in the
foreground with a progress bar. Running it again after any interruption resumes from the newest checkpoint that
verifies. Its parts live in their packages (engine/checkpoint/, engine/families/, engine/distributed/ ...): this
module only puts them in order."""

from __future__ import annotations

import os
import statistics
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.checkpoint.cadence import SaveCadence
from engine.checkpoint.exports import CheckpointExports, export_meta
from engine.checkpoint.output import export_output, output_step
from engine.checkpoint.position import Position
from engine.checkpoint.saving import commit_now, record_saves, save_if_due
from engine.checkpoint.state import restore_checkpoint, snapshot
from engine.checkpoint.store import CheckpointStore, Snapshot
from engine.checkpoint.writer import AsyncCheckpointer
from engine.config.job import JobConfig
from engine.distributed.ddp import (
    BatchShare,
    Ranks,
    World,
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
from engine.errors import DiskError, OutOfMemory
from engine.families import get_family
from engine.families.base import Family, hub_refusal
from engine.families.image.sample import sample_due
from engine.frozen_base.prefetch import Prefetcher
from engine.memory_plan.oom import debug_oom, first_line, needed_bytes
from engine.memory_plan.setup import AttemptMemory, MemoryPlan, load_planned, micro_batch, samples_config
from engine.report import failures
from engine.report.events import EventLog
from engine.report.progress import make_progress
from engine.report.quiet import quiet_libraries, warnings_to_events
from engine.report.tensorboard import TrainingBoard
from engine.report.tensorboard import available as tensorboard_available
from engine.storage.fsio import FileLayer, RealFs, ensure_dir_durable, is_disk_full
from engine.training.adapters import compute_autocast, trainable
from engine.training.dtypes import peak_memory_gib, pick_device
from engine.training.ema import AdapterEMA
from engine.training.heldout import due as validation_due
from engine.training.heldout import evaluate
from engine.training.lr_schedule import resume_plan
from engine.training.optim import build_optimizer, eval_weights, optimizer_advice, set_lr, use_eval_weights
from engine.training.rng import seed_everything
from engine.training.stop import EXIT_IO, EXIT_OK, EXIT_STOPPED, StopFlag, debug_pause
from engine.version import lorad_version

VERSION = lorad_version()


def train(cfg: JobConfig, workdir: Path, progress: str = "json", fs: FileLayer | None = None,
          stop: StopFlag | None = None) -> int:
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
        say(f"lorad: cannot create the job directory {workdir} ({e.strerror or e})")
        return EXIT_IO
    try:
        if progress == "json":  # a daemon child: real library warnings stay on stderr, i.e. in trainer.log
            return _train(cfg, workdir, progress, fs, stop, log)
        with warnings_to_events(log):  # a terminal: lorad's own lines only
            return _train(cfg, workdir, progress, fs, stop, log)
    except Exception as e:  # its exit code and one line (engine/report/failures.py); a crash is raised again
        return failures.exit_code(e, log, workdir, progress == "json", lambda err: hub_refusal(err, cfg))
    finally:
        log.close()


def say(line: str) -> None:
    """A line for the person at the terminal (`lorad run`); under the daemon it lands in trainer.log."""
    print(line, file=sys.stderr, flush=True)


def _train(cfg: JobConfig, workdir: Path, progress: str, fs: FileLayer, stop: StopFlag, log: EventLog) -> int:
    t_start = time.monotonic()
    run = set_up(cfg, workdir, fs, log)
    with run.ranks.main_first():  # rank 0 sets invalid checkpoints aside; the others then find the same newest one
        at = resume(run, cfg, log, progress, t_start)
    if at.shards is not None:  # every rank reads its part together, resharded to this world size
        load_shards(run.model, run.optimizer, at.shards)
    if at.step >= cfg.train.steps and output_step(workdir, cfg) == at.step:
        log.info("done", step=at.step, output=str(workdir / "output"), already=True)
        return EXIT_OK

    loop = Loop(run, at, cfg, workdir, progress, log)
    try:
        loop.steps(stop)
        # The final or stop checkpoint, written synchronously by rank 0; no rank exits before it is committed.
        if run.ranks.is_main or loop.saver.collective:
            commit_now(at.step, loop.saver, loop.cadence, loop.checkpoint, log, loop.board, phase="final_checkpoint")
        run.ranks.barrier()
    except torch.OutOfMemoryError as e:
        record_saves(loop.saver.wait(), loop.cadence, loop.saver.store, log, loop.board)  # a whole earlier step
        raise OutOfMemory(loop.phase, at.step + (loop.phase == "step"), first_line(e), needed_bytes(e),
                          run.plan.report()) from None
    finally:
        loop.close()

    if at.step < cfg.train.steps:
        log.info("stopped", step=at.step, reason=stop.reason or "another rank was stopped",
                 checkpoint=loop.cadence.saved_step)
        return EXIT_STOPPED
    return finish(run, at, cfg, workdir, fs, log)


# ----------------------------------------------------------------------------------------------------- set up
@dataclass
class Run:
    """What set-up built for this attempt: the processes, the data, the model and what trains it."""

    world: World
    share: BatchShare
    ranks: Ranks
    device: torch.device
    family: Family
    dataset: Any
    validation: Any
    generator: torch.Generator
    model: torch.nn.Module
    params: dict[str, torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    ema: AdapterEMA | None
    store: CheckpointStore
    plan: MemoryPlan  # this attempt's memory plan (engine/memory_plan/): where bytes live, never the numerics
    floor: AttemptMemory  # what the daemon asked of this attempt after an out-of-memory


def set_up(cfg: JobConfig, workdir: Path, fs: FileLayer, log: EventLog) -> Run:
    world = world_from_env()  # torchrun's; one process without it
    floor, micro = micro_batch(cfg, world.size, log)  # after an out-of-memory, the daemon's floors
    # Before any rank waits on another: a global batch this world size cannot keep is refused at once (exit 65).
    share = BatchShare(world, micro, plan_grad_accum(cfg.global_batch(), micro, world.size))
    ranks = Ranks.start(world, cfg.train.sharding)
    ranks.check_same_job(VERSION, cfg.identity_hash())
    ranks.check_shared_dir(workdir)
    device = ranks.device(pick_device())
    family = get_family(cfg.model.family)
    log.info("start", version=VERSION, pid=os.getpid(), device=str(device), family=cfg.model.family,
             steps=cfg.train.steps, config_hash=cfg.identity_hash(), processes=world.size,
             global_batch=share.global_batch, grad_accum=share.grad_accum)
    _warn_at_start(cfg, world, share, log)

    # -- data
    log.info("phase", phase="prepare")
    with ranks.main_first():  # one-off work on shared files (caches, built-in models): rank 0 first, then the rest
        family.prepare(cfg, workdir, log)
    dataset = family.build_dataset(cfg, workdir, log)
    validation = family.validation_set(cfg, workdir, log) if cfg.data.validation is not None else None
    generator = seed_everything(cfg.train.seed)

    # -- model and optimizer
    log.info("phase", phase="load_model")
    model, plan = load_planned(family, cfg, workdir, device, floor, share.batch_size, share.grad_accum, log)
    if (blocks := ranks.shard(model)) is not None:  # fsdp: before the optimizer, which must hold the shards
        log.info("sharded", blocks=blocks, processes=world.size)
    params = trainable(model)
    optimizer = build_optimizer(list(params.values()), cfg.train)
    ema = AdapterEMA(params, **cfg.train.ema.model_dump(exclude={"export_raw"})) if cfg.train.ema else None
    if (advice := optimizer_advice(cfg.train)) is not None:
        log.warning("optimizer_advice", message=advice)
        say(f"lorad: warning: {advice}")
    store = CheckpointStore(workdir / "checkpoints", keep=cfg.checkpoint.keep, fs=fs, **cfg.identity_at(workdir))
    return Run(world, share, ranks, device, family, dataset, validation, generator, model, params, optimizer, ema,
               store, plan, floor)


def _warn_at_start(cfg: JobConfig, world: World, share: BatchShare, log: EventLog) -> None:
    if world.size != cfg.processes():
        log.warning("world_size", processes=world.size, written_for=cfg.processes(), grad_accum=share.grad_accum,
                    message=f"running on {world.size} process(es), the job is written for {cfg.processes()} "
                            f"(resources.gpus × resources.nodes): grad_accum is {share.grad_accum} to keep the "
                            f"global batch {share.global_batch}")
    for key, use in cfg.deprecated_keys():
        log.warning("deprecated_key", key=key, use=use, message=f"{key} is deprecated: write {use} instead")
        say(f"lorad: warning: {key} is deprecated: write {use} instead")


# ----------------------------------------------------------------------------------------------------- resume
def resume(run: Run, cfg: JobConfig, log: EventLog, progress: str, t_start: float) -> Position:
    """Load the newest checkpoint that verifies into the parameters, optimizer and generator; where to go on from."""
    loaded, skipped = run.store.load_latest(run.ranks.is_main)
    for s in skipped:
        log.warning("checkpoint_skipped", checkpoint=s.name, reason=s.reason)
        # Also on stderr: `lorad run` shows a progress bar, not the event stream, and a skipped save must be seen.
        say(f"lorad: warning: skipped checkpoint {s.name}: {s.reason}")
    if loaded is None:
        return Position()
    state = restore_checkpoint(loaded, run.params, run.optimizer, run.generator, log, run.ema)
    at = Position(state["step"], state["samples_consumed"], state.get("train_seconds", 0.0), shards=loaded.shards)
    at.lr_plan, replanned = resume_plan(state, at.step, cfg.train)
    if replanned is not None:
        log.warning("lr_replanned", message=replanned)
        say(f"lorad: warning: {replanned}")
    if state.get("dataset_size") != len(run.dataset):
        log.warning("dataset_changed", was=state.get("dataset_size"), now=len(run.dataset),
                    message="the dataset changed since this checkpoint; the order continues by sample count")
    log.info("resumed", from_step=at.step, checkpoint=loaded.path.name, skipped=[s.name for s in skipped],
             seconds_since_start=round(time.monotonic() - t_start, 3))
    if progress != "json" and at.step < cfg.train.steps:  # `lorad run`: said when it happens, not after
        say(f"lorad: resumed job {cfg.name} from step {at.step} (checkpoint {loaded.path.name})")
    return at


# ----------------------------------------------------------------------------------------------------- the loop
class Loop:
    """The steps of one attempt: each optimizer step, then its report, validation, samples and save."""

    def __init__(self, run: Run, at: Position, cfg: JobConfig, workdir: Path, progress: str, log: EventLog):
        self.run, self.at, self.cfg, self.workdir, self.log = run, at, cfg, workdir, log
        self.model = run.ranks.wrap(run.model)  # after the restore: DDP starts from rank 0's (identical) weights
        self.board = None  # rank 0 alone writes
        tb = cfg.logging.tensorboard
        if run.ranks.is_main and (tb or (tb is None and tensorboard_available())):
            self.board = TrainingBoard(workdir / "tb", at.step)  # a resumed attempt hides what the last one wrote after
        self.sharded = cfg.train.sharding == "fsdp"  # checkpoints in shards (DCP), on any number of processes
        self.saver = (ShardedCheckpointer(run.store, run.ranks, run.model, run.optimizer) if self.sharded
                      else AsyncCheckpointer(run.store))
        self.cadence = SaveCadence(cfg.checkpoint.every_steps, cfg.checkpoint.every_seconds,
                                   last_step=cfg.train.steps, saved_step=at.step, now=time.monotonic())
        self.bar = make_progress(progress, total=cfg.train.steps, start=at.step)
        # On a GPU the batch at the next cursor is built and copied on a side stream while this step's kernels
        # run; on the CPU a passthrough.
        pick, seed, micro = sample_log(run.dataset.indices_at, run.world), cfg.train.seed, run.share.batch_size
        self.batches = Prefetcher(lambda cursor: run.dataset.collate(pick(seed, cursor, micro)), run.device)
        self.step_times: list[float] = []
        self.exports = CheckpointExports(run.family, run.model, cfg, len(run.dataset))  # each save's user files
        # What the loop is doing, for an out-of-memory's report: step, validation, sample, save (the final one too).
        self.phase = "step"
        self.sample_cfg = samples_config(cfg, run.plan)  # none due when an out-of-memory re-plan skipped them

    def checkpoint(self) -> Snapshot:
        run, at = self.run, self.at
        if self.sharded:  # adapter and optimizer go to the shards every rank writes
            return rng_snapshot(at.step, run.generator, at.state(len(run.dataset), self.cfg))
        return self.exports.attach(snapshot(at.step, run.params, run.optimizer, run.generator,
                                            at.state(len(run.dataset), self.cfg), run.ema), run.optimizer, run.params)

    def steps(self, stop: StopFlag) -> None:
        """Train step after step until the last one, or until a stop every rank agrees on."""
        run, at = self.run, self.at
        run.model.train()
        # Every rank takes the same decision at every step boundary; a stop asked for during the last step's
        # samples or save is seen here, before another step.
        while at.step < self.cfg.train.steps and not run.ranks.agree(stop.requested)[0]:
            t0 = time.monotonic()
            self.phase = "step"
            loss, lr, grad_norm = train_step(run.family, self.model, run.optimizer, run.params, self.batches, at,
                                             self.cfg, run.share, run.ranks, run.floor.level())
            at.step += 1
            if run.ema is not None:
                run.ema.update(at.step)
            self.report(loss, lr, grad_norm, time.monotonic() - t0)
            debug_pause()  # tests: a kill a few steps after an event lands before the job ends
            if run.validation is not None and validation_due(self.cfg.data.validation.every_steps, at.step):
                self.validate()  # every rank its share, before the stop decision: a checkpointed step has its value
            stopping, urgent = run.ranks.agree(stop.requested, stop.take_save_request())
            if not run.ranks.is_main and not self.saver.collective:  # rank 0 alone renders and writes checkpoints
                continue
            if not stopping and run.ranks.is_main:
                self.phase = "sample"
                self.render_samples()
            self.phase = "save"
            save_if_due(at.step, urgent, self.saver, self.cadence, self.checkpoint, self.log, self.board)

    def report(self, loss: float, lr: float, grad_norm: torch.Tensor | None, seconds: float) -> None:
        at, total = self.at, self.cfg.train.steps
        self.step_times.append(seconds)
        at.train_seconds += seconds
        s_per_step = statistics.median_high(self.step_times[-20:])
        self.log.info("step", step=at.step, total=total, loss=round(loss, 6), lr=lr, s_per_step=round(s_per_step, 4),
                      eta_s=round(s_per_step * (total - at.step), 1), samples=at.consumed)
        self.bar.update(at.step, loss, s_per_step)
        if self.board is not None:
            self.board.step(at.step, **{"train/loss": loss, "train/lr": lr,
                                        "train/grad_norm": None if grad_norm is None else float(grad_norm),
                                        "perf/s_per_step": s_per_step,
                                        "perf/peak_memory_gib": peak_memory_gib(self.run.device)})

    def validate(self) -> None:
        run, step = self.run, self.at.step
        self.phase = "validation"
        with eval_weights(run.optimizer, run.params), run.ema.swapped_in() if run.ema is not None else nullcontext():
            val_loss, n = evaluate(run.family, run.model, run.validation, self.cfg, run.device, run.ranks, self.log,
                                   step)
        self.log.info("validation", step=step, loss=val_loss, batches=n)
        if self.board is not None:
            self.board.step(step, **{"validation/loss": val_loss})

    def render_samples(self) -> None:
        """The family's end-of-step work (samples, when due); rendering could outlast the stop grace period."""
        run, step = self.run, self.at.step
        samples = sample_due(self.sample_cfg, step)
        if samples:
            # Committed before the samples render: a render that is killed (a hang, an OOM) never costs the step,
            # and the retry goes on past it.
            commit_now(step, self.saver, self.cadence, self.checkpoint, self.log, self.board)
        with eval_weights(run.optimizer, run.params) if samples else nullcontext(), \
                run.ema.swapped_in() if run.ema is not None and samples else nullcontext():
            run.family.on_step_end(run.model, step, self.sample_cfg, self.workdir, self.log)
        if self.board is not None and samples:
            self.board.images(step, sorted((self.workdir / "samples" / f"step-{step:08d}").glob("*.png")))

    def close(self) -> None:
        self.bar.close()
        if self.board is not None:
            self.board.close()
        if self.saver.busy():  # never leave a writer thread behind on an exception
            self.saver.wait()


def train_step(family: Family, model, optimizer, params, batches: Prefetcher, at: Position, cfg: JobConfig,
               share: BatchShare, ranks: Ranks, replan_level: int = 0) -> tuple[float, float, torch.Tensor | None]:
    """One optimizer step over this rank's micro-batches of the global batch at `at.consumed` (advanced past it).

    Returns (loss over the whole global batch, lr, grad norm before clipping — None without train.max_grad_norm —
    still on the device)."""
    train = cfg.train
    lr = at.lr(cfg)
    set_lr(optimizer, lr)
    loss_sum = None  # on the device: read once per optimizer step, never per micro-batch (a host sync)
    mine = share.positions(at.consumed)
    for k, pos in enumerate(mine):
        batch = batches.get(pos)
        # Draws keyed by the micro-batch's global position: the same dropout and noise on any world size.
        with ranks.no_sync(model, last_round=k == len(mine) - 1):  # DDP all-reduces on the last round only
            with compute_autocast(cfg.model.dtype, cfg.lora.dtype, batches.device):
                loss = family.loss(model, batch, seed_micro_batch(train.seed, at.step, pos)) / share.grad_accum
            loss.backward()
        if k == 0:
            debug_oom(at.step + 1, replan_level)  # tests: a real torch.OutOfMemoryError, gradients half accumulated
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


# ----------------------------------------------------------------------------------------------------- the end
def finish(run: Run, at: Position, cfg: JobConfig, workdir: Path, fs: FileLayer, log: EventLog) -> int:
    """Every step trained: rank 0 exports the adapter in the user's formats while the other ranks wait."""
    whole = gather_adapter(run.model) if run.ranks.sharded else {}  # every rank takes part; rank 0 receives it
    if not run.ranks.is_main:
        run.ranks.barrier()  # while rank 0 exports
        return EXIT_OK
    meta = export_meta(cfg, at.step, len(run.dataset))
    use_eval_weights(run.optimizer)  # schedule-free: export the averaged weights, not the training iterate
    try:
        with adapter_swapped_in(run.model, whole):  # fsdp: the whole adapter, not rank 0's shard
            out = export_output(run.family, run.model, cfg, workdir, fs, meta, log, run.ema)
    except OSError as e:
        if is_disk_full(e):
            raise DiskError(f"disk full while writing the final adapter to {workdir / 'output'}; "
                            f"checkpoint step-{at.step:08d} is committed, free space and run again") from None
        raise
    log.info("done", step=at.step, output=str(out), train_seconds=round(at.train_seconds, 2))
    run.ranks.barrier()
    return EXIT_OK
