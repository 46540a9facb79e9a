"""Outage recovery: time from `lorad serve` start (or a trainer's death) to the first resumed step, and steps lost,
with the warm trainer off (every trainer imports torch & co. itself) and on (forked from a pre-imported process),
measured in one run, one after the other.

    .venv/bin/python bench/resume_latency.py                  # the quickstart job, 3 kills of each kind, off and on
    .venv/bin/python bench/resume_latency.py --kills 5 --job configs/examples/quickstart.yaml --warm on

For each setting it starts `lorad serve` in a temporary home, drops the job into the inbox, and then --kills
times each: waits for a random step after the newest checkpoint and SIGKILLs
  daemon    the daemon and its trainer together (a power cut, as far as lorad can tell), then starts
            `lorad serve` again; times count from that start;
  trainer   the trainer alone (the daemon retries it at once: backoff_base_s is 0 here); times count from the kill;
and waits for the first training step after the automatic resume. Per kill it prints:

    t0→ready        (daemon kills) `lorad serve` started → socket answers (reconciliation done)
    t0→spawn        → the trainer's `start` event (python + torch + transformers imports, unless forked warm)
    load            trainer `start` → `resumed` (model build/load + checkpoint verify/restore)
    t0→step         → the first step after the resume: the recovery latency
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


def measure(args, job: dict, total: int, every: int, warm: bool, rng: random.Random) -> list[dict]:
    """One daemon home, one setting: --kills daemon kills, then --kills trainer kills. The rows, one per kill."""
    tmp = Path(tempfile.mkdtemp(prefix="lorad-bench-"))
    home, config = tmp / "home", tmp / "daemon.yaml"
    config.write_text(yaml.safe_dump({"allowed_roots": ["{home}", str(REPO), str(tmp), args.job_dir],
                                      "tick_s": 0.1, "power": {"telemetry": {"backend": "off"}},
                                      "backoff_base_s": 0.0, "warm_trainer": warm,
                                      "run_as_root": os.geteuid() == 0}))  # as root: no trainer user here
    log = open(tmp / "daemon.log", "ab")
    d = start_daemon(home, config, log)
    wait(lambda: answers(home / "lorad.sock"), 120, "the daemon")
    (home / "inbox" / "bench.yaml").write_text(yaml.safe_dump(job, sort_keys=False))
    jobs = home / "jobs"
    workdir = wait(lambda: next(iter(jobs.iterdir()), None) if jobs.exists() else None, 60, "the job")

    def steps(kind: str) -> list[int]:
        return [e["step"] for e in events(workdir) if e.get("event") == kind]

    rows: list[dict] = []
    resumed_from = 0
    for k, kind in enumerate(["daemon"] * args.kills + ["trainer"] * args.kills):
        # A kill lands a random number of steps after the newest checkpoint: what a power cut does.
        wait(lambda rf=resumed_from: max(steps("checkpoint_committed"), default=0) > rf, 900, "a new checkpoint")
        at = min(total - 2, max(steps("checkpoint_committed")) + rng.randint(1, max(1, every - 1)))
        wait(lambda at=at: max(steps("step"), default=0) >= at, 900, f"step {at}")
        trainers = find_trainers(jobs)
        if kind == "daemon":
            d.send_signal(signal.SIGKILL)
        for t in trainers:
            os.kill(t.pid, signal.SIGKILL)
        t0 = time.time()
        killed_at, n_events = max(steps("step")), len(events(workdir))
        if kind == "daemon":
            d.wait()
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
        rows.append({"kind": kind, "kill_step": killed_at, "resumed_from": resumed_from,
                     "lost": killed_at - resumed_from, "ready_s": t_ready - t0 if kind == "daemon" else None,
                     "spawn_s": ts(start) - t0, "load_s": ts(res) - ts(start), "step_s": ts(step) - t0})
        r = rows[-1]
        ready = f"t0→ready {r['ready_s']:.2f} s, " if kind == "daemon" else ""
        print(f"  warm {'on ' if warm else 'off'} kill {k + 1} ({kind:>7}): at step {r['kill_step']:>4}, resumed from "
              f"{r['resumed_from']:>4} (lost {r['lost']:>3}); {ready}t0→spawn {r['spawn_s']:.2f} s, "
              f"load {r['load_s']:.2f} s, t0→first step {r['step_s']:.2f} s", flush=True)
    d.send_signal(signal.SIGTERM)
    d.wait(300)
    if not args.keep:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--job", default=str(REPO / "configs" / "examples" / "quickstart.yaml"))
    ap.add_argument("--kills", type=int, default=3, help="kills of each kind (daemon+trainer, trainer alone)")
    ap.add_argument("--warm", choices=["both", "off", "on"], default="both")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--keep", action="store_true", help="keep the temporary homes")
    args = ap.parse_args()
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)

    job_path = Path(args.job).resolve()
    args.job_dir = str(job_path.parent)
    job = yaml.safe_load(job_path.read_text())
    dp = Path(job["data"]["path"])
    job["data"]["path"] = str(dp if dp.is_absolute() else (job_path.parent / dp).resolve())
    total = job["train"]["steps"]
    ck = job.get("checkpoint", {})
    interval = f"every {ck.get('every_steps', 100)} steps / {ck.get('every_seconds', 60.0)} s"
    print(f"job {job_path.name}: {total} steps, checkpoint {interval}; seed {seed}")
    settings = {"both": [False, True], "off": [False], "on": [True]}[args.warm]
    results = {w: measure(args, job, total, ck.get("every_steps") or 25, w, random.Random(seed)) for w in settings}
    for w, rows in results.items():
        for kind in ("daemon", "trainer"):
            sel = [r for r in rows if r["kind"] == kind]
            print(f"warm {'on ' if w else 'off'}, {kind:>7} killed: median t0→first resumed step "
                  f"{statistics.median(r['step_s'] for r in sel):.2f} s (t0→trainer start "
                  f"{statistics.median(r['spawn_s'] for r in sel):.2f} s, load {statistics.median(r['load_s'] for r in sel):.2f} s); "
                  f"steps lost {[r['lost'] for r in sel]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
