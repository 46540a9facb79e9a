"""The `lorad` command line: the parser and one dispatch; each verb is one function in its own room.

    daemon/client/verbs.py     ping submit status logs pause resume cancel retry priority drain power web-url gpu
    daemon/client/export.py           export
    daemon/client/captions.py         captions (no daemon: the job directory's captions.json)
    daemon/client/foreground.py       run cache
    daemon/client/importing.py        import check
    daemon/service/serve.py          serve
    daemon/system/install_service.py  install-service
    daemon/power/helper.py            power-helper (root, its own unit)

Every client verb is one typed request over the daemon's socket (daemon/protocol.py), printed as a table
(daemon/client/render.py) or, with --json, as the reply's JSON. Nothing imported at the top of this module or of
the client verbs' module imports torch: `pip install lorad` (no extras) is a working client. `serve`, `run`
and `cache` need the training stack, `pip install 'lorad[train]'`, and say so in one line when it is missing.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import sys
from pathlib import Path
from typing import Any

from daemon import protocol as p
from daemon.client.captions import add_parser as add_captions_parser
from daemon.client.export import cmd_export
from daemon.client.verbs import (
    cmd_cancel,
    cmd_drain,
    cmd_gpu,
    cmd_logs,
    cmd_pause,
    cmd_ping,
    cmd_power,
    cmd_priority,
    cmd_resume,
    cmd_retry,
    cmd_status,
    cmd_submit,
    cmd_web_url,
    fail,
)
from daemon.system.paths import default_home
from engine.version import lorad_version

EXIT_USAGE = 2  # argparse's own: a mistake in the arguments
EXIT_INVALID_JOB = 65  # EX_DATAERR, as the trainer's and `lorad submit`'s own validation
EXIT_UNAVAILABLE = 69  # EX_UNAVAILABLE: the daemon is not running
EXIT_CONFIG = 78  # EX_CONFIG: this installation cannot do it (the training stack is missing)
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE: what the shell reports for a reader that stopped early
# What `serve`, `run` and `cache` import (module names): the `train` extra of pyproject.toml.
TRAINING_STACK = ("torch", "transformers", "diffusers", "peft", "accelerate", "bitsandbytes", "safetensors",
                  "huggingface_hub", "tokenizers", "PIL", "av", "prodigyopt", "schedulefree", "scao", "tensorboard",  # training
                  "structlog", "watchdog", "apscheduler", "pynvml",  # the daemon
                  "starlette", "uvicorn", "python_multipart", "prometheus_client")  # its dashboard and /metrics


def missing_training_stack() -> list[str]:
    """The training stack's modules this installation lacks (found without importing them)."""
    return [m for m in TRAINING_STACK if importlib.util.find_spec(m) is None]


def cmd_run(args: argparse.Namespace) -> int:
    from daemon.client.foreground import cmd_run as run

    return run(args)


def cmd_cache(args: argparse.Namespace) -> int:
    from daemon.client.foreground import cmd_cache as cache

    return cache(args)


def cmd_import(args: argparse.Namespace) -> int:
    from daemon.client.importing import cmd_import as import_

    return import_(args)


def cmd_check(args: argparse.Namespace) -> int:
    from daemon.client.importing import cmd_check as check

    return check(args)


def cmd_serve(args: argparse.Namespace) -> int:
    from daemon.service.serve import serve

    return serve(Path(args.home) if args.home else default_home(), args.config)


def cmd_install_service(args: argparse.Namespace) -> int:
    from daemon.system.install_service import cmd_install_service as install

    return install(args)


def cmd_power_helper(args: argparse.Namespace) -> int:
    from daemon.power.helper import cmd_power_helper as helper

    return helper(args)


# ================================================================ parser
class _Parser(argparse.ArgumentParser):
    """Usage mistakes are one line on stderr and exit 2 (argparse's own code), never a traceback."""

    def error(self, message: str):
        if message.startswith("argument ") and ": " in message:
            line = message[len("argument "):]  # "priority: must be an integer between -1000 and 1000, got 5000"
        else:
            line = f"{message} (see: {self.prog} --help)"
        raise UsageError(line)


