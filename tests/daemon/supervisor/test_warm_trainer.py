"""When the warm trainer may fork a trainer, and when the trainer must start cold: pure checks, no zygote."""

from __future__ import annotations

import os
import shutil
import sys
import threading
from types import SimpleNamespace

from daemon.supervisor.warm_fingerprint import fingerprint
from daemon.supervisor.warm_trainer import WarmTrainer
from tests.helpers.processes import REPO

CMD = [sys.executable, "-m", "engine.run", "--job", "jobs/x/job.yaml", "--workdir", "jobs/x", "--progress", "json"]


def ready_zygote(env: dict[str, str], imported: str = "fp", on_disk: str = "fp") -> WarmTrainer:
    """A warm trainer whose zygote has imported everything (`imported` is what it recorded), started as if."""
    w = WarmTrainer(env, fingerprint_of=lambda: on_disk)
    w.current = SimpleNamespace(ready=threading.Event(), dead=threading.Event(), fp=imported)
    w.current.ready.set()
    return w


def test_a_ready_fresh_zygote_forks_engine_run_whatever_the_devices_and_liveness_dir():
    env = {"PATH": "/bin", "HF_HOME": "/cache"}
    job_env = {**env, "CUDA_VISIBLE_DEVICES": "1", "CUDA_DEVICE_ORDER": "PCI_BUS_ID", "LORAD_LIVENESS_DIR": "/j/ranks"}
    assert ready_zygote(env).why_cold(CMD, job_env) is None


def test_it_is_stale_when_lorads_files_differ_from_what_it_imported():
    assert ready_zygote({}, imported="old", on_disk="new").why_cold(CMD, {}).startswith("stale")


def test_an_environment_read_at_import_that_differs_means_a_cold_start():
    why = ready_zygote({"HF_HOME": "/a"}).why_cold(CMD, {"HF_HOME": "/b", "PYTORCH_CUDA_ALLOC_CONF": "x"})
    assert why == "environment read at import differs: ['HF_HOME', 'PYTORCH_CUDA_ALLOC_CONF']"


def test_torchrun_and_other_commands_start_cold_and_so_does_a_zygote_not_ready_or_gone():
    w = ready_zygote({})
    assert w.why_cold([sys.executable, "-m", "torch.distributed.run", *CMD[1:]], {}) == "not a single engine.run process"
    w.current.ready.clear()
    assert w.why_cold(CMD, {}) == "the warm trainer is still importing"
    w.current.dead.set()
    assert w.why_cold(CMD, {}) == "no warm trainer"


def test_the_fingerprint_changes_when_a_source_file_is_touched_and_only_then(tmp_path):
    for pkg in ("engine", "daemon"):
        shutil.copytree(REPO / pkg, tmp_path / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    before = fingerprint(tmp_path)
    (tmp_path / "engine" / "__pycache__").mkdir(exist_ok=True)
    (tmp_path / "engine" / "__pycache__" / "run.cpython-311.pyc").write_bytes(b"x")  # caches are not sources
    assert fingerprint(tmp_path) == before
    st = (tmp_path / "engine" / "run.py").stat()
    os.utime(tmp_path / "engine" / "run.py", ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    assert fingerprint(tmp_path) != before


def test_a_replaced_zygote_with_running_children_is_retired_not_stopped_until_its_last_child_is_collected(monkeypatch):
    from daemon.supervisor import warm_trainer

    stopped = []
    monkeypatch.setattr(warm_trainer, "Zygote", lambda *a: SimpleNamespace(name="new"))
    w = WarmTrainer({})
    busy = SimpleNamespace(live={101}, retired=False, stop=lambda: stopped.append("busy"))
    w.current = busy
    w._replace()  # stale: a new one takes its place
    assert w.current.name == "new" and busy.retired and stopped == []  # its trainer still reports to it
    idle = SimpleNamespace(live=set(), retired=False, stop=lambda: stopped.append("idle"))
    w.current = idle
    w._replace()
    assert stopped == ["idle"]


def test_a_retired_zygote_goes_when_its_last_child_is_collected():
    from daemon.supervisor.warm_trainer import Zygote

    z = Zygote.__new__(Zygote)  # its bookkeeping only: no process
    z.lock, z.exits, z.live, z.retired = threading.Lock(), {101: 0, 102: 0}, {101, 102}, True
    z.sock = SimpleNamespace(send=lambda b: None)
    stops = []
    z.stop = lambda: stops.append(1)
    z.release(101)
    assert stops == []
    z.release(102)
    assert stops == [1]


def test_a_zygote_gone_after_taking_a_request_fails_the_start_instead_of_going_cold():
    import queue

    import pytest

    from daemon.supervisor.warm_trainer import Zygote

    def zygote_answering(answer: dict) -> Zygote:
        z = Zygote.__new__(Zygote)  # its bookkeeping only: no process
        z.lock, z.live, z.answers, z.log = threading.Lock(), set(), queue.Queue(), lambda *a, **k: None
        z.sock = SimpleNamespace(sendmsg=lambda *a: None)
        z.answers.put(answer)
        return z

    # It may have forked a trainer that holds the job's lock: a cold start now would be a second trainer.
    with pytest.raises(OSError, match="died before answering"):
        zygote_answering({"error": "the warm trainer is gone", "gone": True}).fork({}, [])
    # It said the fork failed: no trainer exists, a cold start is safe.
    assert zygote_answering({"error": "fork: [Errno 11]"}).fork({}, []) is None
