"""The soak's faults, one function each: what it breaks, at the moment the schedule picked.

Each takes (world, rng, running) — running: the id of the job whose trainer steps now, or None — and returns what
it did (a dict, kept in the schedule the report prints) with `kills`: the running job's trainer died by it, so
the steps since its newest checkpoint are redone (steps lost), and `disrupts`: training stopped, so the time to
the next step is a recovery time.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import time
from pathlib import Path
from typing import Any

from bench.soak_world import SoakFailure, World
from tests.helpers.daemon import cli_in_process

# Relative weights: kills and cuts are what a flaky machine does most; each kind is drawn at least a few times
# in the short soak's 25.
KINDS = {"kill_trainer": 3, "kill_daemon": 2, "kill_both": 2, "hang": 1, "power_cut": 2, "full_disk": 1,
         "corrupt_checkpoint": 1, "inbox_garbage": 1, "socket_abuse": 1, "cli": 3, "clock_jump": 1,
         # The GPU's own faults, on the soak's simulated GPU 0 (daemon/gpu_health/), and an out-of-memory in the
         # running trainer's step (issue 40's re-plan).
         "gpu_lost": 1, "xid": 1, "out_of_memory": 1}
NEEDS_TRAINER = {"kill_trainer", "kill_both", "hang", "corrupt_checkpoint", "gpu_lost", "xid", "out_of_memory"}
# The re-plan's levers that keep a CPU run bit-identical (where bytes live, what is recomputed): the soak raises an
# out-of-memory only where the daemon's next lever is one of these, so every adapter still matches its one
# uninterrupted reference. Skipped samples and a smaller micro-batch change the numerics: never drawn.
NUMERICS_KEPT = {"swap_at_least", "activations_at_least"}


def kill_trainer(w: World, rng: random.Random, running: str | None) -> dict[str, Any]:
    return {"pids": w.kill_trainer(), "kills": True, "disrupts": True}


def kill_daemon(w: World, rng: random.Random, running: str | None) -> dict[str, Any]:
    """The daemon alone: its trainer trains on, and the next daemon finds it (reconciliation)."""
    w.kill_daemon()
    return {"ready_s": round(w.start_daemon(), 2), "kills": False, "disrupts": False}


def kill_both(w: World, rng: random.Random, running: str | None) -> dict[str, Any]:
    w.kill_daemon()
    pids = w.kill_trainer()
    return {"pids": pids, "ready_s": round(w.start_daemon(), 2), "kills": True, "disrupts": True}


def hang(w: World, rng: random.Random, running: str | None) -> dict[str, Any]:
    """SIGSTOP: the trainer is there and silent; the daemon's hang check must kill and restart it."""
    pids = w.kill_trainer(signal.SIGSTOP)
    return {"pids": pids, "kills": True, "disrupts": True, "stopped": pids}


def power_cut(w: World, rng: random.Random, running: str | None) -> dict[str, Any]:
    """The whole home loses what was not fsynced. The run's first cut (bench/soak.py waits for a trainer for it)
    and then half of them (w.cut_after_commit) strike the moment the running trainer reports a new committed
    checkpoint: the most dangerous legitimate moment, when a rename whose directory was never fsynced is still in
    the air."""
    torn = rng.random() < 0.5
    seed = rng.randrange(1 << 30)
    after = running is not None and (w.fs.cuts == 0 or rng.random() < w.cut_after_commit)
    t0 = time.monotonic()
    step = w.next_commit(running, timeout=10.0) if after else None
    # When and at which step it struck (recovery time and steps lost count from there), not when it was drawn.
    struck = {"after_commit": step, "waited_s": round(time.monotonic() - t0, 3),
              "step": w.tail(running).last_step()} if after else {}
    w.kill_everything()
    w.fs.cut(torn=torn, seed=seed)
    return {"torn": torn, "seed": seed, **struck, "ready_s": round(w.start_daemon(), 2), "kills": True,
            "disrupts": True}


def full_disk(w: World, rng: random.Random, running: str | None) -> dict[str, Any]:
    """The disk full for a while: saves, logs and the store's writes fail with ENOSPC; then space comes back."""
    hold = round(rng.uniform(*w.full_hold_s), 2)
    w.fs.full(True)
    try:
        time.sleep(hold)
    finally:
        w.fs.full(False)
    w.check_alive()
    return {"hold_s": hold, "kills": False, "disrupts": True}


