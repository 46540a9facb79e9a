"""Jobs that span machines: each machine's daemon runs its part through torchrun's c10d rendezvous.

The same job file is submitted to the daemon of every machine (docs/distributed.md, "Several machines"). Each daemon
queues it, takes `resources.gpus` of its own devices as a gang, and starts engine.launch with

    --nnodes MIN:N --rdzv-backend c10d --rdzv-endpoint HOST:PORT --rdzv-id lorad-NAME-HASH

where HOST:PORT is the daemon config's `cluster.rendezvous` (one line, the same on every machine) and the
rendezvous id comes from the job's name and identity hash, not from the local job id (which differs between
daemons), so the parts meet. They train in one directory on shared storage,
`cluster.shared_dir/NAME-HASH`, the same path on every machine: rank 0 commits the checkpoints there and
every rank loads them. Rendezvous, membership, restarts and the loss of a machine are torchrun's: a lost
machine ends the round; with `resources.min_nodes` below `nodes` the others go on in a new round, resumed from
the last checkpoint with grad_accum re-planned, else each survivor exits as a crash and its daemon retries it.

Nothing here talks to the other machines: this module builds a command and checks a filesystem.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from daemon.config.cluster import ClusterSettings
from engine.config.job import JobConfig, parse_job
from engine.errors import JobInvalid

# Filesystem types (as /proc/self/mountinfo names them) that other machines can mount too. Any fuse.* counts
# (ceph-fuse, glusterfs, juicefs, s3fs, sshfs...): a FUSE filesystem is almost always remote.
SHARED_FS = {"nfs", "nfs4", "cifs", "smb3", "smbfs", "ceph", "lustre", "gpfs", "beegfs", "glusterfs", "ocfs2",
             "gfs2", "virtiofs", "9p", "afs", "orangefs", "weka", "panfs"}


def fs_type(path: Path, mountinfo: str | None = None) -> str:
    """The filesystem type of the mount holding `path` (the longest mount point above it in /proc/self/mountinfo).

    Read from mountinfo because os.statvfs has no filesystem type, and statfs' magic numbers would need a table
    of their own."""
    if mountinfo is None:
        mountinfo = Path("/proc/self/mountinfo").read_text()
    real = os.path.realpath(path)
    best, kind = "", "unknown"
    for line in mountinfo.splitlines():
        left, _, right = line.partition(" - ")
        fields = left.split()
        if len(fields) < 5 or not right:
            continue
        point = fields[4].replace("\\040", " ")
        inside = real == point or real.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, kind = point, right.split()[0]
    return kind


def is_shared(kind: str) -> bool:
    return kind in SHARED_FS or kind.startswith("fuse.")


def shared_workdir(cluster: ClusterSettings, job: JobConfig) -> Path:
    """The job's directory on shared storage: from its name and settings, the same on every machine."""
    return Path(cluster.shared_dir) / f"{job.name}-{job.identity_hash()}"


def check_submit(job: JobConfig, cluster: ClusterSettings | None, mountinfo: str | None = None) -> None:
    """Refuse (JobInvalid, exit 65 style) a job that spans machines where this daemon cannot run its part."""
    if job.resources.nodes == 1:
        return
    if cluster is None:
        raise JobInvalid(f"resources.nodes: {job.resources.nodes} machines, but this daemon has no `cluster` "
                         "section (rendezvous, shared_dir) in its config; see docs/distributed.md, \"Several machines\"")
    shared = Path(cluster.shared_dir)
    if not shared.is_dir():
        raise JobInvalid(f"resources.nodes: cluster.shared_dir {shared} is not a directory on this machine "
                         "(mount the shared storage, at the same path on every machine)")
    if cluster.assume_shared:
        return
    kind = fs_type(shared, mountinfo)
    if not is_shared(kind):
        raise JobInvalid(f"resources.nodes: cluster.shared_dir {shared} is on a {kind} filesystem, which other "
                         "machines cannot read: checkpoints must be on storage every machine mounts (NFS, CIFS, "
                         "Ceph, Lustre, GPFS, BeeGFS, FUSE...); if it is shared in a way this check cannot tell, "
                         "set cluster.assume_shared: true in the daemon config")


def rendezvous_id(job: JobConfig) -> str:
    """The id every machine's part of the job gives torchrun: the same job file makes the same id."""
    return f"lorad-{job.name}-{job.identity_hash()}"


def node_command(trainer_cmd: list[str], job: JobConfig, cluster: ClusterSettings) -> list[str]:
    """engine.launch with torchrun's c10d rendezvous around `python -m engine.run ARGS`, training in the shared
    directory instead of the daemon's own jobs/ID/ (which keeps this machine's job.yaml, logs and lock)."""
    i = trainer_cmd.index("engine.run")
    args = list(trainer_cmd[i + 1:])
    args[args.index("--workdir") + 1] = str(shared_workdir(cluster, job))
    res = job.resources
    conf = f"join_timeout={int(cluster.join_timeout_s)}"
    if cluster.hosts_rendezvous is not None:
        conf += f",is_host={int(cluster.hosts_rendezvous)}"
    return [*trainer_cmd[:i], "engine.launch", "--nnodes", f"{res.min_nodes or res.nodes}:{res.nodes}",
            "--nproc-per-node", str(res.gpus), "--max-restarts", str(cluster.max_restarts),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", cluster.rendezvous, "--rdzv-id", rendezvous_id(job),
            "--rdzv-conf", conf, "--", *args]


def spanning_job(doc: dict[str, Any], workdir: Path) -> JobConfig | None:
    """The job (as accepted: daemon/supervisor/accepted_job.py) if it spans machines (resources.nodes > 1), else
    None (also when it does not validate: the trainer then reports the job file itself, exit 65)."""
    resources = doc.get("resources")
    nodes = resources.get("nodes") if isinstance(resources, dict) else None
    if not isinstance(nodes, int) or nodes <= 1:
        return None  # one machine: no need to validate the whole job here
    try:
        job = parse_job(doc, Path(workdir), source="job.yaml", check_paths=False)
    except JobInvalid:
        return None
    return job if job.resources.nodes > 1 else None


def unrunnable(doc: dict[str, Any], workdir: Path, cluster: ClusterSettings | None) -> str | None:
    """Why this machine cannot run its part of the job (the cluster section was removed from the config after
    the job was accepted), or None."""
    job = spanning_job(doc, workdir)
    if job is None or cluster is not None:
        return None
    return (f"resources.nodes: {job.resources.nodes} machines, but this daemon's config has no `cluster` section "
            "any more")


def launch_command(trainer_cmd: list[str], doc: dict[str, Any], workdir: Path, processes: int,
                   cluster: ClusterSettings | None) -> list[str]:
    """How this machine starts the job in `workdir`: its part of a job that spans machines, or the whole job."""
    from daemon.supervisor.gang import launcher_command

    job = spanning_job(doc, workdir)
    if job is None or cluster is None:  # cluster None: `unrunnable` failed such a job before its start
        return launcher_command(trainer_cmd, processes)
    return node_command(trainer_cmd, job, cluster)
