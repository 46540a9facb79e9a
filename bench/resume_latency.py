"""Outage recovery: time from `lorad serve` start to the first resumed step after a SIGKILL, and steps lost.

    .venv/bin/python bench/resume_latency.py                  # the quickstart job, 3 kills
    .venv/bin/python bench/resume_latency.py --kills 5 --job configs/examples/quickstart.yaml

It starts `lorad serve` in a temporary home, drops the job into the inbox,
and then, --kills times: waits for a random step after the newest checkpoint, SIGKILLs the daemon and
its trainer together (a power cut, as far as lorad can tell), starts
`lorad serve` again and waits for the first training step after the
automatic resume. Per kill it prints:

    serve→ready     `lorad serve` started → socket answers (reconciliation done)
    serve→spawn     → the trainer's `start` event (python + torch + transformers imports)
    load            trainer `start` → `resumed` (model build/load + checkpoint verify/restore)
    serve→step      → the first step after the resume: the recovery latency
    lost            steps trained before the kill that were redone (kill step − resumed step)

and the checkpoint interval of the job (every_steps / every_seconds) for comparison.
The relative `data.path` of the job is made absolute before the job is dropped in.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from daemon.system.proc import find_trainers  # noqa: E402
from engine.report.events import read_events as events  # noqa: E402


def ts(e: dict) -> float:
    return datetime.fromisoformat(e["ts"].replace("Z", "+00:00")).timestamp()


def wait(pred, timeout: float, what: str, poll: float = 0.02):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        v = pred()
        if v:
            return v
        time.sleep(poll)
    raise SystemExit(f"timed out waiting for {what}")


def start_daemon(home: Path, config: Path, log) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "daemon.client.cli", "serve", "--home", str(home), "--config", str(config)],
                            stdout=log, stderr=subprocess.STDOUT, cwd=str(REPO))


def answers(sock: Path) -> bool:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(str(sock))
        s.sendall(b'{"verb": "ping"}\n')
        return b'"ok":true' in s.recv(4096)
    except OSError:
        return False
    finally:
        s.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--job", default=str(REPO / "configs" / "examples" / "quickstart.yaml"))
    ap.add_argument("--kills", type=int, default=3)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--keep", action="store_true", help="keep the temporary home")
    args = ap.parse_args()
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    rng = random.Random(seed)

    job_path = Path(args.job).resolve()
    job = yaml.safe_load(job_path.read_text())
    dp = Path(job["data"]["path"])
    job["data"]["path"] = str(dp if dp.is_absolute() else (job_path.parent / dp).resolve())
    total = job["train"]["steps"]
    ck = job.get("checkpoint", {})
    interval = f"every {ck.get('every_steps', 100)} steps / {ck.get('every_seconds', 60.0)} s"

    tmp = Path(tempfile.mkdtemp(prefix="lorad-bench-"))
    home = tmp / "home"
    config = tmp / "daemon.yaml"
    config.write_text(yaml.safe_dump({"allowed_roots": ["{home}", str(REPO), str(tmp), str(job_path.parent)],
                                      "tick_s": 0.1, "power": {"telemetry": {"backend": "off"}},
                                      "run_as_root": os.geteuid() == 0}))  # as root: no trainer user here
    log = open(tmp / "daemon.log", "ab")
    print(f"job {job_path.name}: {total} steps, checkpoint {interval}; seed {seed}; home {home}")

    d = start_daemon(home, config, log)
    wait(lambda: answers(home / "lorad.sock"), 120, "the daemon")
    (home / "inbox" / "bench.yaml").write_text(yaml.safe_dump(job, sort_keys=False))
    jobs = home / "jobs"
    workdir = wait(lambda: next(iter(jobs.iterdir()), None) if jobs.exists() else None, 60, "the job")

    def last_step() -> int:
        s = [e["step"] for e in events(workdir) if e.get("event") == "step"]
        return s[-1] if s else 0

    def committed() -> int:
        c = [e["step"] for e in events(workdir) if e.get("event") == "checkpoint_committed"]
        return max(c) if c else 0

    every = ck.get("every_steps") or 25
    rows = []
    resumed_from = 0
    for k in range(args.kills):
        # A kill lands a random number of steps after the newest checkpoint: what a power cut does.
        wait(lambda rf=resumed_from: committed() > rf, 900, "a new checkpoint")
        at = min(total - 2, committed() + rng.randint(1, max(1, every - 1)))
        wait(lambda at=at: last_step() >= at, 900, f"step {at}")
        d.send_signal(signal.SIGKILL)
        for t in find_trainers(jobs):
            os.kill(t.pid, signal.SIGKILL)
        d.wait()
        killed_at = last_step()
        n_events = len(events(workdir))
        wait(lambda: not find_trainers(jobs), 30, "the trainer to die")

        t0 = time.time()
        d = start_daemon(home, config, log)
        wait(lambda: answers(home / "lorad.sock"), 300, "the daemon")
        t_ready = time.time()

        def first_step_after_resume(n_events=n_events):
            new = events(workdir)[n_events:]
            start = next((e for e in new if e.get("event") == "start"), None)
            res = next((e for e in new if e.get("event") == "resumed"), None)
            if start is None or res is None:
                return None
            after = [e for e in new if e.get("event") == "step" and ts(e) >= ts(res)]
            return (start, res, after[0]) if after else None

        start, res, step = wait(first_step_after_resume, 600, "the first resumed step")
        resumed_from = res["from_step"]
        rows.append({"kill_step": killed_at, "resumed_from": resumed_from, "lost": killed_at - resumed_from,
                     "serve_ready_s": t_ready - t0, "serve_spawn_s": ts(start) - t0,
                     "load_s": ts(res) - ts(start), "serve_step_s": ts(step) - t0})
        r = rows[-1]
        print(f"kill {k + 1}: at step {r['kill_step']:>4}, resumed from {r['resumed_from']:>4} (lost {r['lost']:>3}); "
              f"serve→ready {r['serve_ready_s']:.2f} s, serve→spawn {r['serve_spawn_s']:.2f} s, "
              f"load {r['load_s']:.2f} s, serve→first step {r['serve_step_s']:.2f} s")

    d.send_signal(signal.SIGTERM)
    d.wait(300)
    print(f"median serve→first resumed step: {statistics.median(r['serve_step_s'] for r in rows):.2f} s "
          f"(of which trainer start + load {statistics.median(r['serve_step_s'] - r['serve_ready_s'] for r in rows):.2f} s); "
          f"steps lost per SIGKILL: {[r['lost'] for r in rows]} with checkpoints {interval}")
    if not args.keep:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
