"""Trainers found by their command line: one per trainer, however many of its children have not exec'd yet."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from daemon.system import proc
from tests.helpers.daemon import wait_until

# A stand-in trainer (its argv names engine.run and a --workdir) that forks a child which, like subprocess
# between fork and exec, keeps the trainer's command line for a while.
FORKING_TRAINER = textwrap.dedent("""
    import os, sys, time
    child = os.fork()
    if child == 0:
        time.sleep(60)
        os._exit(0)
    print(child, flush=True)
    time.sleep(60)
""")


def test_a_trainers_child_before_its_exec_is_not_a_second_trainer(tmp_path):
    wd = tmp_path / "jobs" / "j1"
    wd.mkdir(parents=True)
    p = subprocess.Popen([sys.executable, "-c", FORKING_TRAINER, "engine.run", "--workdir", str(wd)],
                         stdout=subprocess.PIPE, text=True)
    try:
        child = int(p.stdout.readline())
        wait_until(lambda: proc.parent_pid(child) == p.pid, 10, "the forked child")
        found = proc.find_trainers(tmp_path / "jobs")
        assert [(t.pid, t.workdir) for t in found] == [(p.pid, wd.resolve())]
        assert proc.parent_pid(child) == p.pid  # the child was there all along, with the same command line
    finally:
        subprocess.run(["pkill", "-KILL", "-P", str(p.pid)], check=False)
        p.kill()
        p.wait()


def test_two_trainers_of_one_home_are_both_found(tmp_path):
    ps = []
    try:
        for name in ("a", "b"):
            wd = tmp_path / "jobs" / name
            wd.mkdir(parents=True)
            ps.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "engine.run",
                                        "--workdir", str(wd)]))
        wait_until(lambda: len(proc.find_trainers(tmp_path / "jobs")) == 2, 10, "both trainers")
        assert sorted(t.pid for t in proc.find_trainers(tmp_path / "jobs")) == sorted(p.pid for p in ps)
    finally:
        for p in ps:
            p.kill()
            p.wait()


def test_a_warm_trainer_is_found_by_its_working_directory_and_its_zygote_is_not(tmp_path):
    wd = tmp_path / "jobs" / "j1"
    wd.mkdir(parents=True)
    # The zygote's command line; a forked trainer keeps it and works in its job's directory.
    argv = [sys.executable, "-c", "import os, sys, time; os.chdir(sys.argv[1]); print(flush=True); time.sleep(60)"]
    ps = [subprocess.Popen([*argv, str(d), "-m", "daemon.supervisor.zygote", "3"], stdout=subprocess.PIPE)
          for d in (wd, tmp_path)]
    try:
        for p in ps:
            p.stdout.readline()
        assert [(t.pid, t.workdir) for t in proc.find_trainers(tmp_path / "jobs")] == [(ps[0].pid, wd.resolve())]
    finally:
        for p in ps:
            p.kill()
            p.wait()
