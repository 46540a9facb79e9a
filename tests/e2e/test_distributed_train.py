"""One job on two processes (torchrun through engine.launch, gloo on the CPU): the same training as on one, kills
resumed bit-exactly, and resumes on another number of processes with the data order continuing exactly.

Each launch starts three Python processes that import torch, so the runs are shared between tests (module
fixtures), kept to a few steps of the micro model, and the one-process runs are forked from a server that imported
the stack once (tests/helpers/forked.py).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from engine.distributed.liveness import silent_ranks
from tests.helpers.forked import LM_PRELOAD, ForkedTrainer
from tests.helpers.jobs import QUICKSTART_DATA, adapter_bytes, deep_update, tiny_job_dict
from tests.helpers.processes import PY, Trainer, child_env

STEPS = 24  # checkpoints every 4: room for the four attempts of the kill chain, and fewer steps per launch
GLOBAL_BATCH = 4  # batch_size 2 × grad_accum × processes
# 1 and 2 processes sum the same gradients in another order (gloo's all-reduce, then the mean): equal up to
# float rounding. Measured equal to the last bit on this model; the tolerance is for other CPUs and kernels.
ATOL = 1e-5


STARTED: list[Trainer | ForkedTrainer] = []


@pytest.fixture(autouse=True)
def no_leftovers():
    """A failed test must not leave launchers (and through them, ranks) running."""
    yield
    while STARTED:
        t = STARTED.pop()
        if isinstance(t, ForkedTrainer):
            if t.alive():
                t.kill()
        elif t.proc.poll() is None:
            t.proc.kill()
            t.proc.wait(30)


def started(t):
    STARTED.append(t)
    return t


def launch(job: Path, workdir: Path, processes: int, **env: str) -> Trainer | ForkedTrainer:
    """The job on `processes` ranks; 1 is the plain trainer (engine.run), a real process forked from the server."""
    # One thread per process, as torchrun gives each rank: comparable, and far quicker on a crowded CPU.
    samples = {"LORAD_DEBUG_SAMPLE_LOG": str(workdir.parent / f"{workdir.name}.samples"), "OMP_NUM_THREADS": "1"}
    if processes == 1:
        return started(ForkedTrainer(job, workdir, preload=LM_PRELOAD, **samples, **env))
    trainer_args = ["--job", str(job), "--workdir", str(workdir), "--progress", "json"]
    return started(Trainer([PY, "-m", "engine.launch", "--standalone", "--nproc-per-node", str(processes), "--",
                            *trainer_args], env=child_env(**samples, **env)))


def write_job(dest: Path, model: Path, gpus: int) -> Path:
    d = deep_update(tiny_job_dict(model, QUICKSTART_DATA), {
        # The 2-process job also swaps a block: DDP over a frozen base partly in host memory (ignore_frozen);
        # swapping changes no number, so it still trains what one process trains.
        "train": {"steps": STEPS, "grad_accum": GLOBAL_BATCH // (2 * gpus), "blocks_to_swap": 1 if gpus == 2 else 0},
        "resources": {"gpus": gpus},
        "checkpoint": {"every_steps": 4, "keep": 20},
        # 3 batches on 2 ranks: rank 0 evaluates two, rank 1 one, and the sums are all-reduced
        "data": {"validation": {"path": str(QUICKSTART_DATA), "every_steps": 4, "batches": 3}},
    })
    dest.write_text(yaml.safe_dump(d))
    return dest


def sample_ids_by_step(workdir: Path) -> dict[int, list[int]]:
    """The dataset indices each global step trained on, in global-batch order, from every rank's record."""
    by_position: dict[int, list[int]] = {}
    for f in workdir.parent.glob(f"{workdir.name}.samples.rank-*.jsonl"):
        for line in f.read_text().splitlines():
            rec = json.loads(line)
            by_position[rec["position"]] = rec["ids"]
    steps: dict[int, list[int]] = {}
    for pos in sorted(by_position):
        steps.setdefault(pos // GLOBAL_BATCH + 1, []).extend(by_position[pos])
    return steps


def losses(t: Trainer | ForkedTrainer) -> dict[int, float]:
    return {e["step"]: e["loss"] for e in t.named("step")}


def finish(t):
    if isinstance(t, ForkedTrainer):
        assert t.finish(timeout=300) == 0, t.events[-3:]
    else:
        assert t.wait(300) == 0, t.stderr[-3000:]
    return t


@pytest.fixture(scope="module")
def runs(tmp_path_factory, micro_model):
    """Uninterrupted runs of the same job on 1 and on 2 processes: {processes: (job, workdir, trainer)}."""
    root = tmp_path_factory.mktemp("dist")
    out = {}
    started = {n: launch(write_job(root / f"job{n}.yaml", micro_model, n), root / f"ref{n}", n) for n in (1, 2)}
    for n, t in started.items():
        out[n] = (root / f"job{n}.yaml", root / f"ref{n}", finish(t))
    return out


def test_two_processes_train_what_one_process_trains_with_the_same_global_batch(runs):
    (_, w1, t1), (_, w2, t2) = runs[1], runs[2]
    assert [e["processes"] for e in t2.named("start")] == [2]
    assert [e["swapped"] for e in t2.named("block_swap")] == [1] and t1.named("block_swap") == []
    assert [e["grad_accum"] for e in t2.named("start")] == [1] and [e["grad_accum"] for e in t1.named("start")] == [2]
    assert sample_ids_by_step(w1) == sample_ids_by_step(w2)
    assert losses(t1) == pytest.approx(losses(t2), abs=ATOL)
    validation = [{e["step"]: e["loss"] for e in t.named("validation")} for t in (t1, t2)]
    assert sorted(validation[0]) == list(range(4, STEPS + 1, 4)) and validation[0] == pytest.approx(validation[1],
                                                                                                    abs=ATOL)
    assert {e["batches"] for e in t2.named("validation")} == {3}
    a = load_file(str(w1 / "output" / "adapter_model.safetensors"))
    b = load_file(str(w2 / "output" / "adapter_model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=ATOL, rtol=0)
    # Only rank 0 wrote: one event stream, one start, one done.
    assert len(t2.named("done")) == 1


def rank_pids(launcher_pid: int) -> list[int]:
    pids = []
    for task in Path(f"/proc/{launcher_pid}/task").iterdir():
        try:
            pids += [int(p) for p in (task / "children").read_text().split()]
        except OSError:
            pass
    return pids


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def kill_launcher(t: Trainer, processes: int = 2) -> None:
    """SIGKILL the launcher alone, as the OOM killer would; its ranks must die with it."""
    ranks = rank_pids(t.proc.pid)
    assert len(ranks) == processes
    t.send(signal.SIGKILL)
    t.wait(60)
    deadline = time.monotonic() + 30
    while any(alive(p) for p in ranks) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(p) for p in ranks), "a rank outlived its launcher"


def resume_elsewhere(src: Path, dest: Path) -> int:
    """`dest`: `src` as a run killed right after committing its first checkpoint would have left it; that step."""
    first = min(p.name for p in (src / "checkpoints").iterdir() if p.name.startswith("step-") and "." not in p.name)
    shutil.copytree(src / "checkpoints" / first, dest / "checkpoints" / first)
    return int(first.split("-")[1])


@pytest.mark.parametrize("trained, resumed", [(2, 1), (1, 2)])
def test_resumed_on_another_number_of_processes_the_data_order_continues_exactly(runs, tmp_path, trained, resumed):
    job, src, ref = runs[trained]
    workdir = tmp_path / "moved"
    at = resume_elsewhere(src, workdir)
    # The job file still says `trained` GPUs: the world size is what the launcher gives (a node lost, fewer
    # free GPUs); grad_accum is re-planned to keep the global batch.
    t = finish(launch(job, workdir, resumed))
    assert [e["from_step"] for e in t.named("resumed")] == [at] and 0 < at < STEPS
    assert [e["grad_accum"] for e in t.named("start")] == [GLOBAL_BATCH // (2 * resumed)]
    ref_ids = sample_ids_by_step(src)
    assert sample_ids_by_step(workdir) == {s: ids for s, ids in ref_ids.items() if s > at}
    assert losses(t) == pytest.approx({s: v for s, v in losses(ref).items() if s > at}, abs=ATOL)


def rank_pid(launcher_pid: int, rank: int) -> int:
    for pid in rank_pids(launcher_pid):
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        if f"RANK={rank}".encode() in env:
            return pid
    raise AssertionError(f"no rank {rank} under {launcher_pid}")


def first_step(t: Trainer) -> None:
    t.wait_for(lambda: bool(t.named("step")), timeout=240)


def test_a_two_process_job_stopped_killed_mid_save_hung_and_crashed_ends_bit_identical_to_its_uninterrupted_run(
        runs, tmp_path):
    """Four attempts of one job (each launch costs seconds of imports, so one chain covers the interruptions)."""
    job, ref_workdir, _ = runs[2]
    workdir, ckpts = tmp_path / "interrupted", tmp_path / "interrupted" / "checkpoints"

    # 1. SIGUSR1 (the UPS went on battery) to the launcher: rank 0 commits a checkpoint and training goes on.
    #    Then SIGTERM: forwarded to both ranks, which agree to stop after the same step; rank 0 commits that
    #    step and the job exits 75 once.
    t = launch(job, workdir, 2)
    first_step(t)
    t.send(signal.SIGUSR1)
    t.wait_for(lambda: any(e.get("phase") == "urgent_checkpoint" for e in t.events), timeout=60)
    t.send(signal.SIGTERM)
    assert t.wait(120) == 75, t.stderr[-3000:]
    [stopped] = t.named("stopped")
    names = sorted(p.name for p in ckpts.iterdir())
    assert names[-1] == f"step-{stopped['step']:08d}" and not any(".tmp-" in n for n in names)

    # 2. One rank SIGSTOPped while rank 0 writes a checkpoint (the writer slowed down, so the save is still being
    #    written at the kill): the other rank waits in the next all-reduce, so rank 0's heartbeats stop (the daemon
    #    sees one hung job). Each rank's liveness file (engine/distributed/liveness.py) names the stopped one: rank
    #    0's stays fresh while it waits. Then SIGKILL of the launcher alone, as the OOM killer would, mid-save:
    #    both ranks die with it, the stopped one included. (One launch for both: each costs seconds of imports.)
    alive_dir = tmp_path / "ranks"
    t = launch(job, workdir, 2, LORAD_DEBUG_CKPT_WRITE_DELAY_S="1", LORAD_LIVENESS_DIR=str(alive_dir))
    t.wait_for(lambda: any(".tmp-" in p.name for p in ckpts.iterdir()), timeout=240)
    os.kill(rank_pid(t.proc.pid, 1), signal.SIGSTOP)
    time.sleep(1.0)  # a step already under way may still finish
    seen = len(t.named("step"))
    time.sleep(2.0)  # a step takes a fraction of a second here
    assert len(t.named("step")) == seen, "rank 0 went on without rank 1"
    assert [rank for rank, _ in silent_ranks(alive_dir, time.time(), 1.5)] == ["1"]
    # a save writes five files, 1 s each: the one seen starting is still being written
    assert any(".tmp-" in p.name for p in ckpts.iterdir()), "the save landed before the kill"
    kill_launcher(t)

    # 3. One rank SIGKILLed: torchrun stops the other and the job exits once, as a crash, with no rank left.
    t = launch(job, workdir, 2)
    first_step(t)
    ranks = rank_pids(t.proc.pid)
    os.kill(rank_pid(t.proc.pid, 1), signal.SIGKILL)
    assert t.wait(120) not in (0, 65, 74, 75), t.stderr[-3000:]
    assert "every rank was stopped" in t.stderr
    assert not any(alive(p) for p in ranks)

    # 4. The retry resumes from the last committed checkpoint and ends on the uninterrupted run's exact bytes; ranks
    #    that exit cleanly take their liveness files with them.
    left_by_the_killed = set(os.listdir(alive_dir))
    t = finish(launch(job, workdir, 2, LORAD_LIVENESS_DIR=str(alive_dir)))
    assert set(os.listdir(alive_dir)) == left_by_the_killed  # and those name pids that are gone: never "silent"
    assert silent_ranks(alive_dir, time.time() + 60, 1) == []
    assert t.named("resumed") and t.named("resumed")[0]["from_step"] > 0
    assert adapter_bytes(workdir) == adapter_bytes(ref_workdir)
    assert sample_ids_by_step(workdir) == sample_ids_by_step(ref_workdir)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def node(job: Path, workdir: Path, port: int, hosts_store: bool) -> Trainer:
    """One machine's launcher: 1 process, joining torchrun's c10d rendezvous on 127.0.0.1:port with 1 to 2 nodes
    (on loopback both would claim the rendezvous store: `is_host` says which one does). last_call_timeout is how
    long a round with fewer than 2 nodes waits for more: the survivor's restart pays it once, and at the start it
    must cover the skew between two launchers started together (5 s passed at a load of 6)."""
    env = child_env(LORAD_DEBUG_SAMPLE_LOG=str(workdir.parent / f"{workdir.name}.samples"), OMP_NUM_THREADS="1")
    return started(Trainer([PY, "-m", "engine.launch", "--nnodes", "1:2", "--nproc-per-node", "1", "--max-restarts", "2",
                    "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "two-nodes",
                    "--rdzv-conf", f"last_call_timeout=5,keep_alive_interval=1,keep_alive_max_attempt=2,is_host={int(hosts_store)}",
                    "--", "--job", str(job), "--workdir", str(workdir), "--progress", "json"], env=env))


def test_two_nodes_on_loopback_train_one_job_and_the_surviving_node_finishes_it_alone(runs, tmp_path):
    job, ref_workdir, ref = runs[2]  # written for 2 processes: here 2 machines of 1
    workdir = tmp_path / "nodes"
    port = free_port()
    first = node(job, workdir, port, hosts_store=True)  # the node that is lost is the other one
    second = node(job, workdir, port, hosts_store=False)
    committed = lambda: [e for e in first.events + second.events if e.get("event") == "checkpoint_committed"]  # noqa: E731
    first.wait_for(lambda: bool(committed()), timeout=300)
    # Each machine's first rank prints the heartbeats (for the daemon that supervises that machine's part).
    assert [e["processes"] for e in first.events + second.events if e.get("event") == "start"] == [2, 2]
    lost = rank_pids(second.proc.pid)
    kill_launcher(second, processes=1)  # the machine is gone; its rank with it
    assert not any(alive(p) for p in lost)
    # torchrun on the survivor restarts its rank in a new rendezvous round of one node; the rank resumes from the
    # last checkpoint with grad_accum re-planned (min 1 node: `--nnodes 1:2`).
    assert first.wait(300) == 0, first.stderr[-3000:]
    events = [json.loads(line) for line in (workdir / "events.jsonl").read_text().splitlines()]
    assert any(e["event"] == "world_size" and e["processes"] == 1 for e in events)
    assert any(e["event"] == "resumed" and e["from_step"] >= committed()[0]["step"] for e in events)
    assert sample_ids_by_step(workdir) == sample_ids_by_step(ref_workdir)
    by_step = {e["step"]: e["loss"] for e in events if e["event"] == "step"}  # the last attempt's, where repeated
    assert by_step == pytest.approx(losses(ref), abs=ATOL)
