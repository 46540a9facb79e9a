"""How fast the dashboard answers on a big store: 1000 jobs and 1,000,000 event rows (target: ≤ 200 ms a page),
and how much memory it holds for a job of 1,000,000 steps (target: ≤ 300 MB RSS; issue 23).

    .venv/bin/python bench/web_pages.py [--jobs 1000] [--events 1000000] [--steps 20000] [--long-steps 1000000]
                                        [--n 30]

Builds a temp home in a child process (so this process's peak RSS is the dashboard's, not the builder's):
state.db with the jobs (two running), their attempts, 1,000,000 rows in the events table, an hour of 1 Hz
telemetry for one GPU and energy rows; one running job's events.jsonl with --steps step lines, the other's
with --long-steps. Serves it with the daemon's own listener (uvicorn on a thread, real HTTP on loopback) and
times each page N times over one keep-alive connection: wall-clock median and p95, and the CPU time this
process spent per request (server and client together; unlike wall-clock it does not grow when other
processes load the machine), plus the one-time read of each running job's whole events.jsonl (the daemon
does it on a thread when it starts) and the first view after it (later views read only what was appended).
Last, this process's RSS: now and at its peak (VmHWM), the dashboard, its store view and the HTTP client.
"""

from __future__ import annotations

import argparse
import http.client
import json
import multiprocessing
import os
import random
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from daemon import protocol as p  # noqa: E402
from daemon.config.daemon import DaemonConfig  # noqa: E402
from daemon.power.telemetry_store import TelemetryStore  # noqa: E402
from daemon.service import handlers
from daemon.store.db import Store  # noqa: E402
from daemon.web import metrics  # noqa: E402
from daemon.web.app import Dashboard, build_app  # noqa: E402
from daemon.web.auth import ensure_token  # noqa: E402
from daemon.web.listener import WebListener  # noqa: E402
from daemon.web.storeview import StoreView  # noqa: E402

STATES = ["succeeded"] * 6 + ["failed", "cancelled", "queued", "paused"]


def build(home: Path, n_jobs: int, n_events: int, n_steps: int, long_steps: int) -> None:
    store = Store(home / "state.db")
    TelemetryStore(home / "state.db").close()  # the power tables
    now = time.time()
    rnd = random.Random(0)
    db = store.db
    db.execute("BEGIN")
    ids = []
    for i in range(n_jobs):
        jid = f"job{i:04d}-{i:04x}"
        ids.append(jid)
        st = "running" if i >= n_jobs - 2 else rnd.choice(STATES)
        (home / "jobs" / jid).mkdir(parents=True)
        db.execute("INSERT INTO jobs (id, name, state, priority, seq, submitted_at, updated_at, workdir, step, total,"
                   " loss, s_per_step, eta_s, gpu) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                   (jid, f"job{i:04d}", st, 0, i + 1, now - 86400 + i, now, str(home / "jobs" / jid),
                    n_steps if st != "running" else n_steps, n_steps * 2, 1.0 + rnd.random(), 0.4, 100.0,
                    0 if st == "running" else None))
        for n in range(1, 4):
            db.execute("INSERT INTO attempts (job_id, n, started_at, ended_at, exit_code, start_step, end_step, error)"
                       " VALUES (?,?,?,?,?,?,?,?)", (jid, n, now - 3600 * n, now - 3600 * n + 60, 75, 0, 100, None))
        db.execute("INSERT INTO power_jobs (job_id, gpu_model, simulated, energy_j, active_s, steps) "
                   "VALUES (?,?,?,?,?,?)", (jid, "Sim", 1, 1e6, 4000.0, 10000))
    per_job = n_events // n_jobs
    rows = ((ids[k // per_job], now - n_events + k, "transition", '{"from": "queued", "to": "running"}')
            for k in range(per_job * n_jobs))
    db.executemany("INSERT INTO events (job_id, ts, kind, data) VALUES (?,?,?,?)", rows)
    db.executemany("INSERT INTO power_samples VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                   ((now - 3600 + s, 0, ids[-1], 0.0, 250.0 + rnd.random() * 20, None, "sim", 1500.0, 5000.0,
                     70.0, 99.0, 40.0, 300.0, "sw_power_cap" if s % 7 == 0 else "", 1) for s in range(3600)))
    db.execute("COMMIT")
    store.close()
    write_steps(home / "jobs" / ids[-1], ids[-1], n_steps, now, rnd)
    write_steps(home / "jobs" / ids[-2], ids[-2], long_steps, now, rnd)


def write_steps(workdir: Path, job: str, n_steps: int, now: float, rnd: random.Random) -> None:
    """A trainer's events.jsonl: n_steps step lines as the engine writes them, a checkpoint every 500 steps."""
    t0 = now - n_steps * 0.4
    with open(workdir / "events.jsonl", "w") as f:
        for s in range(1, n_steps + 1):
            ts = datetime.fromtimestamp(t0 + s * 0.4, timezone.utc).isoformat()
            f.write(json.dumps({"job": job, "event": "step", "step": s, "total": n_steps * 2,
                                "loss": 2.0 / (1 + s / 500) + rnd.random() * 0.05, "lr": 1e-4, "s_per_step": 0.4,
                                "eta_s": 100.0, "samples": s * 4, "level": "info", "ts": ts}) + "\n")
            if s % 500 == 0:
                f.write(json.dumps({"event": "checkpoint_committed", "step": s, "path": f"/x/step-{s:08d}",
                                    "seconds": 0.5, "ts": ts}) + "\n")


