"""What people see of GPU health: the supervisor's gpus step writes it, `lorad status`, the dashboard's jobs page and
/metrics show it (quarantine and held GPUs, thermal or hardware slowdown, VRAM others hold, a job waiting for it).

In-process: a real store, the real Supervisor and HealthWatcher over a SimulatedDevice with injected faults, the real
handlers, renderer and dashboard (Starlette's TestClient). No trainer is started.
"""

from __future__ import annotations

import re

from starlette.testclient import TestClient

from daemon import protocol as p
from daemon.client import render
from daemon.gpu_health import verdict as vd
from daemon.gpu_health.watcher import HealthWatcher
from daemon.power.simulated import SimulatedDevice
from daemon.service import handlers
from daemon.store import states
from daemon.supervisor.loop import Supervisor
from daemon.web.metrics import registry
from tests.helpers.fakes import RecLog
from tests.helpers.web import BASE, Site, signed_in


def test_quarantine_slowdown_and_foreign_vram_show_in_status_dashboard_and_metrics(tmp_path, capsys):
    site = Site(tmp_path)
    try:
        dev = SimulatedDevice(2)
        w = HealthWatcher(dev, [0, 1], vd.Rules(), 1.0, RecLog())
        cfg = site.cfg.model_copy(update={"gpu_memory_policy": "wait", "warm_trainer": False})
        sup = Supervisor(site.home, cfg, site.store, [0, 1], RecLog(), health=w)
        site.ctx.supervisor = sup
        jid = site.add_job("vram")

        dev.inject(1, xid=[79, 79, 79])
        dev.inject(0, foreign_mib=4096, throttle=["hw_thermal_slowdown"])
        w.poll_once()
        sup.tick()  # the gpus step, then spawn: GPU 1 is out, GPU 0 is shared → the job waits (policy wait)
        assert site.store.get(jid)["state"] == states.QUEUED and not sup.children
        assert sup.gpu_notes[jid].startswith("waiting for VRAM (gpu_memory_policy: wait): GPU 0: other programs hold 4.0")

        render.print_table(handlers.queue(site.ctx))
        out = capsys.readouterr().out
        assert "GPU 1: held (Xid 79; Xid 79; Xid 79); `lorad gpu clear 1` to take it back" in out
        assert "GPU 0: ok; thermal slowdown; other programs hold 4.0 of 24.0 GiB (1 process(es))" in out
        assert "waiting for VRAM" in out

        site.dash.metrics = registry(site.view, lambda: {}, site.home / "rejected")
        with TestClient(site.app, base_url=BASE) as c:
            signed_in(c, site.token)
            page = c.get("/jobs").text
            text = c.get("/metrics", headers={"Authorization": f"Bearer {site.token}"}).text
        g1 = re.search(r"<tr data-gpu='1'>(.*?)</tr>", page).group(1)
        assert "held" in g1 and "Xid 79" in g1 and "lorad gpu clear 1" in g1
        g0 = re.search(r"<tr data-gpu='0'>(.*?)</tr>", page).group(1)
        assert "thermal" in g0 and ">4.0<" in g0 and ">20.0<" in g0
        assert "waiting for VRAM" in re.search(rf"<tr data-job='{jid}'>(.*?)</tr>", page).group(1)
        for line in ['lorad_gpu_health{gpu="1",state="held"} 1.0', 'lorad_gpu_health{gpu="0",state="ok"} 1.0',
                     'lorad_gpu_healthy{gpu="1"} 0.0', 'lorad_gpu_faults{gpu="1"} 3.0',
                     'lorad_gpu_slowdown{gpu="0",kind="thermal"} 1.0', 'lorad_gpu_slowdown{gpu="0",kind="hardware"} 0.0',
                     'lorad_gpu_foreign_vram_bytes{gpu="0"} 4.294967296e+09']:
            assert line in text, line

        # lorad gpu clear 1 through its handler: GPU 1 is back in service, and `lorad gpu` says so.
        reply = handlers.gpu(site.ctx, p.Gpu(clear=1))
        assert reply.message == "GPU 1 cleared: scheduled again" and reply.gpus[1]["state"] == "ok"
        sup.tick()
        assert '"held"' not in (site.store.get_meta("gpu_health") or "")
    finally:
        site.close()


def test_a_job_waiting_for_a_gpu_can_be_paused_cancelled_and_is_requeued_when_a_gpu_is_healthy(tmp_path):
    site = Site(tmp_path)
    try:
        dev = SimulatedDevice(1)
        w = HealthWatcher(dev, [0], vd.Rules(recover_s=0.0), 1.0, RecLog())
        sup = Supervisor(site.home, site.cfg.model_copy(update={"warm_trainer": False}), site.store, [0], RecLog(),
                         health=w)
        site.ctx.supervisor = sup
        a, b, c = (site.add_job(n) for n in "abc")
        for jid in (a, b, c):
            site.store.transition(jid, states.QUEUED, states.RUNNING, "test")
            site.store.transition(jid, states.RUNNING, states.WAITING_FOR_GPU, "gpu: GPU 0 quarantined (lost)")
        assert handlers.pause(site.ctx, p.Pause(job=a)).state == states.PAUSED
        assert handlers.cancel(site.ctx, p.Cancel(job=b)).state == states.CANCELLED
        dev.inject(0, lost=True)
        w.poll_once()
        sup._gpus()
        assert site.store.get(c)["state"] == states.WAITING_FOR_GPU  # its only GPU is out
        dev.inject(0)
        w.poll_once()
        w.poll_once()  # clean for recover_s (0 here): taken back
        sup._next_gpu_requeue = 0.0
        sup._gpus()
        assert site.store.get(c)["state"] == states.QUEUED
    finally:
        site.close()
