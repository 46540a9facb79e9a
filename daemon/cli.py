"""The `lorad` command line. One function per verb; `main()` dispatches."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from daemon.paths import default_home, job_dir


def cmd_run(args: argparse.Namespace) -> int:
    """Train a job in the foreground (no daemon). Running it again resumes."""
    from engine.config import JobInvalid, dump_job, load_job
    from engine.fsio import RealFs, ensure_dir_durable, write_file_durable
    from engine.run import train
    from engine.stop import EXIT_INVALID, StopFlag

    try:
        cfg = load_job(args.job)
    except JobInvalid as e:
        print(f"lorad: invalid job: {e}", file=sys.stderr)
        return EXIT_INVALID
    home = Path(args.home) if args.home else default_home()
    workdir = job_dir(home, cfg.name)
    fs = RealFs()
    ensure_dir_durable(fs, workdir)
    write_file_durable(fs, workdir / "job.yaml", dump_job(cfg).encode())
    stop = StopFlag()
    stop.install()
    print(f"lorad: job {cfg.name} in {workdir}", file=sys.stderr)
    return train(cfg, workdir, progress="none" if args.quiet else "bar", fs=fs, stop=stop)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="lorad", description="Resilient LoRA training service.")
    sub = ap.add_subparsers(dest="verb", required=True, metavar="VERB")

    p = sub.add_parser("run", help="train a job in the foreground; run again to resume")
    p.add_argument("job", help="job YAML file")
    p.add_argument("--home", help="lorad home directory (default: ~/.local/share/lorad)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(fn=cmd_run)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
