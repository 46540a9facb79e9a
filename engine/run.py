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
import json
import os
import shutil
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch

from engine.adapters import compute_autocast
from engine.checkpoint import AsyncCheckpointer, CheckpointStore, ConfigMismatch, Snapshot
from engine.config import JobConfig, JobInvalid, load_job
from engine.data.order import Cursor, sample_indices
from engine.ema import AdapterEMA
from engine.events import EventLog
from engine.families import get_family
from engine.families.base import hub_refusal
from engine.fsio import FileLayer, RealFs, ensure_dir_durable, is_disk_full, normal_file_mode
from engine.optim import (
    build_optimizer,
    eval_weights,
    join_tree,
    load_optimizer_state,
    lr_at,
    optimizer_advice,
    optimizer_state,
    split_tree,
    use_eval_weights,
)
from engine.prefetch import Prefetcher
from engine.progress import make_progress
from engine.rng import capture, restore, seed_everything
from engine.sample import sample_due
from engine.speedups import apply_train_speedups
from engine.stop import EXIT_INVALID, EXIT_IO, EXIT_OK, EXIT_STOPPED, StopFlag
from engine.tensorboard import TrainingBoard
from engine.tensorboard import available as tensorboard_available

VERSION = "0.1.0"


class DiskError(Exception):
    """A checkpoint or output could not be written (disk full, read-only, ...)."""


def peak_memory_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def pick_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def trainable(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def snapshot(step: int, params, optimizer, generator, state: dict[str, Any], ema: AdapterEMA | None = None) -> Snapshot:
    """Host copies at a step boundary; the background writer serialises and writes them."""
    adapter = {n: p.detach().to("cpu", copy=True).contiguous() for n, p in params.items()}
    opt_tensors: dict[str, torch.Tensor] = {}
    tree = split_tree(optimizer_state(optimizer), "", opt_tensors)
    opt_tensors = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in opt_tensors.items()}
    rng_meta, rng_tensors = capture(generator)
    extra = {"ema": ema.tensors()} if ema is not None else {}
    return Snapshot(step, adapter, opt_tensors, tree, rng_tensors, {**state, "rng": rng_meta}, extra)


def restore_checkpoint(loaded, params, optimizer, generator, log=None, ema: AdapterEMA | None = None) -> dict[str, Any]:
    missing = set(params) ^ set(loaded.adapter)
    if missing:
        raise JobInvalid(f"checkpoint {loaded.path.name} does not match the model's LoRA parameters: {sorted(missing)[:3]}")
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


