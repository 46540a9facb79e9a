"""The trainer's command line: one lorad training job, resumed by itself from its newest verified checkpoint.

    python -m engine.run --job jobs/ID/job.yaml --workdir jobs/ID

is exactly how the daemon starts a trainer (engine.launch wraps it in torchrun for several processes). It
prints its progress as JSON lines on stdout, the heartbeats the daemon reads. The recipe itself is
engine/recipe.py; nothing imports this module.

Exit codes: 0 finished, 65 invalid job, 69 out of GPU memory (the daemon re-plans memory and resumes), 74 disk
full / unwritable, 75 stopped cleanly after a checkpoint (resumable), anything else is a crash.
"""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path

from engine.config import policy as job_policy
from engine.config.job import load_job
from engine.distributed.liveness import Liveness, die_with_parent
from engine.errors import JobInvalid
from engine.imports import unwalked_imports
from engine.storage import cache_evict
from engine.training.stop import EXIT_INVALID, EXIT_STOPPED, StopFlag


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m engine.run", description="Run one lorad training job (resumes by itself).")
    ap.add_argument("--job", required=True, help="job YAML file")
    ap.add_argument("--workdir", required=True, help="the job's directory (checkpoints/, output/, events.jsonl)")
    ap.add_argument("--progress", choices=["json", "bar", "none"], default="json")
    job_policy.add_arguments(ap)
    args = ap.parse_args(argv)
    die_with_parent()  # a rank started by engine.launch: no orphan if the launcher is killed
    policy = job_policy.from_args(args)
    if policy is not None:
        cache_evict.set_limit(policy.cache_max_bytes)
    try:
        # The daemon's policy, from our argv (which no one but the daemon set), over the job.yaml on disk now.
        cfg = load_job(args.job, policy=policy)
    except JobInvalid as e:
        print(f"lorad: invalid job: {e}", file=sys.stderr, flush=True)
        return EXIT_INVALID
    # A SIGTERM or Ctrl-C from here on is a clean stop, not a death by signal: during the imports below there is
    # nothing to save yet, so the trainer exits 75 (resumable) right after them, before it loads anything.
    stop = StopFlag()
    stop.install()
    # The training stack (torch and the rest: seconds) is imported once the job is known to be valid: an invalid
    # one is refused in a fraction of a second.
    with unwalked_imports():
        from engine.distributed.ddp import leave_process_group
        from engine.recipe import train
    if stop.requested:
        print(f"lorad: stopped ({stop.reason}) before training began; nothing to save", file=sys.stderr, flush=True)
        return EXIT_STOPPED

    alive = Liveness.from_env()  # the daemon's: this rank's sign of life, even while it waits for the others
    if alive is not None:
        alive.start()
    try:
        code = train(cfg, Path(args.workdir), progress=args.progress, stop=stop)
    finally:
        if alive is not None:
            alive.stop()  # a rank done before the others (rank 0 still exporting) is not a silent one
    leave_process_group(code)  # a rank of a distributed run: its code, never an abort at exit
    return code


if __name__ == "__main__":
    code = main()
    # The daemon records a pause, a stop or the end of a job when the trainer exits, and interpreter shutdown's
    # last garbage collection walks every object torch and transformers made: 1.6-2.6 s of a micro-model
    # trainer's exit on a loaded 2-core machine, 0.2-0.3 s with the heap frozen out of its reach. Everything
    # the run leaves is committed (fsynced) by now; nothing relies on a cycle's finalizer at exit (the trainers
    # the tests fork skip interpreter shutdown altogether).
    gc.freeze()
    sys.exit(code)
