"""The mirror's storage server killed mid-upload and started again later, while a job trains under `lorad serve`:
the job's step time against the same job without a mirror, and the mirror catching up.

    .venv/bin/python bench/mirror_faults.py                       # SFTP (sshd on loopback), down 60 s, 3 pairs
    .venv/bin/python bench/mirror_faults.py --backend s3 --down-s 20 --steps 600 --pairs 5

Runs the quickstart job made lighter (tiny-llama on CPU, batch 2, LoRA on q/v, a checkpoint every --every steps)
in --pairs interleaved pairs, each run in a fresh home: A B, B A, A B, ... (A: no mirror; B: a mirror whose server,
started on loopback by tests/helpers/storage.py, is SIGKILLed while the run's first checkpoint upload is in flight,
and started again --down-s seconds later; each file's upload is made to last LORAD_DEBUG_MIRROR_FILE_DELAY_S, so
that "mid-upload" is a window we can hit). The machine's other load drifts over minutes; a pair's two runs are
neighbours and the order alternates, so a drift weighs on both sides alike. It prints, per pair, the median step
time (from the step events' timestamps) of both runs and their ratio, then the median of the pairs' ratios (bar:
1.10; the trainer never waits for the mirror, so only the uploader's CPU can cost it anything), the load average
before and after each run, and whether each mirror caught up: its newest complete checkpoint is the job's last and
its output is there, with no error left. (moto keeps nothing across a restart: with --backend s3 the bucket is made
again, and what it catches up on is what came after.)

Each B run lasts at least its first commit + --down-s + the catch-up; the default (3 pairs, 400 steps, down 60 s)
is six runs of roughly a minute each where the job trains at about 0.1 s/step.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
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
sys.path.insert(0, str(REPO / "bench"))

from inbox_flood import step_times as step_events  # noqa: E402 - (wall time, gap) per step

from daemon.config.mirrors import MirrorSettings  # noqa: E402
from daemon.mirror.remote import Remote  # noqa: E402
from daemon.mirror.uploader import newest_remote  # noqa: E402
from tests.helpers import storage  # noqa: E402

QUICKSTART = REPO / "configs" / "examples" / "quickstart.yaml"


def job(steps: int, every: int, seq_len: int) -> dict:
    d = yaml.safe_load(QUICKSTART.read_text())
    d["data"]["path"] = str(REPO / "configs" / "examples" / d["data"]["path"])
    d["data"]["seq_len"] = seq_len
    d["train"].update(steps=steps, batch_size=2)
    d["lora"]["targets"] = ["q_proj", "v_proj"]  # lighter than the quickstart: a short run still spans the fault
    d["checkpoint"] = {"every_steps": every, "every_seconds": None, "keep": 2}
    return d


def step_times(workdir: Path) -> list[float]:
    """Seconds between consecutive step events (events.jsonl's timestamps)."""
    return [gap for _t, gap in step_events(workdir)]


def lorad(home: Path, *args: str) -> dict:
    r = subprocess.run([sys.executable, "-m", "daemon.client.cli", *args, "--home", str(home), "--json"],
                       capture_output=True, text=True, cwd=REPO, timeout=120)
    if r.returncode != 0:
        raise SystemExit(f"lorad {' '.join(args)}: {r.stderr}")
    return json.loads(r.stdout)


def serve(root: Path, name: str, cfg: dict, env: dict[str, str]) -> tuple[subprocess.Popen, Path]:
    home = root / name
    home.mkdir()
    (root / f"{name}.yaml").write_text(yaml.safe_dump(cfg))
    log = open(root / f"{name}.log", "ab")
    proc = subprocess.Popen([sys.executable, "-m", "daemon.client.cli", "serve", "--home", str(home), "--config",
                             str(root / f"{name}.yaml")], stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                            env={**os.environ, **env,  # its trainers import this tree's engine, as it does
                                 "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")})
    deadline = time.monotonic() + 60
    while not (home / "lorad.sock").exists():
        if time.monotonic() > deadline or proc.poll() is not None:
            raise SystemExit(f"lorad serve did not start: {(root / f'{name}.log').read_text()[-2000:]}")
        time.sleep(0.1)
    return proc, home


