"""Power-limit sweep: s/step and J/step at each power limit, and the saving at the limit the tuner picks.

    python bench/power_tune.py --job configs/examples/quickstart.yaml      # on a GPU (NVML, root for limits)
    python bench/power_tune.py --simulated                                 # anywhere: the simulated device

On a GPU it runs one real LoRA job (`python -m engine.run`) as a child and,
between its step heartbeats, walks the limits from the maximum down to the
minimum constraint: `--warmup` steps to settle, then `--measure` steps timed
by heartbeat arrival with energy from NVML's total-energy counter. The limit
is restored at the end. If the driver refuses a limit (not root), that is
printed and the row shows the telemetry read at the limit the driver kept.

Without NVML (or with --simulated) the same sweep runs on the model in
daemon/power/simulated.py, and every line says SIMULATED.

The baseline is the default limit, measured in the same run; the pick is
daemon.power.tuner.choose (lowest J/step within --max-slowdown of the fastest).
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from daemon.power import simulated as simmod  # noqa: E402
from daemon.power.gpu import CapRefused, Device  # noqa: E402
from daemon.power.telemetry import NvmlDevice  # noqa: E402
from daemon.power.tuner import Point, choose  # noqa: E402


class _Log:
    def __getattr__(self, level):
        return lambda event, **kw: print(f"# {level}: {event} {kw}", file=sys.stderr)


def sweep_limits(lo: float, hi: float, n: int, default: float) -> list[float]:
    out = [round(hi - (hi - lo) * i / (n - 1)) for i in range(n)]
    if round(default) not in out:
        out.append(round(default))
    return sorted(set(float(w) for w in out), reverse=True)


def measure_simulated(limits: list[float], warmup: int, measure: int) -> tuple[list[Point], str]:
    clock = [0.0]
    dev = simmod.SimulatedDevice(1, clock=lambda: clock[0])
    dev.set_busy(0, True)
    pts = []
    for w in limits:
        dev.set_limit_w(0, w)
        for _ in range(warmup):
            clock[0] += dev.step_time_s(0)
        t0, e0 = clock[0], dev.energy_mj(0)
        for _ in range(measure):
            clock[0] += dev.step_time_s(0)
        pts.append(Point(w, (clock[0] - t0) / measure, (dev.energy_mj(0) - e0) / 1000.0 / measure))
    return pts, simmod.MODEL_NAME


def _heartbeats(proc: subprocess.Popen, q: queue.Queue) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        try:
            ev = json.loads(line)
        except ValueError:
            continue
        if ev.get("event") == "step":
            q.put((time.monotonic(), int(ev["step"])))
    q.put(None)


def measure_gpu(dev: Device, gpu: int, job: Path, limits: list[float], warmup: int, measure: int,
                timeout_s: float) -> tuple[list[Point], list[str]]:
    import yaml

    from engine.config.job import load_job

    load_job(job)  # a bad job file fails here, with the engine's message
    raw = yaml.safe_load(job.read_text())
    for sec, key in (("data", "path"), ("model", "path")):  # the copy lives elsewhere: relative paths go absolute
        v = raw.get(sec, {}).get(key)
        if isinstance(v, str) and (job.parent / v).exists():
            raw[sec][key] = str((job.parent / v).resolve())
    need = len(limits) * (warmup + measure) + 20  # the sweep must fit in the job
    raw.setdefault("train", {})["steps"] = max(int(raw["train"].get("steps", 0)), need)
    raw["checkpoint"] = {"every_steps": raw["train"]["steps"], "every_seconds": None}  # no saves while measuring
    work = Path(tempfile.mkdtemp(prefix="lorad-power-bench-"))
    (work / "job.yaml").write_text(yaml.safe_dump(raw))
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=str(gpu), PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "engine.run", "--job", str(work / "job.yaml"), "--workdir",
                             str(work)], cwd=REPO, env=env, stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    q: queue.Queue = queue.Queue()
    threading.Thread(target=_heartbeats, args=(proc, q), daemon=True).start()
    deadline = time.monotonic() + timeout_s
    problems: list[str] = []

    def next_step() -> tuple[float, int]:
        item = q.get(timeout=max(1.0, deadline - time.monotonic()))
        if item is None:
            raise RuntimeError(f"trainer exited early (code {proc.wait()})")
        return item

    original = dev.limit_w(gpu)
    pts = []
    try:
        next_step()  # first step: model loaded, compiled, warm
        for w in limits:
            try:
                dev.set_limit_w(gpu, w)
            except CapRefused as e:
                problems.append(str(e))
            for _ in range(warmup):
                next_step()
            t0, _ = next_step()
            e0 = dev.energy_mj(gpu)
            for _ in range(measure):
                t1, _ = next_step()
            e1 = dev.energy_mj(gpu)
            pts.append(Point(dev.limit_w(gpu), (t1 - t0) / measure, (e1 - e0) / 1000.0 / measure))
    finally:
        try:
            dev.set_limit_w(gpu, original)
        except CapRefused as e:
            problems.append(f"restore: {e}")
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
    return pts, problems


def report(pts: list[Point], default_w: float, max_slowdown: float, label: str, model: str) -> str:
    tag = "SIMULATED " if "SIMULATED" in label.upper() or model.startswith("SIMULATED") else ""
    lines = [f"{tag}power sweep on {model} ({label})", "",
             "| limit W | s/step | J/step | vs default: time | vs default: energy |",
             "|---:|---:|---:|---:|---:|"]
    base = min(pts, key=lambda p: abs(p.limit_w - default_w))
    for p in pts:
        lines.append(f"| {p.limit_w:.0f} | {p.s_per_step:.4f} | {p.j_per_step:.1f} | "
                     f"{p.s_per_step / base.s_per_step - 1:+.1%} | {p.j_per_step / base.j_per_step - 1:+.1%} |")
    best = choose(pts, max_slowdown)
    assert best is not None
    lines += ["", f"{tag}chosen limit (max_slowdown {max_slowdown:.0%}): {best.limit_w:.0f} W vs default "
              f"{base.limit_w:.0f} W: {1 - best.j_per_step / base.j_per_step:.1%} fewer J/step, "
              f"{best.s_per_step / base.s_per_step - 1:+.1%} s/step"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--job", default=str(REPO / "configs" / "examples" / "quickstart.yaml"))
    ap.add_argument("--gpu", type=int, default=0)
    ap.add_argument("--limits", type=int, default=8, help="how many limits from max to min constraint")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--measure", type=int, default=20)
    ap.add_argument("--max-slowdown", type=float, default=0.10)
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--simulated", action="store_true", help="use the simulated device even if NVML works")
    a = ap.parse_args(argv)

    dev = None
    if not a.simulated:
        try:
            dev = NvmlDevice(_Log())
        except Exception as e:
            print(f"# NVML unavailable ({type(e).__name__}: {e}); running on the SIMULATED device")
    if dev is None:
        lim = sweep_limits(simmod.MIN_W, simmod.MAX_W, a.limits, simmod.DEFAULT_W)
        pts, model = measure_simulated(lim, a.warmup, a.measure)
        print(report(pts, simmod.DEFAULT_W, a.max_slowdown, "SIMULATED", model))
        return 0
    info = dev.info(a.gpu)
    lim = sweep_limits(info.min_w, info.max_w, a.limits, info.default_w)
    pts, problems = measure_gpu(dev, a.gpu, Path(a.job), lim, a.warmup, a.measure, a.timeout)
    for p in problems:
        print(f"# limit refused: {p}")
    print(report(pts, info.default_w, a.max_slowdown, f"measured, job {Path(a.job).name}", info.name))
    dev.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