def export_output(family, model, cfg: JobConfig, workdir: Path, fs: FileLayer, meta: dict[str, Any],
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
    try:
        ensure_dir_durable(fs, workdir)
        log = EventLog(workdir / "events.jsonl", to_stdout=(progress == "json"), job=cfg.name)
    except OSError as e:
        # No events file to write to yet: the one line on stderr is the whole report.
        _say(progress, f"lorad: cannot create the job directory {workdir} ({e.strerror or e})")
        return EXIT_IO
    try:
        return _train(cfg, workdir, progress, fs, stop, log)
    except JobInvalid as e:
        log.error("invalid_job", message=str(e))
        _say(progress, f"lorad: invalid job: {e}")
        return EXIT_INVALID
    except ConfigMismatch as e:
        log.error("invalid_job", message=str(e))
        _say(progress, f"lorad: {e}")
        return EXIT_INVALID
    except DiskError as e:
        log.error("disk_error", message=str(e))
        _say(progress, f"lorad: {e}")
        return EXIT_IO
    except OSError as e:
        if is_disk_full(e):  # outside the checkpoint writer: the latent cache, sample images, the export
            msg = (f"disk full ({e.filename or workdir}); committed checkpoints are intact — free space and run "
                   "again")
            log.error("disk_error", message=msg)
            _say(progress, f"lorad: {msg}")
            return EXIT_IO
        if (why := hub_refusal(e, cfg)) is None:
            raise
        log.error("invalid_job", message=why)
        _say(progress, f"lorad: invalid job: {why}")
        return EXIT_INVALID
    finally:
        log.close()


def _say(progress: str, line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def quiet_libraries() -> None:
    """Our events and bar report progress; the libraries' own bars and deprecation chatter only clutter them."""
    import warnings

    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    for lib in (transformers_logging, diffusers_logging):
        lib.set_verbosity_error()
        lib.disable_progress_bar()
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"(transformers|diffusers|peft)\.")


def _train(cfg: JobConfig, workdir: Path, progress: str, fs: FileLayer, stop: StopFlag, log: EventLog) -> int:
    t_start = time.monotonic()
    quiet_libraries()
    device = pick_device()
    family = get_family(cfg.model.family)
    log.info("start", version=VERSION, pid=os.getpid(), device=str(device), family=cfg.model.family,
             steps=cfg.train.steps, config_hash=cfg.identity_hash())

    # -- data and model
    log.info("phase", phase="prepare")
    family.prepare(cfg, workdir, log)
    dataset = family.build_dataset(cfg, workdir, log)
    n = len(dataset)
    generator = seed_everything(cfg.train.seed)
    log.info("phase", phase="load_model")
    model = family.load_model(cfg, workdir, device, log)
    apply_train_speedups(model, cfg.train, device, log)  # blocks_to_swap, compile
    params = trainable(model)
    optimizer = build_optimizer(list(params.values()), cfg.train)
    ema = AdapterEMA(params, **cfg.train.ema.model_dump(exclude={"export_raw"})) if cfg.train.ema else None
    if (advice := optimizer_advice(cfg.train)) is not None:
        log.warning("optimizer_advice", message=advice)
        _say(progress, f"lorad: warning: {advice}")

    # -- resume
    store = CheckpointStore(workdir / "checkpoints", cfg.identity_hash(), cfg.checkpoint.keep, fs, cfg.identity())
    loaded, skipped = store.load_latest()
    for s in skipped:
        log.warning("checkpoint_skipped", checkpoint=s.name, reason=s.reason)
        # Also on stderr: `lorad run` shows a progress bar, not the event stream, and a skipped save must be seen.
        _say(progress, f"lorad: warning: skipped checkpoint {s.name}: {s.reason}")
    step, consumed, elapsed_before = 0, 0, 0.0
    if loaded is not None:
        state = restore_checkpoint(loaded, params, optimizer, generator, log, ema)
        step, consumed, elapsed_before = state["step"], state["samples_consumed"], state.get("train_seconds", 0.0)
        if state.get("dataset_size") != n:
            log.warning("dataset_changed", was=state.get("dataset_size"), now=n,
                        message="the dataset changed since this checkpoint; the order continues by sample count")
        log.info("resumed", from_step=step, checkpoint=loaded.path.name, skipped=[s.name for s in skipped],
                 seconds_since_start=round(time.monotonic() - t_start, 3))
        if progress != "json" and step < cfg.train.steps:  # `lorad run`: said when it happens, not after
            _say(progress, f"lorad: resumed job {cfg.name} from step {step} (checkpoint {loaded.path.name})")
    if step >= cfg.train.steps and output_step(workdir, cfg) == step:
        log.info("done", step=step, output=str(workdir / "output"), already=True)
        return EXIT_OK

    # -- loop
    board = None
    if cfg.logging.tensorboard or (cfg.logging.tensorboard is None and tensorboard_available()):
        board = TrainingBoard(workdir / "tb", step)  # a resumed attempt hides what the last one wrote after `step`
    saver = AsyncCheckpointer(store)
    bar = make_progress(progress, total=cfg.train.steps, start=step)
    micro = cfg.train.batch_size
    last_save_t = time.monotonic()
    last_saved_step = step
    step_times: list[float] = []
    train_seconds = elapsed_before
    model.train()
    # A dataset may own its order (Flux: one aspect-ratio bucket per batch); both are pure in (seed, position).
    pick = getattr(dataset, "indices_at", None) or (lambda seed, start, count: sample_indices(seed, n, start, count))
    # On a GPU the batch at the next cursor is built and copied on a side stream while this step's kernels run;
    # on the CPU a passthrough.
    prefetcher = Prefetcher(lambda cursor: dataset.collate(pick(cfg.train.seed, cursor, micro)), device)

    def state_now() -> dict[str, Any]:
        c = Cursor(consumed, n)
        return {"step": step, "samples_consumed": consumed, "epoch": c.epoch, "position": c.position,
                "dataset_size": n, "train_seconds": train_seconds, "config_hash": cfg.identity_hash()}

    last_write_s = 0.0  # how long the last save took to commit
    slow_warned: int | None = None

    def handle_saves(results) -> None:
        nonlocal last_saved_step, last_write_s
        for r in results:
            if r.error is not None:
                _raise_save_error(r, store)
            last_saved_step = max(last_saved_step, r.step)
            last_write_s = r.seconds
            log.info("checkpoint_committed", step=r.step, path=str(r.path), seconds=round(r.seconds, 4))
            if board is not None:
                board.flush()

    try:
        while step < cfg.train.steps:
            if stop.requested:
                break
            t0 = time.monotonic()
            lr = lr_at(step, cfg.train)
            for g in optimizer.param_groups:
                g["lr"] = lr
            loss_sum = 0.0
            for _ in range(cfg.train.grad_accum):
                batch = prefetcher.get(consumed)
                consumed += micro
                with compute_autocast(cfg.model.dtype, cfg.lora.dtype, device):
                    loss = family.loss(model, batch, generator) / cfg.train.grad_accum
                loss.backward()
                prefetcher.prefetch(consumed)  # the next batch is collated and copied while the GPU works
                loss_sum += float(loss.detach())
            grad_norm = None
            if cfg.train.max_grad_norm is not None:
                grad_norm = float(torch.nn.utils.clip_grad_norm_(list(params.values()), cfg.train.max_grad_norm))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if ema is not None:
                ema.update(step)
            dt = time.monotonic() - t0
            train_seconds += dt
            step_times.append(dt)
            s_per_step = sorted(step_times[-20:])[len(step_times[-20:]) // 2]
            eta = s_per_step * (cfg.train.steps - step)
            log.info("step", step=step, total=cfg.train.steps, loss=round(loss_sum, 6), lr=lr,
                     s_per_step=round(s_per_step, 4), eta_s=round(eta, 1), samples=consumed)
            bar.update(step, loss_sum, s_per_step)
            if board is not None:
                board.step(step, **{"train/loss": loss_sum, "train/lr": lr, "train/grad_norm": grad_norm,
                                    "perf/s_per_step": s_per_step, "perf/peak_memory_gib": peak_memory_gib(device)})
            if not stop.requested:  # rendering samples could outlast the stop grace period: checkpoint first
                with eval_weights(optimizer, params) if sample_due(cfg, step) else nullcontext(), \
                        ema.swapped_in() if ema is not None and sample_due(cfg, step) else nullcontext():
                    family.on_step_end(model, step, cfg, workdir, log)
                if board is not None and sample_due(cfg, step):
                    board.images(step, sorted((workdir / "samples" / f"step-{step:08d}").glob("*.png")))

            handle_saves(saver.poll())
            if stop.take_save_request() and step < cfg.train.steps:
                # An urgent save (UPS on battery): wait for any save in flight, then write this step now.
                handle_saves(saver.wait())
                log.info("phase", phase="urgent_checkpoint", step=step)
                saver.submit(snapshot(step, params, optimizer, generator, state_now(), ema))
                last_save_t = time.monotonic()
                continue
            # Work is lost back to the last *snapshot*, and a snapshot is safe only once committed: starting each
            # save as much earlier as the last one took to write keeps the work at risk within every_seconds.
            every_s = cfg.checkpoint.every_seconds
            due = (cfg.checkpoint.every_steps is not None and step - last_saved_step >= cfg.checkpoint.every_steps) or (
                every_s is not None and time.monotonic() - last_save_t + last_write_s >= every_s
            )
            if (every_s is not None and saver.busy() and saver.in_flight_step != slow_warned
                    and time.monotonic() - saver.started > every_s):
                slow_warned = saver.in_flight_step
                log.warning("checkpoint_slow", step=slow_warned, seconds=round(time.monotonic() - saver.started, 1),
                            message="a checkpoint save is taking longer than checkpoint.every_seconds, so more work "
                                    "than that is at risk until it lands (a slow disk, or every core busy "
                                    "training: see LORAD_CKPT_WRITER_NICE)")
            if due and not saver.busy() and step < cfg.train.steps:
                saver.submit(snapshot(step, params, optimizer, generator, state_now(), ema), background=True)
                last_save_t = time.monotonic()

        # -- final or stop checkpoint, written synchronously
        handle_saves(saver.wait())
        if step > last_saved_step:
            log.info("phase", phase="final_checkpoint", step=step)
            saver.submit(snapshot(step, params, optimizer, generator, state_now(), ema))
            handle_saves(saver.wait())
    finally:
        bar.close()
        if board is not None:
            board.close()
        # Never leave a writer thread behind on an exception.
        if saver.busy():
            saver.wait()

    if step < cfg.train.steps:
        log.info("stopped", step=step, reason=stop.reason, checkpoint=last_saved_step)
        return EXIT_STOPPED

    meta = {"steps": step, "lorad_version": VERSION, "base_model": cfg.model.path, "rank": cfg.lora.rank,
            "alpha": cfg.lora.alpha, "config_hash": cfg.identity_hash()}
    use_eval_weights(optimizer)  # schedule-free: export the averaged weights, not the training iterate
    try:
        out = export_output(family, model, cfg, workdir, fs, meta, ema)
    except OSError as e:
        if is_disk_full(e):
            raise DiskError(f"disk full while writing the final adapter to {workdir / 'output'}; "
                            f"checkpoint step-{step:08d} is committed, free space and run again") from None
        raise
    log.info("done", step=step, output=str(out), train_seconds=round(train_seconds, 2))
    return EXIT_OK


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
    args = ap.parse_args(argv)
    stop = StopFlag()
    stop.install()
    try:
        cfg = load_job(args.job)
    except JobInvalid as e:
        print(f"lorad: invalid job: {e}", file=sys.stderr)
        return EXIT_INVALID
    return train(cfg, Path(args.workdir), progress=args.progress, stop=stop)


if __name__ == "__main__":
    sys.exit(main())