def train(root: Path, name: str, cfg: dict, args: argparse.Namespace, env: dict[str, str], during=None) -> dict:
    """One run of the job to its end; `during(workdir, job_id)` runs meanwhile. Its job row and step times."""
    proc, home = serve(root, name, cfg, env)
    try:
        (root / "job.yaml").write_text(yaml.safe_dump(job(args.steps, args.every, args.seq_len)))
        jid = lorad(home, "submit", str(root / "job.yaml"))["job"]
        workdir = home / "jobs" / jid
        if during is not None:
            during(workdir, jid)
        while (j := lorad(home, "status", jid)["job"])["state"] not in ("succeeded", "failed"):
            time.sleep(0.5)
        if j["state"] != "succeeded":
            raise SystemExit(f"{name}: the job {j['state']}: {j.get('last_error')}")
        print(f"{name}: done in {time.time() - j['submitted_at']:.0f} s", flush=True)
        return {"job": j, "home": home, "jid": jid, "times": step_times(workdir), "proc": proc}
    except BaseException:
        proc.terminate()  # a clean stop: the daemon stops its trainer too
        proc.wait(180)
        raise


def committed(workdir: Path) -> bool:
    path = workdir / "events.jsonl"
    return path.exists() and '"checkpoint_committed"' in path.read_text()


def run(args: argparse.Namespace, root: Path) -> list[dict]:
    server = storage.start_s3(root) if args.backend == "s3" else storage.start_sftp(root)
    try:
        return measure(args, root, server)
    finally:
        server.server.kill()


def measure(args: argparse.Namespace, root: Path, server) -> list[dict]:
    """--pairs pairs, A B then B A alternately, each run in a fresh home: per pair, each run's step times, load."""
    base = {"tick_s": 0.25, "power": {"telemetry": {"backend": "off"}}, "web": {"enabled": False},
            "run_as_root": True, "allowed_roots": ["{home}", str(REPO)]}
    pairs = []
    for i in range(args.pairs):
        pair: dict = {"order": "AB" if i % 2 == 0 else "BA"}
        for kind in pair["order"]:
            name = f"{'plain' if kind == 'A' else 'mirrored'}-{i + 1}"
            load = os.getloadavg()[0]
            if kind == "A":
                r = train(root, name, base, args, {})
                r["proc"].terminate()
                r["proc"].wait(180)
            else:
                r = mirrored_run(args, root, server, base, name)
            pair[kind] = {"times": r["times"], "faults": r.get("faults"), "load": (load, os.getloadavg()[0])}
        pairs.append(pair)
    return pairs


