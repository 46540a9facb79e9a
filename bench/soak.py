"""The chaos soak: `lorad serve` on a file system that keeps only what was fsynced, several jobs of different
families, and a seeded random schedule of faults at random moments; at the end every job is finished and its
adapter compared with its uninterrupted reference, tensor by tensor, bit for bit.

    .venv/bin/python bench/soak.py --faults 100 --seed 1                # the quickstart LM, tiny FLUX.1, tiny FLUX.2
    .venv/bin/python bench/soak.py --faults 1000 --seed 7 --deadline 09:00
    .venv/bin/python bench/soak.py --faults 5000 --without kill_daemon,kill_both,power_cut --deadline 09:00

Faults (bench/soak_faults.py): SIGKILL of a trainer, the daemon or both; SIGSTOP of a trainer (a hang, found by
the daemon's hang check); a power cut of the whole home (tests/helpers/faultfs.py: only fsynced bytes and
directory entries survive, sometimes with torn pages); a full disk for a while; the running job's newest
checkpoint corrupted; garbage and half-written files in the inbox; socket abuse; `lorad pause`/`resume`/
`priority`; a wall-clock jump (lorad's time.time(), see bench/soak_world.py); the simulated GPU lost for a while,
or an Xid on it (the job waits as waiting_for_gpu, never counted as a crash, and resumes when the GPU is back); an
out-of-memory in the running trainer's step (re-planned by the daemon, no crash counted; drawn only where the next
lever keeps the numerics, so the adapter still matches its reference). Jobs are submitted in rounds (one of
each family) through the inbox; a finished round is checked and the next one submitted, until --faults faults are
done or the deadline comes (then the round in flight is finished and checked).

The oracle for committed work (bench/soak_oracle.py): a checkpoint a trainer reported committed is never lost.
After every restart the trainer must resume from the newest step reported committed, or a newer one (when the
soak corrupted that checkpoint itself: the one before it that the store still keeps). A bit-identical adapter
cannot show this (a job that lost a checkpoint redoes the steps and ends the same), so the run's first power cut
waits for a trainer and strikes right after its next commit, and half of the later ones do too: the moment a
rename whose directory was never fsynced is lost.

The report: faults by kind, jobs lost, human actions needed (a `lorad retry` the soak had to type), steps lost
per killing fault against the save interval, recovery time from the fault to the next training step, and each
daemon instance's lifetime, RSS and open files when it was ready and at its end (and RSS at each round's end).
`--kinds`/`--without` choose the faults: without kill_daemon, kill_both and power_cut (each starts a new daemon)
one daemon lives the whole run, and its figures say whether it leaks. Any failure prints the seed and the
schedule so far, and exits 1.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.soak_faults import FAULTS, KINDS, NEEDS_TRAINER, pick, stopped  # noqa: E402
from bench.soak_oracle import check, story  # noqa: E402
from bench.soak_world import REPO, SoakFailure, World  # noqa: E402
from engine.config.checkpoint import CheckpointConfig  # noqa: E402
from tests.helpers.daemon import cli_in_process  # noqa: E402

EXAMPLES = REPO / "configs" / "examples"
FINAL = {"succeeded", "failed", "cancelled"}


def soak_config(**over: Any) -> dict[str, Any]:
    """The daemon's config: short loops, short backoffs, a short hang check, no web. A trainer stopped in a slow
    phase (its load, the final checkpoint) is found by its liveness file: after 10 s, not 60. One simulated GPU
    (telemetry every 5 s, health read every 0.2 s) whose faults bench/soak_world.py writes (gpu_lost, xid): a GPU
    reading clean for half a second is taken back, and faults 2 s apart never add up to a GPU held for a human."""
    return {"tick_s": 0.1, "inbox_settle_s": 0.2, "inbox_rescan_s": 1.0, "backoff_base_s": 0.2, "backoff_max_s": 1.0,
            "hang_timeout_s": 4.0, "hang_step_multiple": 10.0, "rank_silence_s": 10.0, "startup_timeout_s": 300.0,
            "stop_grace_s": 20.0, "kill_wait_s": 10.0, "retry_budget": 1000, "run_as_root": os.geteuid() == 0,
            "warm_trainer": True, "devices": [0],
            "power": {"telemetry": {"backend": "simulated", "simulated_gpus": 1, "interval_s": 5.0}},
            "gpu_health": {"interval_s": 0.2, "recover_s": 0.5, "fault_window_s": 2.0},
            "web": {"enabled": False}, **over}


def default_specs(models: Path, families: list[str]) -> dict[str, dict[str, Any]]:
    """The quickstart LM, tiny FLUX.1 and tiny FLUX.2 jobs, shortened; builtin models built once, outside the home."""
    from engine.builtin.models import materialise

    def load(name: str, model: str, steps: int, every: int) -> dict[str, Any]:
        job = yaml.safe_load((EXAMPLES / name).read_text())
        job["model"]["path"] = str(materialise(model, models))
        job["data"]["path"] = str((EXAMPLES / job["data"]["path"]).resolve())
        job["train"]["steps"] = steps
        job["checkpoint"] = {"every_steps": every, "every_seconds": None, "keep": 2}
        job.pop("sample", None)
        return job

    table = {"lm": ("quickstart.yaml", "tiny-llama", 40, 5), "flux": ("flux-lora-tiny.yaml", "tiny-flux", 16, 4),
             "flux2": ("flux2-lora-tiny.yaml", "tiny-flux2", 12, 4)}
    return {f: load(*table[f]) for f in families}


def reference(spec: dict[str, Any], cache: Path, env: dict[str, str]) -> dict[str, bytes]:
    """The uninterrupted run's output LoRA files (`lorad run`, not on the fault file system), by name, cached by the
    job's content."""
    key = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]
    out = cache / key
    if not out.exists():
        home = Path(tempfile.mkdtemp(prefix="ref-", dir=cache))
        job = home / "job.yaml"
        job.write_text(yaml.safe_dump(spec, sort_keys=False))
        r = subprocess.run([sys.executable, "-m", "daemon.client.cli", "run", str(job), "--home", str(home), "--quiet"],
                           env=env, cwd=str(REPO), capture_output=True, text=True)
        if r.returncode != 0:
            raise SoakFailure(f"the reference run of {spec['name']} failed:\n{r.stderr[-3000:]}")
        tmp = Path(tempfile.mkdtemp(dir=cache))
        for f in (home / "jobs" / spec["name"] / "output").glob("*.safetensors"):
            shutil.copy(f, tmp / f.name)
        tmp.rename(out)
        shutil.rmtree(home, ignore_errors=True)
    return {f.name: f.read_bytes() for f in out.glob("*.safetensors")}


