"""A resume never compiles twice: a tiny FLUX job with `train.compile: true`, killed after its first checkpoint and
resumed, with the compile cache it persisted in the home (warm) and without it (cold), measured in one run.

    .venv/bin/python bench/compile_cache.py                 # CPU inductor (needs a C++ compiler), ~5 minutes
    .venv/bin/python bench/compile_cache.py --repeats 2     # each resume twice, the medians

1. The job trains in a temporary home (HOME/jobs/bench-1) as the daemon would run it (`python -m engine.run`), and
   is SIGKILLed as soon as its first checkpoint is committed. By then the trainer has saved its compile cache
   (HOME/cache/compile/KEY.bin, engine/frozen_base/compiling.py).
2. The killed home is copied twice; in the "cold" copy the compile cache is removed. Each copy's trainer resumes
   from the same checkpoint, and is killed at its first step.
3. The trainer keeps inductor's cache directory in the home too (HOME/cache/compile/KEY.d, committed with a
   manifest): the cold copy has none of it. Every trainer also gets its own empty Triton cache and default
   inductor directory, so that nothing in /tmp, which outlives a process, can make the cold resume warm.

Printed per resume: start→first step (from the process's spawn to its first `step` line: imports, model load,
checkpoint restore, compile and the step itself), and the compile cache's status as the trainer saw it. The last
line ends with the ratio warm ÷ cold of the start→first-step times (target ≤ 0.5).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
JOB = REPO / "configs" / "examples" / "flux-lora-tiny.yaml"


def job_file(root: Path) -> Path:
    d = yaml.safe_load(JOB.read_text())
    d["data"]["path"] = str((JOB.parent / d["data"]["path"]).resolve())
    d["train"].update(steps=6, compile=True)
    d.pop("sample", None)  # sampling would add its own (no-grad) compiles to the first run only
    d["checkpoint"] = {"every_steps": 2, "every_seconds": None, "keep": 2}
    path = root / "job.yaml"
    path.write_text(yaml.safe_dump(d, sort_keys=False))
    return path


def run_until(job: Path, workdir: Path, event: str, scratch: Path, timeout: float,
              then: str | None = None) -> tuple[float, list[dict]]:
    """Start the trainer on `workdir`; SIGKILL it at its first `event` line (or at the `then` line after it); the
    seconds from spawn to the `event` line."""
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(scratch / "inductor"), TRITON_CACHE_DIR=str(scratch / "triton"),
               TORCHINDUCTOR_COMPILE_THREADS="1", PYTHONPATH=str(REPO))
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "engine.run", "--job", str(job), "--workdir", str(workdir)],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    seen: list[dict] = []
    at = None
    try:
        for line in proc.stdout:
            if time.monotonic() - t0 > timeout:
                raise SystemExit(f"timed out waiting for {event}")
            try:
                ev = json.loads(line)
            except ValueError:
                continue
            seen.append(ev)
            if ev.get("event") == event and at is None:
                at = time.monotonic() - t0
            if at is not None and ev.get("event") == (then or event):
                return at, seen
        if at is not None:
            return at, seen
        raise SystemExit(f"the trainer exited ({proc.wait()}) before {event}")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def cache_status(events: list[dict]) -> str:
    said = [e.get("status") for e in events if e.get("event") == "compile_cache"]
    return said[0] if said else "-"


def served(events: list[dict]) -> str:
    """What inductor's and AOTAutograd's caches served, from the trainer's `compile_stats` events so far."""
    stats = [e for e in events if e.get("event") == "compile_stats"]
    if not stats:
        return "no compile_stats yet"
    s = stats[-1]
    return (f"{s['graphs']} graph(s); FX graph cache {s['fxgraph_hit']} hit / {s['fxgraph_miss']} miss / "
            f"{s['fxgraph_bypass']} bypass; AOTAutograd cache {s['aot_hit']} hit / {s['aot_miss']} miss / "
            f"{s['aot_bypass']} bypass")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=1, help="resumes of each kind (medians printed)")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds allowed per trainer run")
    args = ap.parse_args()

    root = Path(tempfile.mkdtemp(prefix="lorad-compile-cache-"))
    try:
        job = job_file(root)
        home = root / "home"
        first = home / "jobs" / "bench-1"
        t, evs = run_until(job, first, "checkpoint_committed", root / "scratch-first", args.timeout)
        files = sorted((home / "cache" / "compile").glob("*.bin"))
        if not files:
            raise SystemExit("the first run saved no compile cache")
        step = next(e["step"] for e in evs if e.get("event") == "checkpoint_committed")
        print(f"first run: cold compile, killed after its checkpoint at step {step} ({t:.1f} s); "
              f"compile cache {files[0].name} ({files[0].stat().st_size / 1e6:.2f} MB); {served(evs)}")

        times: dict[str, list[float]] = {"cold": [], "warm": []}
        for r in range(args.repeats):
            for kind in ("cold", "warm"):
                copy = root / f"{kind}-{r}"
                shutil.copytree(home, copy / "home")
                if kind == "cold":
                    shutil.rmtree(copy / "home" / "cache" / "compile")
                workdir = copy / "home" / "jobs" / "bench-1"
                # killed once the first step's compile_stats (said right after the step) is out
                t, evs = run_until(job, workdir, "step", copy / "scratch", args.timeout, then="compile_stats")
                resumed = next((e["from_step"] for e in evs if e.get("event") == "resumed"), None)
                print(f"resume {r + 1} {kind}: from step {resumed}, compile cache {cache_status(evs)}, "
                      f"start→first step {t:.2f} s ({served(evs)})")
                times[kind].append(t)
                shutil.rmtree(copy)
        cold, warm = statistics.median(times["cold"]), statistics.median(times["warm"])
        print(f"resumed trainer start→first step (CPU inductor, tiny FLUX, train.compile: true): cold cache "
              f"{cold:.2f} s, persisted cache {warm:.2f} s; warm ÷ cold = {warm / cold:.2f}×")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
