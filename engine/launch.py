"""One job on several processes: torchrun around `python -m engine.run`, with the trainer contract kept.

    python -m engine.launch --nproc-per-node 2 [torchrun options] -- --job jobs/ID/job.yaml --workdir jobs/ID

torchrun (torch.distributed.run: its elastic agent, rendezvous and restarts)
starts and watches the ranks; this module adds only what the daemon's
contract with a trainer needs and torchrun does not give:

- One exit code for the job (0, 65, 69, 74, 75, or a crash): torchrun reports any
  non-zero rank as a failure and exits 1, which would turn a clean stop (75)
  or an invalid job (65) into a crash to retry.
- Signals reach every rank. torchrun starts each rank in a session of its own,
  so a signal to the launcher's process group never reaches them; we forward
  SIGTERM, SIGINT and SIGUSR1. The agent runs in a thread so that it installs
  no signal handlers: its own would SIGKILL the ranks 30 s after a SIGTERM,
  cutting a final checkpoint short.
- No orphans: every rank asks the kernel to SIGKILL it when the launcher dies
  (engine.distributed.liveness.die_with_parent), so a SIGKILLed launcher takes its
  ranks with it.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import sys
import threading
from pathlib import Path

from engine.distributed.liveness import LAUNCHER_PID
from engine.imports import unwalked_imports
from engine.training.stop import EXIT_INVALID, EXIT_IO, EXIT_OK, EXIT_OUT_OF_MEMORY, EXIT_STOPPED

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


def job_exit_code(rank_codes: dict[int, int], first_failed: int | None = None) -> int:
    """The job's exit code from its ranks' (negative: killed by that signal).

    An invalid job or an unwritable disk is the job's verdict whichever rank found it; every rank stopped
    cleanly (75, or 0 for a rank that had already finished) is a clean stop; anything else is a crash, reported
    with the code of the rank that failed first.
    """
    codes = set(rank_codes.values())
    for verdict in (EXIT_INVALID, EXIT_IO, EXIT_OUT_OF_MEMORY):
        if verdict in codes:
            return verdict
    if codes <= {EXIT_OK}:
        return EXIT_OK
    if codes <= {EXIT_OK, EXIT_STOPPED}:
        return EXIT_STOPPED
    first = rank_codes[first_failed] if first_failed in rank_codes else next(c for c in codes if c not in (0, 75))
    return 128 - first if first < 0 else first


def rank_pids() -> list[int]:
    """This process's children (the ranks torchrun started), from /proc: Linux, as the service is."""
    pids: list[int] = []
    for task in Path("/proc/self/task").iterdir():
        try:
            pids += [int(p) for p in (task / "children").read_text().split()]
        except OSError:
            continue
    return pids


def _forward(signum, frame) -> None:
    for pid in rank_pids():
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


def describe_failure(e: BaseException, endpoint: str) -> str:
    """One line for a launch that failed outside the ranks; the rendezvous failures say what to check."""
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError, RendezvousTimeoutError

    first = f"{type(e).__name__}: {e}".splitlines()[0]
    cause = e.__cause__ or e.__context__
    if cause is not None:
        first += f" ({type(cause).__name__}: {cause})".splitlines()[0]
    if isinstance(e, RendezvousConnectionError):
        return (f"cannot reach the rendezvous at {endpoint}: is the machine that hosts it up and its daemon running, "
                f"and is the port open between the machines? (docs/distributed.md, \"Several machines\") — {first}")
    if isinstance(e, RendezvousTimeoutError):
        return (f"the other machines did not join the rendezvous at {endpoint} in time: is the same job file "
                f"submitted to the daemon of every machine? — {first}")
    return first


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """(torchrun options, engine.run arguments), split at `--`."""
    if "--" not in argv:
        raise SystemExit("usage: python -m engine.launch [torchrun options] -- --job JOB --workdir DIR")
    i = argv.index("--")
    return argv[:i], argv[i + 1:]


def main(argv: list[str] | None = None) -> int:
    with unwalked_imports():
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
        from torch.distributed.run import parse_args, run

    launcher_args, trainer_args = split_argv(sys.argv[1:] if argv is None else argv)
    # max_restarts 0 unless asked: a crash of any rank stops all and is one crash of the job, which the daemon
    # retries (with backoff and a budget) from the last checkpoint.
    args = parse_args([*launcher_args, "-m", "engine.run", *trainer_args])
    outcome: dict[str, object] = {}

    def agent() -> None:
        try:
            run(args)
            outcome["code"] = EXIT_OK
        except ChildFailedError as e:
            first, _ = e.get_first_failure()
            outcome["code"] = job_exit_code({r: f.exitcode for r, f in e.failures.items()}, first)
            outcome["why"] = f"rank {first} exited {e.failures[first].exitcode}; every rank was stopped"
        except BaseException as e:  # noqa: BLE001 — rendezvous errors and the like: one line, a crash
            outcome["code"] = 1
            outcome["why"] = describe_failure(e, args.rdzv_endpoint)

    # torchrun warns that, on a thread, it cannot install its signal handlers and ranks could be orphaned: both are
    # handled here (the forwarding below, die_with_parent), so the warning would only mislead whoever reads the log.
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.ERROR)
    os.environ[LAUNCHER_PID] = str(os.getpid())  # the ranks die with this process (die_with_parent)
    for s in FORWARDED:
        signal.signal(s, _forward)
    # The ranks inherit the mask of the thread that starts them: with SIGUSR1 blocked, a "checkpoint now"
    # forwarded while a rank still imports torch waits until its handler is in place (engine.training.stop) instead of
    # killing it. This thread, which forwards, takes it at once.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    t = threading.Thread(target=agent, name="torchrun-agent", daemon=True)
    t.start()
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGUSR1})
    while t.is_alive():
        t.join(0.5)  # joined in slices so the main thread stays free to forward signals
    if "why" in outcome:
        print(f"lorad: {outcome['why']} (job exit {outcome['code']})", file=sys.stderr, flush=True)
    return int(outcome.get("code", 1))


if __name__ == "__main__":
    code = main()
    gc.freeze()  # as engine.run: no last full collection of torch's heap at exit (~0.16 s) before the daemon sees it
    sys.exit(code)