def same_tensors(a: bytes, b: bytes) -> bool:
    """The same tensors, bit for bit (names, dtypes, shapes, bytes); the files' metadata may differ (job names)."""
    import torch
    from safetensors.torch import load

    ta, tb = load(a), load(b)

    def raw(t):
        return t.contiguous().view(-1).view(torch.uint8)

    return ta.keys() == tb.keys() and all(ta[k].dtype == tb[k].dtype and ta[k].shape == tb[k].shape
                                          and raw(ta[k]).equal(raw(tb[k])) for k in ta)


class Soak:
    def __init__(self, root: Path, specs: dict[str, dict[str, Any]], refs: dict[str, dict[str, bytes]], seed: int,
                 faults: int, stop_at: float, gap: tuple[float, float] = (0.5, 4.0), kinds: dict[str, int] = KINDS,
                 config: dict[str, Any] | None = None, env: dict[str, str] | None = None):
        self.specs, self.refs, self.seed, self.n_faults, self.stop_at, self.gap = specs, refs, seed, faults, stop_at, gap
        self.kinds = kinds
        self.rng = random.Random(seed)
        self.cover = self.rng.sample(sorted(kinds), len(kinds))
        roots = sorted({str(Path(s[k]["path"]).parent) for s in specs.values() for k in ("model", "data")})
        self.world = World(root, {"allowed_roots": ["{home}", *roots], **(config or soak_config())},
                           env or dict(os.environ))
        self.faults: list[dict[str, Any]] = []
        self.round = 0
        self.jobs: dict[str, str] = {}  # job id -> spec name, this round
        self.verified = self.lost = self.mismatched = self.human = 0
        self.paused: set[str] = set()
        self.corrupted: dict[str, list[tuple[float, int]]] = {}  # job id -> (when, step) of each checkpoint we corrupted
        self.fault_times: list[tuple[float, dict[str, Any]]] = []  # (when it struck, its record)
        self.t_start = time.monotonic()

    # ------------------------------------------------------------------ rounds
    def submit_round(self) -> None:
        self.round += 1
        w = self.world
        staging = w.home / "soak-staging"
        names = {}
        for spec_name, spec in self.specs.items():
            name = f"{spec_name}-r{self.round}"
            names[name] = spec_name
            tmp = staging / f"{name}.yaml"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.write(fd, yaml.safe_dump({**spec, "name": name}, sort_keys=False).encode())
            os.fsync(fd)
            os.close(fd)
            os.rename(tmp, w.home / "inbox" / f"{name}.yaml")
        dfd = os.open(w.home / "inbox", os.O_RDONLY)
        os.fsync(dfd)  # a power cut right after this must not take the submission with it
        os.close(dfd)
        deadline = time.monotonic() + 120
        self.jobs = {}
        while len(self.jobs) < len(names):
            w.check_alive()
            self.jobs = {j["id"]: names[j["name"]] for j in w.jobs() if j["name"] in names}
            if time.monotonic() > deadline:
                raise SoakFailure(f"round {self.round}: jobs not accepted within 120 s: {sorted(names)}")
            time.sleep(0.1)

    def tend(self) -> bool:
        """Look after the round: failed jobs retried (a human action), our paused jobs resumed once nothing else
        is left, lost jobs counted. True when every job of the round has succeeded (and was checked)."""
        w = self.world
        w.check_alive()
        states = {j["id"]: j["state"] for j in w.jobs()}
        for jid in self.jobs:
            w.tail(jid).poll()
            if jid not in states:
                self.lost += 1
                last = f" (the last fault: #{self.faults[-1]['n']} {self.faults[-1]['kind']})" if self.faults else ""
                raise SoakFailure(f"job {jid} ({self.jobs[jid]}) is gone from lorad status{last}")
            if states[jid] in ("failed", "cancelled"):
                self.human += 1
                print(f"  ! job {jid} is {states[jid]}: `lorad retry` (a human action)", flush=True)
                cli_in_process(["retry", jid, "--home", str(w.home), "--socket", str(w.sock)], w.env)
        active = [jid for jid in self.jobs if states[jid] not in FINAL and states[jid] != "paused"]
        if not active:
            for jid in [j for j in self.jobs if states[j] == "paused"]:
                cli_in_process(["resume", jid, "--home", str(w.home), "--socket", str(w.sock)], w.env)
        return all(states[jid] == "succeeded" for jid in self.jobs)

    def check_round(self) -> None:
        self.check_promises()
        for jid, spec in self.jobs.items():
            for name, ref in self.refs[spec].items():
                got = (self.world.home / "jobs" / jid / "output" / name).read_bytes()
                if not same_tensors(got, ref):
                    self.mismatched += 1
                    raise SoakFailure(f"job {jid} ({spec}): its {name} differs from the uninterrupted reference")
            self.verified += 1
        self.world.sample_round()
        print(f"  round {self.round}: {len(self.jobs)} jobs finished, bit-identical to their references "
              f"({len(self.faults)} faults so far)", flush=True)

    # ------------------------------------------------------------------ faults
    def training_job(self) -> str | None:
        """The job whose trainer stepped within the last 2 s (its trainer is alive and past its load)."""
        now = time.monotonic()
        for jid in self.jobs:
            t = self.world.tail(jid)
            t.poll()
            if t.fresh and t.fresh[-1][0] > now - 2 and any(e.get("event") == "step" for _, e in t.fresh[-3:]):
                return jid
        return None

    def sleep(self, s: float) -> None:
        end = time.monotonic() + s
        while time.monotonic() < end:
            for jid in self.jobs:
                self.world.tail(jid).poll()
            time.sleep(min(0.05, max(0.0, end - time.monotonic())))

    def one_fault(self) -> None:
        # Every kind once first (in a seeded order), then as the weights draw them.
        from_cover = bool(self.cover)
        kind = self.cover.pop() if from_cover else pick(self.rng, self.kinds)
        self.sleep(self.rng.uniform(*self.gap))
        running = self.training_job()
        # The run's first power cut waits for a trainer too: it strikes right after that trainer's next commit.
        needs_trainer = kind in NEEDS_TRAINER or (kind == "power_cut" and self.world.fs.cuts == 0)
        if needs_trainer and running is None:
            end = time.monotonic() + 30
            while running is None and time.monotonic() < end:
                if self.tend():  # the round is over: no trainer will come until run() submits the next one
                    if from_cover:
                        self.cover.append(kind)
                    return
                self.sleep(0.1)
                running = self.training_job()
            if running is None:
                self.cover.insert(0, kind)  # its turn comes again
                others = {k: v for k, v in self.kinds.items() if k not in NEEDS_TRAINER}
                if not others:  # --kinds chose only faults that need a trainer
                    return
                kind = pick(self.rng, others)
        before = self.world.tail(running).last_step() if running else None
        t0 = time.monotonic()
        rec = FAULTS[kind](self.world, self.rng, running)
        t1 = time.monotonic()
        committed = self.promise(running)[0] if running else None  # when it struck: no resume may start before it
        rec = {"n": len(self.faults) + 1, "kind": kind, "at_s": round(t0 - self.t_start, 2), "job": running,
               "step": before, "committed": committed, **rec}
        self.faults.append(rec)
        self.fault_times.append((t1, rec))  # when it had struck: a power cut may wait for a commit first
        if kind == "corrupt_checkpoint" and rec.get("file"):
            self.corrupted.setdefault(running, []).append((t1, int(rec["file"].split("/step-")[1].split("/")[0])))
        if rec.get("paused"):
            self.paused.add(rec["paused"])
        if rec["disrupts"] or kind == "kill_daemon":
            self.recover(rec, t0, t1 if kind == "full_disk" else t0 + rec.get("waited_s", 0))
        print(f"  fault {rec['n']:>4} {kind:<18} {json.dumps({k: v for k, v in rec.items() if k not in ('n', 'kind')})}",
              flush=True)

    def recover(self, rec: dict[str, Any], t0: float, t_from: float) -> None:
        """Wait for the next training step (any job's) after the fault: when the fault killed the running job's
        trainer, its next trainer's first step. The steps that job redid; a committed checkpoint it lost."""
        job = rec["job"] if rec.get("kills") and (rec.get("pids") or rec.get("gpu_killed") or rec.get("oom")
                                                  or rec["kind"] == "power_cut") else None
        deadline = time.monotonic() + 300
        while True:
            self.world.check_alive()
            self.tend()
            if job:
                start = self.world.tail(job).first("start", t0)
                step = start and self.world.tail(job).first("step", start[0] - 0.001)
                steps = [step] if step else []
            else:
                steps = [f for jid in self.jobs if (f := self.world.tail(jid).first("step", t_from + 0.05))]
            if steps:
                rec["recovery_s"] = round(min(t for t, _ in steps) - t_from, 3)
                break
            if all(j["state"] in FINAL for j in self.world.jobs() if j["id"] in self.jobs):
                break  # the fault landed on the round's last step
            if time.monotonic() > deadline:
                raise SoakFailure(f"no training step within 300 s of fault {rec['n']} ({rec['kind']})")
            self.sleep(0.05)
        if job:
            t = self.world.tail(job)
            if res := t.first("resumed", t0):
                rec["lost"] = rec["step"] - res[1]["from_step"]
            elif t.first("start", t0):  # no checkpoint yet: trained again from the start
                rec["lost"] = rec["step"]
        self.check_promises()
        for pid in rec.get("stopped", []):
            if stopped(pid):
                raise SoakFailure(f"fault {rec['n']}: the hung trainer {pid} is still there, stopped")

    def promise(self, jid: str) -> tuple[int, str | None]:
        """The step no resume of job jid may start before now, and the first resume that broke that promise
        (bench/soak_oracle.py)."""
        ckpt = self.specs[self.jobs[jid]]["checkpoint"]
        keep = ckpt.get("keep", CheckpointConfig.model_fields["keep"].default)
        return check(jid, story(self.world.tail(jid).fresh, self.corrupted.get(jid, []), self.fault_times), keep)

    def check_promises(self) -> None:
        for jid in self.jobs:
            if (broken := self.promise(jid)[1]) is not None:
                raise SoakFailure(broken)

    # ------------------------------------------------------------------ the whole run
    def run(self) -> dict[str, Any]:
        try:
            self.world.start()
            self.submit_round()
            while len(self.faults) < self.n_faults and time.monotonic() < self.stop_at:
                if self.tend():
                    self.check_round()
                    self.submit_round()
                    continue
                self.one_fault()
            self.finish()
        finally:
            self.world.end_instance()
            self.world.close()
        return self.report()

    def finish(self, timeout: float = 900) -> None:
        deadline = time.monotonic() + timeout
        while not self.tend():
            if time.monotonic() > deadline:
                raise SoakFailure(f"round {self.round} not finished within {timeout} s of the last fault: "
                                  f"{[(j['id'], j['state']) for j in self.world.jobs()]}")
            self.sleep(0.2)
        self.check_round()

    def report(self) -> dict[str, Any]:
        from bench.soak_report import report

        return report(self)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--faults", type=int, default=100)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--families", default="lm,flux,flux2")
    ap.add_argument("--kinds", help=f"the fault kinds to draw, comma-separated (default: all of {','.join(KINDS)})")
    ap.add_argument("--without", default="", help="fault kinds not to draw, e.g. kill_daemon,kill_both,power_cut: "
                    "one daemon lives the whole run, for its RSS and open files at the start and the end")
    ap.add_argument("--deadline", help="HH:MM (UTC): stop injecting in time to finish the round by then")
    ap.add_argument("--finish-s", type=float, default=300, help="time kept before the deadline to finish a round")
    ap.add_argument("--gap", type=float, nargs=2, default=(0.5, 4.0), help="random pause before each fault (s)")
    ap.add_argument("--root", help="where the home and logs go (default: a new temp dir, removed unless it fails)")
    ap.add_argument("--ref-cache", default=str(Path(tempfile.gettempdir()) / "lorad-soak-refs"))
    args = ap.parse_args(argv)
    chosen = args.kinds.split(",") if args.kinds else list(KINDS)
    if unknown := sorted(set(chosen + [k for k in args.without.split(",") if k]) - set(KINDS)):
        ap.error(f"no such fault kind: {', '.join(unknown)} (kinds: {', '.join(KINDS)})")
    kinds = {k: KINDS[k] for k in chosen if k not in args.without.split(",")}
    if not kinds:
        ap.error("no fault kind left to draw")
    # SIGTERM (timeout, kill) unwinds like an error: the daemon and its trainers killed, the file system unmounted.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    stop_at = float("inf")
    if args.deadline:
        hh, mm = map(int, args.deadline.split(":"))
        now = datetime.now(UTC)
        end = now.replace(hour=hh, minute=mm, second=0, microsecond=0)
        if end <= now:  # a deadline past midnight (23:00 now, --deadline 01:30) is tomorrow's
            end += timedelta(days=1)
        stop_at = time.monotonic() + (end - now).total_seconds() - args.finish_s
    root = Path(args.root or tempfile.mkdtemp(prefix="lorad-soak-"))
    root.mkdir(parents=True, exist_ok=True)
    cache = Path(args.ref_cache)
    cache.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    specs = default_specs(cache / "models", args.families.split(","))
    refs = {name: reference(spec, cache, env) for name, spec in specs.items()}
    soak = Soak(root, specs, refs, args.seed, args.faults, stop_at, tuple(args.gap), kinds=kinds, env=env)
    print(f"soak: seed {args.seed}, {args.faults} faults, families {args.families}, kinds {','.join(kinds)}, "
          f"root {root}", flush=True)
    try:
        soak.run()
    except (SoakFailure, Exception) as e:  # any failure: the seed, the schedule and what it got through
        soak.report()
        print(f"\nSOAK FAILED: {type(e).__name__}: {e}\nreproduce: python bench/soak.py --seed {args.seed} --faults {args.faults} "
              f"--families {args.families} --gap {args.gap[0]} {args.gap[1]} --kinds {','.join(kinds)}\n"
              "schedule so far:", flush=True)
        for f in soak.faults:
            print("  " + json.dumps(f), flush=True)
        print(f"home and logs kept: {root}")
        return 1
    if not args.root:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
