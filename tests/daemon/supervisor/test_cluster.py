"""Jobs that span machines under the daemon (daemon/supervisor/cluster.py): what each machine's daemon refuses at submit, and
the launch command with which the machines' parts meet in torchrun's rendezvous."""

from __future__ import annotations

import signal
import socket
from pathlib import Path

import pytest
import yaml

from daemon.config.cluster import ClusterSettings
from daemon.config.daemon import ConfigInvalid, DaemonConfig, load_config
from daemon.intake.accept import validate_text
from daemon.supervisor.cluster import (
    fs_type,
    is_shared,
    launch_command,
    rendezvous_id,
    unrunnable,
)
from daemon.supervisor.trainer import trainer_command
from engine.config.job import dump_job
from engine.errors import JobInvalid
from tests.helpers.jobs import QUICKSTART_DATA, deep_update, tiny_job, tiny_job_dict

MOUNTINFO = """\
22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw
40 22 0:35 / /mnt/shared rw,relatime shared:20 - nfs4 filer:/export rw,vers=4.2
41 40 0:36 / /mnt/shared/scratch rw shared:21 - tmpfs tmpfs rw
42 22 0:37 / /mnt/my\\040bucket rw shared:22 - fuse.s3fs s3fs rw
"""


def spanning(micro_model) -> dict:
    return deep_update(tiny_job_dict(micro_model, QUICKSTART_DATA), {"resources": {"nodes": 2}})


def test_the_filesystem_of_a_path_is_the_one_of_the_deepest_mount_above_it():
    assert fs_type(Path("/mnt/shared/lorad/jobs"), MOUNTINFO) == "nfs4"
    assert fs_type(Path("/mnt/shared/scratch/x"), MOUNTINFO) == "tmpfs"
    assert fs_type(Path("/mnt/sharedother"), MOUNTINFO) == "ext4"  # a prefix of the name is not a mount above it
    assert fs_type(Path("/mnt/my bucket/jobs"), MOUNTINFO) == "fuse.s3fs"
    assert [is_shared(k) for k in ("nfs4", "fuse.s3fs", "ceph", "ext4", "tmpfs", "xfs", "btrfs", "overlay")] == [
        True, True, True, False, False, False, False, False]


def submit(raw: dict, tmp_path: Path, cluster: dict | None):
    cfg = DaemonConfig(allowed_roots=["/"], cluster=cluster)
    return validate_text(yaml.safe_dump(raw), "job.yaml", tmp_path, cfg, tmp_path)


def test_a_job_spanning_machines_is_refused_by_a_daemon_without_a_cluster_section(micro_model, tmp_path):
    with pytest.raises(JobInvalid, match=r"resources\.nodes: 2 machines, but this daemon has no `cluster` section"):
        submit(spanning(micro_model), tmp_path, None)


