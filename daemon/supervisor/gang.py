"""Which queued jobs start now, on which devices: a job takes every device it needs at once, or none.

A job with `resources.gpus: N` needs N devices as a gang. Jobs are taken in
queue order (priority, then arrival); the first that does not fit the free
devices waits, holding nothing, and the jobs behind it wait too — a job that
needs four GPUs is never starved by a stream of one-GPU jobs slipping past it.
A job that needs more devices than the machine has can never start: it is
named, for the caller to fail with a message.

On a machine without a GPU the devices are `[None]`: the CPU, taken whole by
one job whatever its `gpus` (its processes share the cores through gloo).

Pure: no store, no processes; the supervisor's spawn step asks it.
"""

from __future__ import annotations

from dataclasses import dataclass

Device = int | None


@dataclass(frozen=True)
class Want:
    job_id: str
    gpus: int


@dataclass(frozen=True)
class Plan:
    starts: list[tuple[str, list[Device]]]  # (job id, its devices), in start order
    impossible: list[tuple[str, int]]  # (job id, gpus) the machine can never give


def plan_starts(queue: list[Want], devices: list[Device], busy: set[Device]) -> Plan:
    cpu_only = devices == [None]
    free = [d for d in devices if d not in busy]
    starts: list[tuple[str, list[Device]]] = []
    impossible: list[tuple[str, int]] = []
    for w in queue:
        need = 1 if cpu_only else w.gpus
        if need > len(devices):
            impossible.append((w.job_id, w.gpus))
            continue
        if need > len(free):
            break
        starts.append((w.job_id, free[:need]))
        free = free[need:]
    return Plan(starts, impossible)


def visible_devices(devs: list[Device]) -> str | None:
    """CUDA_VISIBLE_DEVICES for a gang (None on the CPU)."""
    return None if devs == [None] else ",".join(str(d) for d in devs)


def job_gpus(doc: dict) -> int:
    """The job's `resources.gpus` (1 if absent or not a positive int: the trainer validates the job itself, exit 65).

    `doc`: the job as accepted (daemon/supervisor/accepted_job.py), without the engine's validation, which would
    import torch into the daemon.
    """
    resources = doc.get("resources")
    gpus = resources.get("gpus", 1) if isinstance(resources, dict) else 1
    return gpus if isinstance(gpus, int) and not isinstance(gpus, bool) and gpus >= 1 else 1


def launcher_command(trainer_cmd: list[str], processes: int) -> list[str]:
    """`python -m engine.run ARGS` as is for one process; for several, engine.launch (torchrun) around it."""
    if processes == 1:
        return trainer_cmd
    i = trainer_cmd.index("engine.run")
    return [*trainer_cmd[: i], "engine.launch", "--standalone", "--nproc-per-node", str(processes), "--",
            *trainer_cmd[i + 1:]]