def mirrored_run(args: argparse.Namespace, root: Path, server, base: dict, name: str) -> dict:
    """One B run: the server killed mid-upload of the first checkpoint, back --down-s later; then the catch-up."""
    mirror = server.mirror(f"bench-{name}", retry_base_s=1.0, retry_max_s=10.0)
    faults: dict = {}

    def fault(workdir: Path, jid: str) -> None:
        while not committed(workdir):
            time.sleep(0.05)
        time.sleep(args.kill_after_s)  # the first upload is under way (each file takes the debug delay)
        faults["killed_at"] = time.time()
        server.server.kill()
        print(f"{name}: server killed mid-upload; back in {args.down_s:.0f} s", flush=True)
        time.sleep(args.down_s)
        server.restart()
        faults["back_at"] = time.time()
        print(f"{name}: server back", flush=True)

    env = {"LORAD_DEBUG_MIRROR_FILE_DELAY_S": str(args.file_delay_s)}
    cfg = {**base, "mirrors": {"off": mirror}, "default_mirror": "off"}
    mirrored = train(root, name, cfg, args, env, during=fault)
    try:
        remote = Remote("off", MirrorSettings.model_validate(mirror))
        deadline, lag = time.monotonic() + args.catch_up_s, {}
        while time.monotonic() < deadline:
            lag = lorad(mirrored["home"], "status", mirrored["jid"])["job"]["mirror"] or {}
            if lag.get("caught_up") and not lag.get("last_error"):
                break
            time.sleep(0.5)
        faults["caught_up_at"] = time.time()
        faults["lag"] = lag
        faults["remote_step"] = newest_remote(remote, mirrored["jid"])
        faults["output"] = remote.exists(f"{mirrored['jid']}/output/adapter_model.safetensors")
        said = [json.loads(ln) for ln in (mirrored["home"] / "jobs" / mirrored["jid"] / "events.jsonl").read_text()
                .splitlines() if '"mirror_' in ln]
        faults["failed_said"] = sum(e["event"] == "mirror_failed" for e in said)
        back = [e["ts"] for e in said if e["event"] == "mirror_recovered"]
        faults["recovered_at"] = datetime.fromisoformat(back[0].replace("Z", "+00:00")).timestamp() if back else None
    finally:
        mirrored["proc"].terminate()
        mirrored["proc"].wait(180)
    return {"times": mirrored["times"], "faults": faults}


def report(args: argparse.Namespace, pairs: list[dict], load: tuple[float, float]) -> bool:
    print(f"backend {args.backend}; {args.steps} steps, a checkpoint every {args.every}; {len(pairs)} pairs "
          f"(A: no mirror, B: the server killed mid-upload of the first checkpoint, down {args.down_s:.0f} s)")
    ratios, caught_all = [], True
    for i, pr in enumerate(pairs, 1):
        a, b, f = pr["A"], pr["B"], pr["B"]["faults"]
        ma, mb = statistics.median(a["times"]), statistics.median(b["times"])
        ratios.append(mb / ma)
        caught = f["remote_step"] == args.steps and f["output"] and bool(f["lag"].get("caught_up"))
        caught_all = caught_all and caught
        recovered = f"{f['recovered_at'] - f['back_at']:.1f} s" if f["recovered_at"] else "never"
        print(f"pair {i} ({' '.join(pr['order'])}): median step A {ma:.4f} s (longest {max(a['times']):.3f}, load "
              f"{a['load'][0]:.2f}->{a['load'][1]:.2f}), B {mb:.4f} s (longest {max(b['times']):.3f}, load "
              f"{b['load'][0]:.2f}->{b['load'][1]:.2f}): ratio {mb / ma:.3f}")
        print(f"  B's mirror: down {f['back_at'] - f['killed_at']:.1f} s; failures said {f['failed_said']} time(s); "
              f"uploads again {recovered} after the server came back; caught up {caught} (remote step "
              f"{f['remote_step']}, output there: {f['output']}; last error: {f['lag'].get('last_error')})")
    ratio = statistics.median(ratios)
    print(f"median of the pairs' ratios: {ratio:.3f} ({', '.join(f'{r:.3f}' for r in ratios)}); load average "
          f"(1 min) {load[0]:.2f} before, {load[1]:.2f} after")
    ok = ratio <= 1.10 and caught_all
    print(f"within the bars (median ratio <= 1.10, every mirror caught up): {ok}")
    return ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", choices=["sftp", "s3"], default="sftp")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--every", type=int, default=50)
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--down-s", type=float, default=60.0)
    ap.add_argument("--kill-after-s", type=float, default=0.3)
    ap.add_argument("--file-delay-s", type=float, default=0.3)
    ap.add_argument("--catch-up-s", type=float, default=120.0)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="lorad-mirror-bench-"))
    try:
        before = os.getloadavg()[0]
        pairs = run(args, root)
        return 0 if report(args, pairs, (before, os.getloadavg()[0])) else 1
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
