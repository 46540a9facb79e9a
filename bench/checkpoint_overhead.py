"""What checkpointing costs: step time with a checkpoint every step vs none, and time to resume.

    .venv/bin/python bench/checkpoint_overhead.py                 # quickstart model, CPU, ~2 minutes
    .venv/bin/python bench/checkpoint_overhead.py --steps 60 --rounds 3 --skip-resume

1. Overhead. The quickstart job (builtin tiny-llama, seq_len 128, batch 4)
   trains in THIS process, alternating settings round by round:
   `none` (checkpoint.every_steps and every_seconds off: only the final save),
   `every` (every_steps: 1 — a new save starts as soon as the previous one is
   done, at most one in flight; the writer thread niced as shipped,
   $LORAD_CKPT_WRITER_NICE default 19) and `every-nice0` (the same with the
   writer at the training threads' priority, the engine before that change).
   A step's time is the gap between
   consecutive `step` events, so it includes the host snapshot taken at the
   step boundary and any contention from the background writer. The first
   --warmup steps of each run are dropped. Ratio = median(mode) / median(none)
   within each round (back-to-back runs see the same machine load), then the
   median over rounds; the target for `every` is < 1.05. `saves committed`
   shows how often the niced writer actually got to save.

2. Resume latency. `lorad run` (a real child process) trains the same job
   until a checkpoint is committed, is stopped (SIGTERM, then separately
   SIGKILL), and is started again; we time from the start of the second
   `lorad run` to its `resumed` event and to its first training step.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
QUICKSTART = REPO / "configs" / "examples" / "quickstart.yaml"


def job_dict(steps: int, every_steps: int | None, name: str) -> dict:
    d = yaml.safe_load(QUICKSTART.read_text())
    d["name"] = name
    d["data"]["path"] = str((QUICKSTART.parent / d["data"]["path"]).resolve())
    d["train"]["steps"] = steps
    d["train"]["warmup_steps"] = min(d["train"].get("warmup_steps", 0), steps)
    d["checkpoint"] = {"every_steps": every_steps, "every_seconds": None, "keep": 3}
    return d


def iso_to_s(ts: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(ts.replace("Z", "+00:00")).timestamp()


def step_times(workdir: Path, warmup: int) -> tuple[list[float], int]:
    events = [json.loads(x) for x in (workdir / "events.jsonl").read_text().splitlines() if x.strip()]
    ts = [iso_to_s(e["ts"]) for e in events if e["event"] == "step"]
    saves = sum(1 for e in events if e["event"] == "checkpoint_committed")
    gaps = [b - a for a, b in zip(ts, ts[1:], strict=False)]
    return gaps[warmup:], saves


def overhead(steps: int, rounds: int, warmup: int, root: Path) -> dict:
    """Per round, one run of each mode back to back; ratios are taken within a round, then the median.

    On a shared machine the load drifts over minutes; runs seconds apart see nearly the same load, so
    the per-round ratio cancels most of it. Process CPU seconds (all threads) are printed too; they
    include torch's spin-waiting threads, so they are no measure of what a save costs.
    """
    import resource

    from engine.config.job import parse_job
    from engine.recipe import train

    modes = {"none": (None, "19"), "every": (1, "19"), "every-nice0": (1, "0")}
    times: dict[str, list[float]] = {m: [] for m in modes}
    saves: dict[str, int] = {m: 0 for m in modes}
    cpu: dict[str, float] = {m: 0.0 for m in modes}
    round_ratios: dict[str, list[float]] = {m: [] for m in modes}
    for r in range(rounds):
        med_r = {}
        for mode, (every, nice) in modes.items():
            cfg = parse_job(job_dict(steps, every, f"bench-{mode}"), REPO)
            wd = root / f"{mode}-{r}"
            os.environ["LORAD_CKPT_WRITER_NICE"] = nice
            ru0 = resource.getrusage(resource.RUSAGE_SELF)
            rc = train(cfg, wd, progress="none")
            ru1 = resource.getrusage(resource.RUSAGE_SELF)
            assert rc == 0, f"{mode} run exited {rc}"
            cpu[mode] += (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
            t, s = step_times(wd, warmup)
            times[mode] += t
            saves[mode] += s
            med_r[mode] = statistics.median(t)
        for m in modes:
            round_ratios[m].append(med_r[m] / med_r["none"])
        print(f"round {r}: " + ", ".join(f"{m} {med_r[m]:.4f} s/step" for m in modes)
              + f" (load {os.getloadavg()[0]:.2f})", flush=True)
    os.environ.pop("LORAD_CKPT_WRITER_NICE", None)
    return {"median_s": {m: statistics.median(v) for m, v in times.items()},
            "ratio": {m: statistics.median(v) for m, v in round_ratios.items()},
            "saves": saves, "cpu_s": cpu,
            "n": {m: len(v) for m, v in times.items()}}


def _tail_events(path: Path, seen: int) -> tuple[list[dict], int]:
    if not path.exists():
        return [], seen
    lines = path.read_text().splitlines()
    return [json.loads(x) for x in lines[seen:] if x.strip()], len(lines)


def resume_latency(how: str, steps: int, root: Path) -> dict:
    home = root / f"home-{how}"
    job = root / f"resume-{how}.yaml"
    job.write_text(yaml.safe_dump(job_dict(steps, 10, "bench-resume")))
    events = home / "jobs" / "bench-resume" / "events.jsonl"
    argv = [sys.executable, "-m", "daemon.client.cli", "run", str(job), "--home", str(home), "--quiet"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}

    first = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    seen = 0
    while True:
        new, seen = _tail_events(events, seen)
        if any(e["event"] == "checkpoint_committed" for e in new):
            break
        if first.poll() is not None:
            raise RuntimeError(f"first run exited {first.returncode} before a checkpoint")
        time.sleep(0.01)
    first.send_signal(signal.SIGTERM if how == "SIGTERM" else signal.SIGKILL)
    rc1 = first.wait()

    t0 = time.monotonic()
    second = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    t_resumed = t_step = None
    from_step = in_process = None
    while t_step is None:
        new, seen = _tail_events(events, seen)
        now = time.monotonic() - t0
        for e in new:
            if e["event"] == "resumed" and t_resumed is None:
                t_resumed, from_step, in_process = now, e["from_step"], e.get("seconds_since_start")
            elif e["event"] == "step" and t_resumed is not None:
                t_step = now
                break
        if second.poll() is not None and t_step is None:
            raise RuntimeError(f"second run exited {second.returncode} before a resumed step")
        time.sleep(0.005)
    second.send_signal(signal.SIGKILL)
    second.wait()
    return {"stop": how, "first_rc": rc1, "from_step": from_step, "to_resumed_s": t_resumed,
            "to_first_step_s": t_step, "in_process_s": in_process}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=25, help="steps per overhead run")
    ap.add_argument("--rounds", type=int, default=4, help="rounds of back-to-back runs, one per mode")
    ap.add_argument("--warmup", type=int, default=3, help="step gaps dropped at the start of each run")
    ap.add_argument("--skip-resume", action="store_true")
    args = ap.parse_args()
    torch_threads = __import__("torch").get_num_threads()
    print(f"command: {' '.join([Path(sys.executable).name, *sys.argv])}")
    print(f"machine: {os.cpu_count()} CPUs, torch threads {torch_threads}, load {os.getloadavg()[0]:.2f}")
    with tempfile.TemporaryDirectory(prefix="lorad-bench-") as tmp:
        root = Path(tmp)
        o = overhead(args.steps, args.rounds, args.warmup, root)
        print("\n| checkpoints | steps timed | saves committed | median s/step (all rounds) | "
              "median of per-round ratios to none | process CPU s |")
        print("|---|---:|---:|---:|---:|---:|")
        for m in o["n"]:
            print(f"| {m} | {o['n'][m]} | {o['saves'][m]} | {o['median_s'][m]:.4f} | {o['ratio'][m]:.3f} | "
                  f"{o['cpu_s'][m]:.1f} |")
        verdict = "meets" if o["ratio"]["every"] < 1.05 else "MISSES"
        print(f"\nstep-time ratio every/none = {o['ratio']['every']:.3f} ({verdict} the < 1.05 target); "
              f"load average now {os.getloadavg()[0]:.2f}")
        if not args.skip_resume:
            print("\n| stopped by | first run rc | resumed from | start → resumed (s) | start → first step (s) | in-process start → resumed (s) |")
            print("|---|---:|---:|---:|---:|---:|")
            for how in ("SIGTERM", "SIGKILL"):
                r = resume_latency(how, 400, root)
                print(f"| {r['stop']} | {r['first_rc']} | {r['from_step']} | {r['to_resumed_s']:.2f} | "
                      f"{r['to_first_step_s']:.2f} | {r['in_process_s']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