def corrupt_checkpoint(w: World, rng: random.Random, running: str | None) -> dict[str, Any]:
    """Bytes of the running job's newest committed checkpoint flipped (durably), then its trainer killed: the
    resume must walk back past it."""
    ckpts = sorted(d for d in (w.home / "jobs" / running / "checkpoints").glob("step-*")
                   if d.name[5:].isdigit()) if running else []  # committed ones: no .tmp-, no .invalid-
    files = [f for f in (ckpts[-1].rglob("*") if ckpts else []) if f.is_file() and f.stat().st_size > 0]
    target = max(files, key=lambda f: f.stat().st_size) if files else None
    if target is not None:
        at = rng.randrange(target.stat().st_size)
        fd = os.open(target, os.O_RDWR)
        try:
            byte = os.pread(fd, 1, at)
            os.pwrite(fd, bytes([byte[0] ^ 0xFF]), at)
            os.fsync(fd)
        finally:
            os.close(fd)
    pids = w.kill_trainer()
    return {"file": str(target.relative_to(w.home)) if target else None, "pids": pids, "kills": True,
            "disrupts": True}


def inbox_garbage(w: World, rng: random.Random, running: str | None) -> dict[str, Any]:
    """Random bytes, a YAML list, a job cut off half-way (a writer that died), a file of a job that is not one."""
    inbox = w.home / "inbox"
    n = rng.randrange(1 << 20)
    job = (f"name: garbage-{n}\nmodel:\n  family: causal_lm\n  path: /nonexistent\nlora:\n  rank: 4\n"
           "data:\n  path: /nonexistent\ntrain:\n  steps: 3\n")
    files = {f"garbage-{n}.yaml": rng.randbytes(rng.randrange(1, 4096)),
             f"list-{n}.yaml": b"- a\n- b\n", f"half-{n}.yaml": job.encode()[: len(job) // 2],
             f"notajob-{n}.yml": b"hello: world\n"}
    try:
        for name, data in files.items():
            (inbox / name).write_bytes(data)
    except OSError as e:  # a full disk at this moment is no failure of the daemon
        return {"error": str(e), "kills": False, "disrupts": False}
    return {"files": sorted(files), "kills": False, "disrupts": False}


def socket_abuse(w: World, rng: random.Random, running: str | None) -> dict[str, Any]:
    """Garbage, a half line and a hang-up, an oversize line, more connections than allowed; then ping answers."""
    sent = []
    conns = []
    try:
        for payload in (rng.randbytes(200) + b"\n", b'{"verb": "sta', b'{"verb": "nope"}\n', b"[]\n",
                        b'{"verb": "pause", "job": "' + b"x" * 5000 + b'"}\n'):
            s = _connect(w)
            s.sendall(payload)
            s.close()
            sent.append(len(payload))
        big = _connect(w)
        try:
            big.sendall(b'{"verb": "ping", "pad": "' + b"y" * (1 << 21))
        except OSError:
            pass  # the daemon closed it: too large
        big.close()
        for _ in range(40):
            try:
                conns.append(_connect(w))
            except OSError:
                break
        time.sleep(0.3)
    finally:
        for s in conns:
            s.close()
    deadline = time.monotonic() + 10
    while not w.ping():
        if time.monotonic() > deadline:
            raise SoakFailure("the daemon no longer answers ping after socket abuse")
        time.sleep(0.05)
    return {"lines": sent, "held": len(conns), "kills": False, "disrupts": False}


def _connect(w: World) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    s.connect(str(w.sock))
    return s


def cli(w: World, rng: random.Random, running: str | None) -> dict[str, Any]:
    """`lorad pause`, `resume` or `priority` on a random job of the round, as a user would type it."""
    jobs = [j for j in w.jobs() if j["state"] not in ("succeeded", "failed", "cancelled")
            and not j["name"].startswith("garbage")]
    if not jobs:
        return {"verb": None, "kills": False, "disrupts": False}
    j = rng.choice(jobs)
    verb = "resume" if j["state"] == "paused" else rng.choice(["pause", "priority", "priority"])
    args = [verb, j["id"]] + ([str(rng.randint(-5, 5))] if verb == "priority" else [])
    r = cli_in_process([*args, "--home", str(w.home), "--socket", str(w.sock)], w.env)
    return {"verb": verb, "target": j["id"], "args": args[2:], "rc": r.returncode,
            "out": (r.stdout + r.stderr).strip()[-200:], "kills": False, "disrupts": verb == "pause"
            and j["state"] == "running", "paused": j["id"] if verb == "pause" else None}


def clock_jump(w: World, rng: random.Random, running: str | None) -> dict[str, Any]:
    """time.time() of every lorad process jumps (see bench/soak_world.py's CLOCK_SHIM): forward or back, by a
    minute to a day, kept within two days of the truth."""
    by = rng.choice([-1, 1]) * rng.choice([60.0, 3600.0, 86400.0])
    now = float(w.clock_file.read_text() or 0)
    if abs(now + by) > 2 * 86400:
        by = -by
    return {"by_s": by, "offset_s": w.clock_jump(by), "kills": False, "disrupts": False}


# ------------------------------------------------------------------ the GPU's own faults (simulated GPU 0)
def gpu_lost(w: World, rng: random.Random, running: str | None) -> dict[str, Any]:
    """GPU 0 falls off the bus for a while, then comes back (a driver reload): its trainer is killed, the job waits
    as waiting_for_gpu without a crash counted, and resumes once the GPU has read clean for gpu_health.recover_s."""
    hold = round(rng.uniform(0.5, 2.0), 2)
    return _gpu_fault(w, running, {"lost": True}, hold)


def xid(w: World, rng: random.Random, running: str | None) -> dict[str, Any]:
    """One fatal Xid (79, fallen off the bus) on GPU 0: quarantined, its job waits and resumes by itself (one fault
    within the soak's short gpu_health.fault_window_s never holds the GPU for a human to clear)."""
    w.xids.append(79)
    return _gpu_fault(w, running, {"xid": list(w.xids)}, 0.0)


def _gpu_fault(w: World, running: str | None, fault: dict[str, Any], hold: float) -> dict[str, Any]:
    before = next((j for j in w.jobs() if j["id"] == running), None)
    t0 = time.monotonic()
    w.set_gpu_faults({"0": fault})
    try:
        # The trainer's exit as the daemon recorded it: waiting_for_gpu, or the job finished just before.
        deadline = time.monotonic() + 30
        asked = time.monotonic()
        while (ev := w.tail(running).first("trainer_exited", t0 - 0.001) if running else None) is None:
            if time.monotonic() > deadline:
                raise SoakFailure(f"GPU fault {fault}: job {running}'s trainer did not stop within 30 s")
            if time.monotonic() > asked + 0.5:  # its trainer had exited just before (a kill, another job's turn)
                asked = time.monotonic()
                now = next((j for j in w.jobs() if j["id"] == running), None)
                if now is not None and now["state"] != "running" and w.tail(running).first("trainer_exited", t0 - 0.001) is None:
                    ev = (asked, {"state": now["state"], "between_trainers": True})
                    break
            time.sleep(0.05)
            w.tail(running).poll()
        time.sleep(hold)
    finally:
        w.set_gpu_faults({"0": {"xid": list(w.xids)}})  # healthy again (Xids delivered stay delivered)
    state = ev[1].get("state")
    between = bool(ev[1].get("between_trainers"))  # no trainer of its to stop: it waits in the queue or for the GPU
    # paused: the soak's own `lorad pause` (the cli fault) was in flight, and the user's word wins over the fault.
    if state not in ("waiting_for_gpu", "succeeded") and not (state == "paused" and _pausing(before)) \
            and not (between and state == "queued"):
        raise SoakFailure(f"GPU fault {fault}: job {running} went {state}, not waiting_for_gpu")
    after = next((j for j in w.jobs() if j["id"] == running), None)
    if before and after and after["retries"] > before["retries"]:
        raise SoakFailure(f"GPU fault {fault}: job {running} was counted as crashed ({before['retries']} → "
                          f"{after['retries']})")
    # kills: the daemon killed the trainer (SIGKILL: nothing on a lost GPU can be saved), so its steps since the
    # newest checkpoint are redone, and the recovery is its next trainer's first step.
    killed = state == "waiting_for_gpu" and not between
    return {"state": state, "hold_s": hold, "gpu_killed": killed, "kills": killed, "disrupts": True,
            **({"between_trainers": True} if between else {})}


def out_of_memory(w: World, rng: random.Random, running: str | None) -> dict[str, Any]:
    """A real torch.OutOfMemoryError in the running trainer's next optimizer step (engine/memory_plan/oom.py's
    $LORAD_DEBUG_OOM_FILE, which World sets): the trainer exits 69 with nothing half-done committed, the daemon
    re-plans (daemon/supervisor/oom_replan.py) and resumes it from its newest checkpoint, no crash counted. Only
    where the next lever keeps the numerics (NUMERICS_KEPT), which the daemon's `oom_replan` must confirm."""
    from engine.memory_plan.attempt import AttemptMemory, replan

    tail = w.tail(running)
    tail.poll()
    ran = next((e for e in reversed(tail.events) if e.get("event") == "memory_plan"), None)
    nxt = replan(ran, AttemptMemory()) if ran else None
    if nxt is None or not set(nxt[0].model_dump(exclude_defaults=True)) - {"tried"} <= NUMERICS_KEPT:
        return {"skipped": f"the next lever ({nxt[1] if nxt else 'none'}) would change the numerics",
                "kills": False, "disrupts": False}
    before = next((j for j in w.jobs() if j["id"] == running), None)
    if _pausing(before):  # the trainer is stopping for the soak's own `lorad pause`: no step may come to take it
        return {"skipped": f"job {running} is pausing", "kills": False, "disrupts": False}
    t0 = time.monotonic()
    w.oom_trigger.write_text(running)
    try:
        deadline = time.monotonic() + 30
        while (ev := tail.first("trainer_exited", t0 - 0.001)) is None:
            if time.monotonic() > deadline:
                raise SoakFailure(f"out of memory: job {running}'s trainer did not stop within 30 s")
            time.sleep(0.05)
            tail.poll()
    finally:
        claimed = not w.oom_trigger.exists()
        w.oom_trigger.unlink(missing_ok=True)  # the job ended before a step took it: no other job's to take
    if not claimed:
        return {"skipped": f"job {running} ended first ({ev[1].get('state')})", "kills": False, "disrupts": False}
    deadline = time.monotonic() + 10
    while (rp := tail.first("oom_replan", t0 - 0.001)) is None:
        if time.monotonic() > deadline:
            raise SoakFailure(f"out of memory: job {running} went {ev[1].get('state')} with no oom_replan event")
        time.sleep(0.05)
        tail.poll()
    if rp[1].get("lever") != nxt[1]:
        raise SoakFailure(f"out of memory: job {running} was re-planned with {rp[1].get('lever')!r}, not {nxt[1]!r}")
    after = next((j for j in w.jobs() if j["id"] == running), None)
    if before and after and after["retries"] > before["retries"]:
        raise SoakFailure(f"out of memory: job {running} was counted as crashed ({before['retries']} → "
                          f"{after['retries']})")
    return {"lever": nxt[1], "state": ev[1].get("state"), "oom": True, "kills": True, "disrupts": True}


def _pausing(job: dict[str, Any] | None) -> bool:
    """A `lorad pause` (the cli fault's) is on its way: asked of the running trainer, or that trainer gone already."""
    return bool(job) and (job.get("requested") == "pause" or job.get("state") == "paused")


FAULTS = {f.__name__: f for f in (kill_trainer, kill_daemon, kill_both, hang, power_cut, full_disk,
                                  corrupt_checkpoint, inbox_garbage, socket_abuse, cli, clock_jump, gpu_lost, xid,
                                  out_of_memory)}
assert set(FAULTS) == set(KINDS)


def pick(rng: random.Random, kinds: dict[str, int] = KINDS) -> str:
    names = sorted(kinds)
    return rng.choices(names, weights=[kinds[k] for k in names])[0]


def stopped(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"
    except OSError:
        return False
