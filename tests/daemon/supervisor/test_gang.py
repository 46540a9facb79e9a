"""daemon.supervisor.gang: a multi-GPU job starts on all its devices at once or waits holding none."""

from __future__ import annotations

from daemon.supervisor.gang import Want, plan_starts, visible_devices


def test_a_two_gpu_job_waits_while_one_device_is_free_and_holds_none():
    plan = plan_starts([Want("big", 2)], devices=[0, 1], busy={0})
    assert plan.starts == [] and plan.impossible == []


def test_a_two_gpu_job_starts_on_two_free_devices_as_one_gang():
    plan = plan_starts([Want("big", 2), Want("small", 1)], devices=[0, 1, 2], busy=set())
    assert plan.starts == [("big", [0, 1]), ("small", [2])]
    assert visible_devices(plan.starts[0][1]) == "0,1"


def test_jobs_behind_a_waiting_gang_wait_too_so_it_is_never_starved():
    plan = plan_starts([Want("big", 2), Want("small", 1)], devices=[0, 1], busy={1})
    assert plan.starts == []


def test_a_job_needing_more_devices_than_the_machine_has_is_named_and_does_not_block_the_queue():
    plan = plan_starts([Want("huge", 4), Want("small", 1)], devices=[0, 1], busy=set())
    assert plan.impossible == [("huge", 4)]
    assert plan.starts == [("small", [0])]


def test_on_a_cpu_only_machine_a_multi_process_job_takes_the_cpu_whole():
    assert plan_starts([Want("big", 2)], devices=[None], busy=set()).starts == [("big", [None])]
    assert plan_starts([Want("big", 2)], devices=[None], busy={None}).starts == []
    assert visible_devices([None]) is None


def test_a_multi_process_job_is_started_through_the_launcher_and_a_single_one_as_before():
    from daemon.supervisor.gang import job_gpus, launcher_command

    cmd = ["py", "-m", "engine.run", "--job", "J", "--workdir", "W"]
    assert launcher_command(cmd, 1) == cmd
    assert launcher_command(cmd, 2) == ["py", "-m", "engine.launch", "--standalone", "--nproc-per-node", "2", "--",
                                        "--job", "J", "--workdir", "W"]
    assert job_gpus({"name": "x", "resources": {"gpus": 2}}) == 2
    assert job_gpus({"name": "x"}) == 1
    assert job_gpus({"resources": {"gpus": "2"}}) == job_gpus({"resources": {"gpus": True}}) == 1  # not an int


# ----------------------------------------------------------------- in the supervisor (fake trainers, no torch)
def gang_supervisor(tmp_path, monkeypatch, devices):
    import sys

    from daemon.config.daemon import DaemonConfig
    from daemon.store.db import Store
    from daemon.supervisor import gang
    from daemon.supervisor.loop import Supervisor
    from daemon.system.log import setup
    from tests.daemon.supervisor.test_supervisor import FAKE_TRAINER, FakeNotifier, FakePolicy

    sup = Supervisor(tmp_path, DaemonConfig(stop_grace_s=5), Store(tmp_path / "state.db"), devices, setup(),
                     policy=FakePolicy(), notifier=FakeNotifier())
    sup.trainer_command = lambda workdir: [sys.executable, "-c", FAKE_TRAINER, str(tmp_path / "marks")]
    # The fake speaks the trainer's contract; engine.launch around it is tested in test_distributed_train.py.
    monkeypatch.setattr(gang, "launcher_command", lambda cmd, processes: cmd)
    return sup


def queue(sup, tmp_path, name: str, gpus: int, priority: int = 0) -> str:
    jid = sup.store.new_id(name)
    wd = tmp_path / "jobs" / jid
    wd.mkdir(parents=True)
    (wd / "job.yaml").write_text(f"name: {name}\nresources: {{gpus: {gpus}}}\n")
    sup.store.add_job(jid, name, wd, priority, 1000, "test")
    return jid


def test_the_supervisor_starts_a_two_gpu_job_only_when_two_devices_are_free(tmp_path, monkeypatch):
    from tests.helpers.daemon import wait_until

    sup = gang_supervisor(tmp_path, monkeypatch, devices=[0, 1])
    try:
        small = queue(sup, tmp_path, "small", gpus=1, priority=10)
        big = queue(sup, tmp_path, "big", gpus=2)
        later = queue(sup, tmp_path, "later", gpus=1)
        sup.tick()
        assert set(sup.children) == {small}  # device 1 is free, but "big" needs two: it waits, holding nothing
        assert sup.store.get(big)["state"] == "queued" and sup.store.get(big)["gpu"] is None
        assert later not in sup.children  # and the job behind it does not slip past
        sup.stop(sup.children[small], "pause")
        wait_until(lambda: (sup.tick(), big in sup.children)[1], 30, "the gang to start")
        assert sup.children[big].devices == [0, 1]
        assert later not in sup.children  # both devices are the gang's
    finally:
        for c in sup.children.values():
            c.popen.kill()
        sup.store.close()


def test_a_job_needing_more_devices_than_the_machine_has_fails_naming_the_key(tmp_path, monkeypatch):
    sup = gang_supervisor(tmp_path, monkeypatch, devices=[0, 1])
    try:
        huge = queue(sup, tmp_path, "huge", gpus=4)
        sup.tick()
        job = sup.store.get(huge)
        assert job["state"] == "failed" and "resources.gpus" in job["last_error"]
    finally:
        sup.store.close()