def test_a_job_spanning_machines_is_refused_when_its_shared_dir_is_on_a_local_filesystem(micro_model, tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    cluster = {"rendezvous": "node-a:29400", "shared_dir": str(shared)}
    kind = fs_type(shared)
    assert not is_shared(kind)  # pytest's temporary directory: a local disk or tmpfs
    with pytest.raises(JobInvalid, match=rf"cluster\.shared_dir {shared} is on a {kind} filesystem.*"
                                         r"cluster\.assume_shared: true"):
        submit(spanning(micro_model), tmp_path, cluster)
    # The documented override (tests, a shared filesystem the check cannot recognise) lets it in.
    assert submit(spanning(micro_model), tmp_path, {**cluster, "assume_shared": True}).resources.nodes == 2
    # A job on one machine never needs any of it.
    assert submit(tiny_job_dict(micro_model, QUICKSTART_DATA), tmp_path, None).resources.nodes == 1


def test_min_nodes_is_validated_by_name(micro_model, tmp_path):
    with pytest.raises(JobInvalid, match=r"resources\.min_nodes: 3 is more than resources\.nodes \(2\)"):
        tiny_job(micro_model, tmp_path, resources={"nodes": 2, "min_nodes": 3})
    # batch 2 × grad_accum 1 × 2 machines = 4, kept on 1 machine with grad_accum 2; 3 machines make 6, which 2
    # machines cannot keep with whole micro-batches of 2.
    assert tiny_job(micro_model, tmp_path, resources={"nodes": 2, "min_nodes": 1}).resources.min_nodes == 1
    with pytest.raises(JobInvalid, match=r"resources\.min_nodes: on 2 machine\(s\) of 1 process\(es\) the global batch "
                                         r"\(6 samples\)"):
        tiny_job(micro_model, tmp_path, resources={"nodes": 3, "min_nodes": 2})


def test_each_machine_launches_its_part_to_meet_the_others_by_the_jobs_identity_not_its_local_id(
        micro_model, tmp_path):
    job = tiny_job(micro_model, tmp_path, resources={"nodes": 2, "min_nodes": 1, "gpus": 2})
    cluster = ClusterSettings(rendezvous="node-a:29400", shared_dir="/mnt/shared/lorad", hosts_rendezvous=False,
                              max_restarts=2, join_timeout_s=300)
    commands = []
    for local_id in ("tiny-1", "tiny-7"):  # the same job file, accepted by two daemons under different ids
        workdir = tmp_path / local_id
        workdir.mkdir()
        (workdir / "job.yaml").write_text(dump_job(job))
        doc = yaml.safe_load(dump_job(job))  # the job as each daemon accepted it (state.db's copy)
        commands.append(launch_command(trainer_command(workdir), doc, workdir, 2, cluster))
    a, b = commands
    i = a.index("--")
    assert a[1:i] == ["-m", "engine.launch", "--nnodes", "1:2", "--nproc-per-node", "2", "--max-restarts", "2",
                      "--rdzv-backend", "c10d", "--rdzv-endpoint", "node-a:29400",
                      "--rdzv-id", f"lorad-tiny-{job.identity_hash()}", "--rdzv-conf", "join_timeout=300,is_host=0"]
    assert a[:i] == b[:i] and rendezvous_id(job) == a[a.index("--rdzv-id") + 1]
    # Both train in the one directory on shared storage; each reads its own daemon's copy of the job file.
    shared = f"/mnt/shared/lorad/tiny-{job.identity_hash()}"
    assert a[a.index("--workdir") + 1] == b[b.index("--workdir") + 1] == shared
    assert a[a.index("--job") + 1] == str(tmp_path / "tiny-1" / "job.yaml")
    # A job on one machine keeps the plain command, and a daemon whose cluster section was removed fails the job.
    single = tmp_path / "single"
    single.mkdir()
    one = yaml.safe_load(dump_job(tiny_job(micro_model, tmp_path)))
    assert launch_command(trainer_command(single), one, single, 1, cluster) == trainer_command(single)
    assert "resources.nodes: 2 machines" in unrunnable(doc, tmp_path / "tiny-1", None)
    assert unrunnable(doc, tmp_path / "tiny-1", cluster) is None


def test_the_cluster_section_is_validated_by_name(tmp_path):
    bad = tmp_path / "daemon.yaml"
    bad.write_text(yaml.safe_dump({"cluster": {"rendezvous": "node-a", "shared_dir": "/mnt/shared"}}))
    with pytest.raises(ConfigInvalid, match=r"cluster\.rendezvous: .*HOST:PORT"):
        load_config(bad)
    bad.write_text(yaml.safe_dump({"cluster": {"rendezvous": "node-a:29400", "shared_dir": "shared"}}))
    with pytest.raises(ConfigInvalid, match=r"cluster\.shared_dir: .*absolute"):
        load_config(bad)


def test_an_unreachable_rendezvous_is_one_line_that_says_what_to_check(monkeypatch, capsys):
    from engine import launch

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    handlers = {sig: signal.getsignal(sig) for sig in launch.FORWARDED}
    # main() names itself the ranks' launcher in the environment: undone after the test (monkeypatch restores what
    # it set), or every later in-process engine.run would think its parent is a dead launcher.
    monkeypatch.setenv(launch.LAUNCHER_PID, "0")
    try:
        code = launch.main(["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                            "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "x",
                            "--rdzv-conf", "is_host=0,read_timeout=1", "--", "--job", "j", "--workdir", "w"])
    finally:
        for sig, h in handlers.items():
            signal.signal(sig, h)
    assert code not in (0, 65, 74, 75)  # a crash: the daemon retries (the other machine may come up)
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"lorad: cannot reach the rendezvous at 127.0.0.1:{port}: is the machine that hosts it up")


def test_a_public_rendezvous_is_refused_unless_the_config_allows_it():
    import pytest as _pytest
    from pydantic import ValidationError

    for private in ("10.0.0.5:29400", "192.168.1.2:29400", "127.0.0.1:29400", "[fd00::1]:29400", "localhost:29400"):
        ClusterSettings(rendezvous=private, shared_dir="/mnt/shared/lorad")
    with _pytest.raises(ValidationError, match=r"rendezvous: 8\.8\.8\.8:29400 is a public address.*allow_public"):
        ClusterSettings(rendezvous="8.8.8.8:29400", shared_dir="/mnt/shared/lorad")
    ok = ClusterSettings(rendezvous="8.8.8.8:29400", shared_dir="/mnt/shared/lorad", allow_public_rendezvous=True)
    assert ok.allow_public_rendezvous
