"""Prometheus /metrics: a custom collector that reads the store at scrape time (prometheus-client renders).

Nothing here is updated by the supervisor or the trainer: each scrape reads
state.db (read-only connection) and the running jobs' events.jsonl
incrementally, so an idle Prometheus costs training nothing and a daemon
restart loses no metric. Every name is listed in docs/dashboard-and-metrics.md ("Metrics").
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from prometheus_client.core import CollectorRegistry, CounterMetricFamily, GaugeMetricFamily, Metric

from daemon.store import states
from daemon.web.storeview import StoreView

GPU_FIELDS = [  # (metric suffix, column, help)
    ("power_watts", "power_w", "GPU power draw (W), latest telemetry sample"),
    ("power_limit_watts", "limit_w", "GPU power limit in force (W)"),
    ("sm_clock_mhz", "sm_mhz", "SM clock (MHz)"),
    ("memory_clock_mhz", "mem_mhz", "memory clock (MHz)"),
    ("temperature_celsius", "temp_c", "GPU temperature (°C)"),
    ("utilization_percent", "util_gpu", "GPU utilisation (%)"),
]


class StoreCollector:
    def __init__(self, view: StoreView, health: Callable[[], dict[str, Any]], rejected_dir: Path):
        self.view = view
        self.health = health
        self.rejected_dir = Path(rejected_dir)

    def describe(self) -> list[Metric]:
        return []  # no registration-time scrape: the store is read only when Prometheus asks

    def collect(self) -> Iterator[Metric]:
        yield from self._daemon()
        try:
            rows = self._store()
        except sqlite3.Error:
            readable = 0.0
            rows = []
        else:
            readable = 1.0
        g = GaugeMetricFamily("lorad_store_readable", "1 if state.db could be read for this scrape")
        g.add_metric([], readable)
        yield g
        yield from rows

    # ---------------------------------------------------------------- the daemon itself
    def _daemon(self) -> Iterator[Metric]:
        try:
            h = self.health()
        except Exception:  # noqa: BLE001 — a scrape must answer even while the daemon is in trouble
            h = {}
        for name, key, help_ in [("lorad_up", None, "1 while the daemon answers"),
                                 ("lorad_uptime_seconds", "uptime_s", "seconds since the daemon started"),
                                 ("lorad_draining", "draining", "1 while `lorad drain` holds new jobs back"),
                                 ("lorad_trainers_running", "running", "trainer processes alive"),
                                 ("lorad_inbox_stuck_files", "inbox_stuck", "inbox files neither accepted nor "
                                  "rejected yet (e.g. disk full), retried")]:
            g = GaugeMetricFamily(name, help_)
            g.add_metric([], 1.0 if key is None else float(h.get(key) or 0))
            yield g
        yield from _mirrors(h.get("mirrors") or {})
        # A gauge: rejected/ is pruned by age and count (rejected_keep_days, rejected_keep), and by hand.
        c = GaugeMetricFamily("lorad_inbox_rejected_files", "rejections kept in HOME/rejected")
        try:
            c.add_metric([], float(sum(1 for _ in self.rejected_dir.glob("*.error.txt"))))
        except OSError:
            c.add_metric([], 0.0)
        yield c

    # ---------------------------------------------------------------- jobs and GPUs, from the store
    def _store(self) -> list[Metric]:
        out: list[Metric] = []
        counts = self.view.state_counts()
        g = GaugeMetricFamily("lorad_jobs", "jobs by state", labels=["state"])
        for st in states.STATES:
            g.add_metric([st], float(counts.get(st, 0)))
        out.append(g)

        running = self.view.query("SELECT id, name, workdir, gpu, step, total, loss, s_per_step, eta_s FROM jobs "
                                  "WHERE state=?", (states.RUNNING,))
        energy = self.view.energy_all()
        latest = self.view.latest_gpu_samples()
        first_start = {r["job_id"]: r["t"] for r in self.view.query(
            "SELECT job_id, MIN(started_at) AS t FROM attempts WHERE job_id IN "
            "(SELECT id FROM jobs WHERE state=?) GROUP BY job_id", (states.RUNNING,))}
        now = time.time()
        fams = {k: GaugeMetricFamily(f"lorad_job_{k}", h, labels=["job", "name"]) for k, h in [
            ("step", "last step reported by the trainer"),
            ("total_steps", "steps the job trains in all"),
            ("loss", "training loss at the last reported step"),
            ("seconds_per_step", "median seconds per step (last 20 steps)"),
            ("eta_seconds", "estimated seconds to the end"),
            ("seconds_since_checkpoint", "seconds since the last committed checkpoint (since the first start "
                                         "when none is committed yet): the work a crash now would lose"),
            ("power_watts", "power of the job's GPU, latest sample"),
            ("joules_per_step", "energy per step so far (all attempts)"),
            ("energy_kwh", "energy used so far (all attempts)"),
        ]}
        for j in running:
            lab = [j["id"], j["name"]]
            for key, col in [("step", "step"), ("total_steps", "total"), ("loss", "loss"),
                             ("seconds_per_step", "s_per_step"), ("eta_seconds", "eta_s")]:
                if j[col] is not None:
                    fams[key].add_metric(lab, float(j[col]))
            ck = self.view.series(j["id"], Path(j["workdir"])).last_checkpoint_ts or first_start.get(j["id"])
            if ck is not None:
                fams["seconds_since_checkpoint"].add_metric(lab, max(0.0, now - ck))
            s = latest.get(j["gpu"]) if j["gpu"] is not None else None
            if s is not None and s["power_w"] is not None:
                fams["power_watts"].add_metric(lab, float(s["power_w"]))
            e = energy.get(j["id"]) or {}
            if e.get("j_per_step") is not None:
                fams["joules_per_step"].add_metric(lab, e["j_per_step"])
            if e.get("kwh") is not None:
                fams["energy_kwh"].add_metric(lab, e["kwh"])
        out.extend(fams.values())

        total = CounterMetricFamily("lorad_energy_kwh", "energy used by all jobs recorded in the store")
        total.add_metric([], sum(e["kwh"] or 0.0 for e in energy.values()))
        out.append(total)

        gpu = {k: GaugeMetricFamily(f"lorad_gpu_{k}", h, labels=["gpu"]) for k, _, h in GPU_FIELDS}
        thr = GaugeMetricFamily("lorad_gpu_throttle", "1 for each clock-event (throttle) reason active in the "
                                "latest sample", labels=["gpu", "reason"])
        sim = GaugeMetricFamily("lorad_gpu_simulated", "1 if the readings come from the simulated device",
                                labels=["gpu"])
        for idx, s in sorted(latest.items()):
            for k, col, _ in GPU_FIELDS:
                if s[col] is not None:
                    gpu[k].add_metric([str(idx)], float(s[col]))
            for reason in filter(None, (s["throttle"] or "").split(",")):
                thr.add_metric([str(idx), reason], 1.0)
            sim.add_metric([str(idx)], float(s["simulated"] or 0))
        out.extend([*gpu.values(), thr, sim])
        out.extend(_gpu_health(self.view.meta_json("gpu_health", [])))
        return out


def _gpu_health(gpus: list[dict[str, Any]]) -> list[Metric]:
    """Each GPU's health as the supervisor last wrote it (daemon/gpu_health/): state, faults, slowdown, others' VRAM."""
    state = GaugeMetricFamily("lorad_gpu_health", "1 for the GPU's health state: ok, quarantined (a fault; taken "
                              "back when it reads healthy) or held (repeated faults; until lorad gpu clear)",
                              labels=["gpu", "state"])
    ok = GaugeMetricFamily("lorad_gpu_healthy", "1 while the GPU is scheduled, 0 while it is held out", labels=["gpu"])
    faults = GaugeMetricFamily("lorad_gpu_faults", "faults within gpu_health.fault_window_s", labels=["gpu"])
    slow = GaugeMetricFamily("lorad_gpu_slowdown", "1 while the GPU slows itself down (kind: thermal, hardware)",
                             labels=["gpu", "kind"])
    foreign = GaugeMetricFamily("lorad_gpu_foreign_vram_bytes", "VRAM held by processes that are not lorad's "
                                "(to 0.1 GiB)",
                                labels=["gpu"])
    for g in gpus:
        gpu = str(g.get("gpu"))
        for st in ("ok", "quarantined", "held"):
            state.add_metric([gpu, st], 1.0 if g.get("state") == st else 0.0)
        ok.add_metric([gpu], 1.0 if g.get("state") == "ok" else 0.0)
        faults.add_metric([gpu], float(g.get("faults") or 0))
        for kind in ("thermal", "hardware"):
            slow.add_metric([gpu, kind], 1.0 if kind in (g.get("slowdown") or []) else 0.0)
        foreign.add_metric([gpu], float(g.get("foreign_gb") or 0) * (1 << 30))  # to 0.1 GiB
    return [state, ok, faults, slow, foreign]


def _mirrors(lags: dict[str, dict[str, Any]]) -> Iterator[Metric]:
    """Each mirrored job's lag (daemon/mirror/): steps and seconds behind, the last upload, whether it is failing."""
    fams = [GaugeMetricFamily(n, h, labels=["job", "mirror"]) for n, h in [
        ("lorad_mirror_behind_steps", "steps committed locally and not yet on the mirror"),
        ("lorad_mirror_behind_seconds", "seconds since the oldest commit not yet on the mirror"),
        ("lorad_mirror_last_upload_timestamp_seconds", "when the mirror last took an upload (0: never)"),
        ("lorad_mirror_error", "1 while the mirror's last try failed (retried with backoff)")]]
    for job, m in sorted(lags.items()):
        if not m.get("mirror"):
            continue  # a job with only a Hub push (output.push_to_hub) has no mirror lag
        labels = [job, str(m.get("mirror") or "")]
        for fam, v in zip(fams, (m.get("behind_steps"), m.get("behind_s"), m.get("last_upload_at"),
                                 1.0 if m.get("last_error") else 0.0), strict=True):
            fam.add_metric(labels, float(v or 0))
    yield from fams


def registry(view: StoreView, health: Callable[[], dict[str, Any]], rejected_dir: Path) -> CollectorRegistry:
    """A registry holding only lorad's collector (no process/platform defaults: one daemon, one set of names)."""
    reg = CollectorRegistry(auto_describe=False)
    reg.register(StoreCollector(view, health, rejected_dir))
    return reg
