"""The mirror's storage server killed mid-upload and started again later, while a job trains under `lorad serve`:
the job's step time against the same job without a mirror, and the mirror catching up.

    .venv/bin/python bench/mirror_faults.py                       # SFTP (sshd on loopback), down 60 s
    .venv/bin/python bench/mirror_faults.py --backend s3 --down-s 20 --steps 600

Runs the quickstart job made lighter (tiny-llama on CPU, batch 2, LoRA on q/v, a checkpoint every --every steps) twice in fresh homes, one after the
other: first without a mirror, then with one (the server started on loopback by tests/helpers/storage.py). In the
second run the server is SIGKILLed while the first checkpoint's upload is in flight (each file's upload is made to
last LORAD_DEBUG_MIRROR_FILE_DELAY_S, so that "mid-upload" is a window we can hit), and started again --down-s
seconds later. It prints the median step time (from the step events' timestamps) of both runs and their ratio
(bar: 1.10; the trainer never waits for the mirror, so only the uploader's CPU can cost it anything), the
longest step of each, and whether the mirror caught up: its newest complete checkpoint is the job's last and its
output is there, with no error left. (moto keeps nothing across a restart: with --backend s3 the bucket and its
credentials are made again, and what it catches up on is what came after.)
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


def run(args: argparse.Namespace, root: Path) -> dict:
    server = storage.start_s3(root) if args.backend == "s3" else storage.start_sftp(root)
    try:
        return measure(args, root, server)
    finally:
        server.server.kill()


def measure(args: argparse.Namespace, root: Path, server) -> dict:
    mirror = server.mirror("bench", retry_base_s=1.0, retry_max_s=10.0)
    base = {"tick_s": 0.25, "power": {"telemetry": {"backend": "off"}}, "web": {"enabled": False},
            "run_as_root": True, "allowed_roots": ["{home}", str(REPO)]}
    plain = train(root, "plain", base, args, {})
    plain["proc"].terminate()
    faults: dict = {}

    def fault(workdir: Path, jid: str) -> None:
        while not committed(workdir):
            time.sleep(0.05)
        time.sleep(args.kill_after_s)  # the first upload is under way (each file takes the debug delay)
        faults["killed_at"] = time.time()
        server.server.kill()
        print(f"server killed mid-upload; back in {args.down_s:.0f} s", flush=True)
        time.sleep(args.down_s)
        server.restart()
        faults["back_at"] = time.time()
        print("server back", flush=True)

    env = {"LORAD_DEBUG_MIRROR_FILE_DELAY_S": str(args.file_delay_s)}
    cfg = {**base, "mirrors": {"off": mirror}, "default_mirror": "off"}
    mirrored = train(root, "mirrored", cfg, args, env, during=fault)
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
    return {"plain": plain["times"], "mirrored": mirrored["times"], "faults": faults}


def report(args: argparse.Namespace, r: dict) -> bool:
    p, m, f = statistics.median(r["plain"]), statistics.median(r["mirrored"]), r["faults"]
    ratio = m / p
    caught = f["remote_step"] == args.steps and f["output"] and f["lag"].get("caught_up")
    print(f"backend {args.backend}; {args.steps} steps, a checkpoint every {args.every}; server down "
          f"{f['back_at'] - f['killed_at']:.1f} s from mid-upload of the first checkpoint")
    print(f"median step time: no mirror {p:.4f} s ({len(r['plain'])} steps, longest {max(r['plain']):.3f} s), "
          f"mirror with the fault {m:.4f} s ({len(r['mirrored'])} steps, longest {max(r['mirrored']):.3f} s): "
          f"ratio {ratio:.3f}")
    recovered = f"{f['recovered_at'] - f['back_at']:.1f} s" if f["recovered_at"] else "never"
    print(f"mirror: failures said {f['failed_said']} time(s); uploads again {recovered} after the server came back; "
          f"caught up (newest complete remote checkpoint step {f['remote_step']}, output there: {f['output']}) "
          f"{f['caught_up_at'] - f['back_at']:.1f} s after it (the job still training meanwhile); last error: "
          f"{f['lag'].get('last_error')}")
    ok = ratio <= 1.10 and bool(caught)
    print(f"within the bars (step ratio <= 1.10, caught up): {ok}")
    return ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", choices=["sftp", "s3"], default="sftp")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--every", type=int, default=50)
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--down-s", type=float, default=60.0)
    ap.add_argument("--kill-after-s", type=float, default=0.3)
    ap.add_argument("--file-delay-s", type=float, default=0.3)
    ap.add_argument("--catch-up-s", type=float, default=120.0)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="lorad-mirror-bench-"))
    try:
        return 0 if report(args, run(args, root)) else 1
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