def rss_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        return next(int(ln.split()[1]) for ln in f if ln.startswith(field + ":")) / 1024


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=1000)
    ap.add_argument("--events", type=int, default=1_000_000)
    ap.add_argument("--steps", type=int, default=20_000)
    ap.add_argument("--long-steps", type=int, default=1_000_000)
    ap.add_argument("--n", type=int, default=30)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp)
        t = time.perf_counter()
        builder = multiprocessing.get_context("fork").Process(
            target=build, args=(home, args.jobs, args.events, args.steps, args.long_steps))
        builder.start()
        builder.join()
        assert builder.exitcode == 0, builder.exitcode
        n = args.jobs
        running, long_job = f"job{n - 1:04d}-{n - 1:04x}", f"job{n - 2:04d}-{n - 2:04x}"
        print(f"store built in {time.perf_counter() - t:.1f} s: {args.jobs} jobs, {args.events} event rows, "
              f"{args.steps} and {args.long_steps} step lines in the running jobs' events.jsonl")
        store = Store(home / "state.db")  # as the daemon opens it (indexes created on an older file)
        cfg = DaemonConfig()
        ctx = handlers.Context(home=home, store=store, intake=None, supervisor=None, started_at=time.time(),
                               socket_path=home / "lorad.sock")
        view = StoreView(home / "state.db")
        token = ensure_token(home)
        dash = Dashboard(home, view, cfg.web, lambda req: json.loads(handlers.dispatch(ctx, req)), token,
                         metrics.registry(view, lambda: handlers.ping(ctx, p.Ping()).wire(), home / "rejected"),
                         schedule=cfg.power.schedule.model_dump())
        web = WebListener(build_app(dash), "127.0.0.1:0")
        web.start()
        conn = http.client.HTTPConnection("127.0.0.1", web.port, timeout=30)
        auth = {"Authorization": f"Bearer {token}"}

        def get(path: str) -> float:
            t0 = time.perf_counter()
            conn.request("GET", path, headers=auth)
            r = conn.getresponse()
            body = r.read()
            dt = time.perf_counter() - t0
            assert r.status == 200, (path, r.status, body[:300])
            return dt

        get("/submit")
        rss_before = rss_mb("VmRSS")
        # The daemon reads the histories of the jobs that are training on a thread when it starts
        # (daemon/service/dashboard.py); timed here on its own, then the first view of the page.
        for job, steps in ((running, args.steps), (long_job, args.long_steps)):
            t = time.perf_counter()
            view.warm([(job, home / "jobs" / job)])
            warm = time.perf_counter() - t
            conn.close()  # idle past uvicorn's keep-alive while the history was read: the server has closed it
            first = get(f"/jobs/{job}")
            print(f"\nreading a running job's {steps} step lines (on a thread at daemon start): {warm * 1000:.0f} ms")
            print(f"its page, first view after that: {first * 1000:.0f} ms")
        print()
        pages = ["/jobs", "/jobs?live=1", f"/jobs/{running}", f"/jobs/{running}?live=1", f"/jobs/{long_job}",
                 f"/jobs/{long_job}?live=1", "/jobs/job0001-0001", "/power", "/submit", "/metrics"]
        print(f"{'page':<34} {'median ms':>10} {'p95 ms':>8} {'CPU ms':>8}  (n={args.n}, target ≤ 200 ms)")
        worst = 0.0
        for path in pages:
            get(path)
            cpu0 = time.process_time()  # this process (server thread and client): robust to other load
            times = sorted(get(path) for _ in range(args.n))
            cpu = (time.process_time() - cpu0) / args.n * 1000
            med, p95 = statistics.median(times) * 1000, times[min(len(times) - 1, int(0.95 * len(times)))] * 1000
            worst = max(worst, p95)
            print(f"{path:<34} {med:>10.1f} {p95:>8.1f} {cpu:>8.1f}")
        rss_now, rss_peak = rss_mb("VmRSS"), rss_mb("VmHWM")
        conn.close()
        web.close()
        view.close()
        store.close()
        with open("/proc/loadavg") as f:
            load = f.read().split()[0]
        print(f"\nRSS of this process (dashboard, store view, HTTP client): {rss_before:.0f} MB before the histories "
              f"were read, {rss_now:.0f} MB after every page, peak {rss_peak:.0f} MB (target ≤ 300 MB)")
        print(f"slowest p95: {worst:.1f} ms — {'within' if worst <= 200 else 'OVER'} the 200 ms target "
              f"(load average {load} on {os.cpu_count()} CPUs while measuring)")
        return 0


if __name__ == "__main__":
    sys.exit(main())