class UsageError(Exception):
    pass


def _limits(model: type[p.BaseModel], field: str) -> tuple[Any, Any]:
    """(lowest, highest) a protocol field accepts: the CLI checks the same bounds the daemon enforces."""
    lo = hi = None
    for m in model.model_fields[field].metadata:
        for attr in ("ge", "min_length"):
            lo = getattr(m, attr, None) if getattr(m, attr, None) is not None else lo
        for attr in ("le", "max_length"):
            hi = getattr(m, attr, None) if getattr(m, attr, None) is not None else hi
    return lo, hi


def _int_in(model: type[p.BaseModel], field: str):
    lo, hi = _limits(model, field)

    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            v = None
        if v is None or not lo <= v <= hi:
            raise argparse.ArgumentTypeError(f"must be an integer between {lo} and {hi}, got {text!r}")
        return v

    return parse


def _watts(text: str) -> float:
    lo, hi = _limits(p.Power, "limit_w")
    try:
        v = float(text)
    except ValueError:
        v = math.nan
    if not (math.isfinite(v) and lo <= v <= hi):
        raise argparse.ArgumentTypeError(f"must be a number of watts between {lo} and {hi}, got {text!r}")
    return v


def _seconds(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = math.nan
    if not (math.isfinite(v) and v > 0):
        raise argparse.ArgumentTypeError(f"must be a number of seconds above 0, got {text!r}")
    return v


def _job_ref(text: str) -> str:
    lo, hi = _limits(p.Logs, "job")
    if not lo <= len(text) <= hi:
        raise argparse.ArgumentTypeError(f"a job id or name is {lo} to {hi} characters")
    return text


def _job_file(text: str) -> str:
    lo, hi = _limits(p.Submit, "name")
    if not lo <= len(Path(text).name) <= hi:
        raise argparse.ArgumentTypeError(f"the file name must be {lo} to {hi} characters")
    return text


def _local_verbs(sub) -> None:
    """The verbs that run here, without the daemon's socket: run, cache, import, check, serve, install-service,
    power-helper."""
    p_ = sub.add_parser("run", help="train a job in the foreground; run again to resume")
    p_.add_argument("job", help="job YAML file")
    p_.add_argument("--home", help="lorad home directory (default: ~/.local/share/lorad)")
    p_.add_argument("--quiet", action="store_true", help="no progress bar")
    p_.set_defaults(fn=cmd_run, needs_training_stack=True)

    p_ = sub.add_parser("cache", help="encode an image job's latents and text embeddings into its cache (idempotent)")
    p_.add_argument("job", help="job YAML file")
    p_.add_argument("--home", help="lorad home directory (default: ~/.local/share/lorad)")
    p_.add_argument("--quiet", action="store_true", help="no progress bar")
    p_.add_argument("--config", help="daemon config YAML whose cache_max_bytes applies (as to the daemon's jobs)")
    p_.set_defaults(fn=cmd_cache, needs_training_stack=True)

    p_ = sub.add_parser("import", help="turn another trainer's config (ai-toolkit, kohya/musubi, OneTrainer, "
                                       "SimpleTuner, diffusion-pipe) into a lorad job file")
    p_.add_argument("file", help="the config: YAML, TOML, JSON or a saved command line")
    p_.add_argument("--dataset", metavar="FILE", help="its dataset file (kohya/musubi or diffusion-pipe dataset "
                                                      "TOML, SimpleTuner backends JSON, OneTrainer concepts JSON)")
    p_.add_argument("--to", metavar="JOB.yaml", help="write the job here (default: print it)")
    p_.set_defaults(fn=cmd_import)

    p_ = sub.add_parser("check", help="validate a job and say what it will do (no daemon needed)")
    p_.add_argument("job", help="job YAML file (or another trainer's config)")
    p_.add_argument("--json", action="store_true", help="the report as JSON")
    p_.set_defaults(fn=cmd_check)

    p_ = sub.add_parser("serve", help="run the daemon (inbox, queue, supervised trainers, socket API)")
    p_.add_argument("--home", help="lorad home directory")
    p_.add_argument("--config", help="daemon config YAML (see configs/daemon.yaml)")
    p_.set_defaults(fn=cmd_serve, needs_training_stack=True)

    p_ = sub.add_parser("install-service", help="install and enable the systemd units, lorad and lorad-power (root)")
    p_.add_argument("--dest", default="/etc/systemd/system/lorad.service")
    p_.add_argument("--no-enable", action="store_true", help="write the unit, do not enable or start it")
    p_.add_argument("--dry-run", action="store_true", help="print the unit that would be installed")
    p_.set_defaults(fn=cmd_install_service)

    p_ = sub.add_parser("power-helper", help="the root helper that sets NVML power limits for the lorad user "
                                             "(systemd/lorad-power.service)")
    p_.add_argument("--user", default="lorad", help="the one user who may use its socket")
    p_.add_argument("--socket", default="/run/lorad-power/lorad-power.sock")
    p_.add_argument("--state", default="/var/lib/lorad-power/changed.json", help="the GPUs it changed (root only)")
    p_.add_argument("--simulated", type=int, default=0, metavar="N", help="N simulated GPUs instead of NVML (tests)")
    p_.add_argument("--config", help="the daemon config whose `devices` are the only GPUs it caps (default: every one)")
    p_.set_defaults(fn=cmd_power_helper)


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="lorad", description="Resilient LoRA training service.")
    ap.add_argument("--version", action="version", version=f"lorad {lorad_version()}")
    sub = ap.add_subparsers(dest="verb", required=True, metavar="VERB")

    common = _Parser(add_help=False)
    common.add_argument("--home", help="lorad home directory (default: ~/.local/share/lorad, /var/lib/lorad under systemd)")
    common.add_argument("--socket", help="the daemon's socket (default: HOME/lorad.sock or /run/lorad/lorad.sock)")
    common.add_argument("--json", action="store_true", help="print the daemon's reply as JSON")

    _local_verbs(sub)
    p_ = sub.add_parser("ping", parents=[common], help="is the daemon up?")
    p_.set_defaults(fn=cmd_ping)
    p_ = sub.add_parser("submit", parents=[common], help="validate a job file and queue it; prints the job id")
    p_.add_argument("job", type=_job_file, nargs="?", help="job YAML file (with --from: optional, must match)")
    p_.add_argument("--from", dest="from_mirror", metavar="MIRROR_URL/JOB",
                    help="resume a mirrored job here from its newest complete remote checkpoint (docs/mirror.md)")
    p_.set_defaults(fn=cmd_submit)
    p_ = sub.add_parser("status", parents=[common], help="the queue, or one job in detail")
    p_.add_argument("job", nargs="?", type=_job_ref, help="job id (or name)")
    p_.set_defaults(fn=cmd_status)
    p_ = sub.add_parser("logs", parents=[common], help="a job's events")
    p_.add_argument("job", type=_job_ref)
    p_.add_argument("-f", "--follow", action="store_true", help="keep printing until the job ends")
    p_.add_argument("-n", "--lines", type=_int_in(p.Logs, "tail"), default=50, help="how many of the last events")
    p_.set_defaults(fn=cmd_logs)
    for verb, fn, what in (("pause", cmd_pause, "checkpoint and stop a job (or keep a queued one from starting)"),
                           ("resume", cmd_resume, "queue a paused job again"),
                           ("cancel", cmd_cancel, "stop a job for good (its checkpoints stay)"),
                           ("retry", cmd_retry, "queue a failed job again: it resumes from its checkpoints")):
        p_ = sub.add_parser(verb, parents=[common], help=what)
        p_.add_argument("job", type=_job_ref)
        p_.set_defaults(fn=fn)
    p_ = sub.add_parser("priority", parents=[common], help="set a job's priority (higher runs first)")
    p_.add_argument("job", type=_job_ref)
    p_.add_argument("priority", type=_int_in(p.SetPriority, "priority"), help="-1000 to 1000")
    p_.set_defaults(fn=cmd_priority)
    p_ = sub.add_parser("drain", parents=[common], help="checkpoint and stop running jobs; start no new ones")
    p_.add_argument("--off", action="store_true", help="take jobs again")
    p_.set_defaults(fn=cmd_drain)
    p_ = sub.add_parser("power", parents=[common], help="GPU power telemetry, caps and the tuned limit")
    p_.add_argument("--watch", action="store_true", help="a live view, redrawn every --interval seconds")
    p_.add_argument("--interval", type=_seconds, default=1.0)
    p_.add_argument("--limit", type=_watts, metavar="W", help="set a manual power limit in watts (through the power helper)")
    p_.add_argument("--gpu", type=_int_in(p.Power, "gpu"), metavar="N", help="the GPU for --limit (default: every GPU)")
    p_.add_argument("--clear", action="store_true", help="drop the manual limit")
    p_.set_defaults(fn=cmd_power)
    p_ = sub.add_parser("export", parents=[common], help="a saved step's LoRA files: list the steps, or copy one out")
    p_.add_argument("job", type=_job_ref)
    p_.add_argument("--step", type=_int_in(p.Exports, "step"), metavar="N", help="the step to copy (omit: list them)")
    p_.add_argument("--to", metavar="DIR", help="where to copy the files (default: ./ID-step-N/)")
    p_.add_argument("--force", action="store_true", help="overwrite files already in DIR")
    p_.set_defaults(fn=cmd_export)
    add_captions_parser(sub, common)
    p_ = sub.add_parser("web-url", parents=[common], help="the dashboard's address, with its token (open it once)")
    p_.set_defaults(fn=cmd_web_url)
    p_ = sub.add_parser("gpu", parents=[common], help="each GPU's health; `gpu clear N` takes back a GPU held out")
    p_.set_defaults(fn=cmd_gpu)
    gsub = p_.add_subparsers(dest="gpu_action", required=False, metavar="ACTION")
    p_ = gsub.add_parser("clear", parents=[common], help="forget GPU N's faults and schedule it again")
    p_.add_argument("gpu", type=_int_in(p.Gpu, "clear"), metavar="N", help="the GPU's NVML index")
    p_.set_defaults(fn=cmd_gpu)
    return ap


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(sys.argv[1:] if argv is None else argv)
    except BrokenPipeError:
        # Whoever read our output stopped (`lorad logs | head`): end quietly, as a tool killed by SIGPIPE would.
        # stdout now points at /dev/null so that the interpreter's last flush cannot complain either.
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        return EXIT_BROKEN_PIPE


def _main(argv: list[str]) -> int:
    try:
        args = build_parser().parse_args(argv)
    except UsageError as e:
        return fail("--json" in argv, "usage", str(e), EXIT_USAGE)
    if getattr(args, "needs_training_stack", False) and (missing := missing_training_stack()):
        print(f"lorad: `lorad {args.verb}` needs the training stack, which this installation lacks "
              f"({', '.join(missing)}): pip install 'lorad[train]'", file=sys.stderr)
        return EXIT_CONFIG
    from daemon.client.connection import DaemonDown

    as_json = getattr(args, "json", False)
    try:
        return args.fn(args)
    except DaemonDown as e:
        return fail(as_json, "unavailable", str(e).removeprefix("lorad: "), EXIT_UNAVAILABLE)
    except p.ProtocolError as e:  # the daemon answered with an error
        if e.code == "invalid_job":  # refused by the daemon's checks: the same verdict and exit as a local one
            return fail(as_json, e.code, f"invalid job: {e.message}", EXIT_INVALID_JOB)
        return fail(as_json, e.code, e.message, 1)


if __name__ == "__main__":
    sys.exit(main())
