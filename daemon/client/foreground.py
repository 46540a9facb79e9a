"""The foreground commands, which work without a daemon: `lorad run` (train a job here, resume by running it
again) and `lorad cache` (fill a job's data cache now, with a progress bar).

Both need the training stack (`lorad[train]`); the engine is imported inside each command, so that the
client verbs never pay for it.
"""

from __future__ import annotations

import argparse
import inspect
import sys
from pathlib import Path
from typing import Any

from daemon.client.render import term_safe
from daemon.system.lock import AlreadyRunning, TrainerLock
from daemon.system.paths import default_home, job_dir


def _local_job(args: argparse.Namespace):
    """(job config, its workdir under --home) for the verbs that work without a daemon; None after saying why."""
    from daemon.client.verbs import local_import
    from engine.config.job import load_job
    from engine.errors import JobInvalid

    try:
        # another trainer's config runs as the job it imports to (engine/importers/)
        _, cfg = local_import(Path(args.job), check_paths=True)
        cfg = cfg or load_job(args.job)
    except JobInvalid as e:
        print(f"lorad: invalid job: {term_safe(e)}", file=sys.stderr)
        return None
    return cfg, job_dir(Path(args.home) if args.home else default_home(), cfg.name)


# ================================================================ lorad run
def cmd_run(args: argparse.Namespace) -> int:
    """Train a job in the foreground (no daemon). Running it again resumes."""
    from engine.config.job import dump_job
    from engine.report.events import read_events
    from engine.storage.fsio import RealFs, ensure_dir_durable, write_file_durable
    from engine.training.stop import EXIT_INVALID, StopFlag

    if (job := _local_job(args)) is None:
        return EXIT_INVALID  # before the training stack's import (seconds): an invalid job is refused at once
    from engine.recipe import train

    cfg, workdir = job
    fs = RealFs()
    ensure_dir_durable(fs, workdir)
    # The daemon's trainers hold the same lock: one trainer per job, whoever started it.
    lock = TrainerLock(workdir, cfg.name)
    try:
        lock.acquire()
    except AlreadyRunning as e:
        print(f"lorad: {e}", file=sys.stderr)
        return 1
    try:
        write_file_durable(fs, workdir / "job.yaml", dump_job(cfg).encode())
        stop = StopFlag()
        stop.install()
        print(f"lorad: job {term_safe(cfg.name)} in {term_safe(workdir)}", file=sys.stderr)
        events = workdir / "events.jsonl"  # every run's events: this run's are the ones after `seen` bytes
        seen = events.stat().st_size if events.exists() else 0
        code = train(cfg, workdir, progress="none" if args.quiet else "bar", fs=fs, stop=stop)
        for line in run_summary(read_events(workdir, seen), code):
            print(f"lorad: {term_safe(line)}", file=sys.stderr)  # from the job's events
        return code
    finally:
        lock.release()


def run_summary(events: list[dict[str, Any]], code: int) -> list[str]:
    """What `lorad run` says after training, from this run's events: where it stopped or put the adapter.

    (Where it resumed is said by the engine itself, when it resumes.)
    """
    from engine.checkpoint.store import step_dir_name
    from engine.training.stop import EXIT_OK, EXIT_STOPPED

    last = {e.get("event"): e for e in events}
    stopped, done = last.get("stopped"), last.get("done")
    lines = []
    if code == EXIT_STOPPED and stopped is not None:
        ckpt = stopped.get("checkpoint")
        if ckpt:
            lines.append(f"stopped at step {stopped.get('step')}; checkpoint {step_dir_name(ckpt)} is committed — "
                         "run the same command to resume")
        else:
            lines.append(f"stopped at step {stopped.get('step')}, before the first checkpoint — "
                         "run the same command to start again")
    if code == EXIT_OK and done is not None:
        already = " (it had already finished: nothing trained)" if done.get("already") else ""
        lines.append(f"done — adapter in {done.get('output')}{already}")
    return lines


# ================================================================ lorad cache
def cmd_cache(args: argparse.Namespace) -> int:
    """Encode a job's cached inputs now (an image job's latents and text embeddings); training reuses them."""
    from engine.training.stop import EXIT_INVALID

    if (job := _local_job(args)) is None:
        return EXIT_INVALID
    cfg, workdir = job
    from daemon.config.daemon import ConfigInvalid, load_config
    from engine.storage import cache_evict
    from engine.storage.home import cache_dir

    try:
        limit = load_config(args.config).cache_max_bytes if args.config else 0
    except ConfigInvalid as e:
        print(f"lorad: {e}", file=sys.stderr)
        return 78
    cache_evict.set_limit(limit)  # as the daemon's trainers do: least-recently-used entries go after the fill
    where = cache_dir(workdir)
    print(f"lorad: cache of job {cfg.name} in {where}", file=sys.stderr)
    code = cache_job(cfg, workdir, progress="none" if args.quiet else "bar")
    n, size = cache_evict.usage(where)
    keys, compiled = cache_evict.compile_usage(where)  # counted in the limit with the entries
    bound = f"limit {limit / 2**20:.1f} MiB" if limit else "no limit (--config: the daemon's cache_max_bytes)"
    print(f"lorad: cache {where}: {n} entries, {size / 2**20:.1f} MiB; compile cache {keys} keys, "
          f"{compiled / 2**20:.1f} MiB; {bound}", file=sys.stderr)
    return code


def has_cache(family: Any) -> bool:
    """A family that encodes its data ahead of training takes a progress bar in prepare(); the others do not."""
    return "bar" in inspect.signature(family.prepare).parameters


def cache_job(cfg, workdir: Path, progress: str = "bar") -> int:
    """Fill the job's cache through its family's prepare(); an exit code (0, or 65 for a family without one)."""
    from engine.errors import JobInvalid
    from engine.families import get_family
    from engine.report.events import EventLog
    from engine.storage.fsio import RealFs, ensure_dir_durable
    from engine.training.stop import EXIT_INVALID, EXIT_OK

    family = get_family(cfg.model.family)
    if not has_cache(family):
        print(f"lorad: model.family {cfg.model.family} has no latent cache (only the image families have one)",
              file=sys.stderr)
        return EXIT_INVALID
    fs = RealFs()
    ensure_dir_durable(fs, Path(workdir))
    log = EventLog(Path(workdir) / "events.jsonl", to_stdout=(progress == "json"), job=cfg.name)
    bar = CacheBar() if progress == "bar" else None
    try:
        family.prepare(cfg, Path(workdir), log, bar=bar)
    except JobInvalid as e:
        log.error("invalid_job", message=str(e))
        print(f"lorad: invalid job: {e}", file=sys.stderr)
        return EXIT_INVALID
    finally:
        if bar is not None:
            bar.close()
        log.close()
    return EXIT_OK


class CacheBar:
    """A rich progress bar over the encodings still to do (created at the first one)."""

    def __init__(self):
        self.progress = None
        self.task = None

    def __call__(self, done: int, total: int, what: str) -> None:
        if self.progress is None:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self.progress = Progress(TextColumn("[bold]cache"), MofNCompleteColumn(), BarColumn(),
                                     TextColumn("{task.fields[what]}"), TimeRemainingColumn())
            self.progress.start()
            self.task = self.progress.add_task("cache", total=total, what="")
        self.progress.update(self.task, completed=done, what=what[:40])

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
