"""output.push_to_hub: never part of success; a push that cannot land is said once and retried; only the daemon
config's hub_namespaces, and nothing of this machine's paths goes (a Hub on loopback, tests/helpers/hub.py)."""

from __future__ import annotations

import json
import shutil

import pytest
import yaml
from safetensors.torch import load, load_file

from daemon.config.daemon import DaemonConfig
from daemon.intake.accept import Intake
from daemon.mirror.hub import HubPush, local_paths
from daemon.store.db import Store
from engine.config.job import dump_job
from engine.errors import JobInvalid
from engine.report.events import read_events
from tests.helpers.daemon import wait_until
from tests.helpers.fakes import RecLog
from tests.helpers.hub import start_hub
from tests.helpers.jobs import QUICKSTART_DATA, good_job
from tests.helpers.processes import REPO


def test_a_push_the_hub_refuses_is_reported_once_and_retried_with_backoff(tmp_path, finished_tiny_job):
    workdir = tmp_path / "work"
    shutil.copytree(finished_tiny_job[2], workdir)
    log = RecLog()
    # Nothing listens there: the network being down, as the push sees it.
    push = HubPush("tiny-1", workdir, "someone/tiny-lora", log, ["someone"], retry_base_s=0.05, retry_max_s=0.1,
                   endpoint="http://127.0.0.1:9").start()
    wait_until(lambda: push.tries >= 3, 60, "three tries")
    push.close()
    assert not push.pushed and push.status()["hub_error"]
    assert len(log.named("hub_push_failed")) == 1  # said once per cause, not per try
    said = [e for e in read_events(workdir) if e.get("event") == "hub_push_failed"]
    assert len(said) == 1 and said[0]["repo"] == "someone/tiny-lora"


def test_a_job_may_push_only_to_the_daemons_hub_namespaces_none_by_default(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    for i, (namespaces, repo, taken) in enumerate([([], "someone/x", False), (["team"], "team/x", True),
                                                   (["team"], "other/x", False), (["team"], "teammate/x", False)]):
        cfg = DaemonConfig(allowed_roots=["{home}", str(REPO)], hub_namespaces=namespaces)
        store = Store(home / f"state-{i}.db")
        text = yaml.safe_dump(good_job("push", output={"push_to_hub": repo}))
        try:
            if taken:
                assert Intake(home, cfg, store, RecLog()).submit_text("push.yaml", text).job_id
                continue
            with pytest.raises(JobInvalid) as e:
                Intake(home, cfg, store, RecLog()).submit_text("push.yaml", text)
            assert "output.push_to_hub" in str(e.value) and repr(repo) in str(e.value) and "\n" not in str(e.value)
            assert store.jobs() == []
        finally:
            store.close()


def test_the_push_calls_the_hub_only_for_its_namespaces_and_publishes_no_local_path(tmp_path, finished_tiny_job,
                                                                                  monkeypatch):
    _job, cfg, done, _names = finished_tiny_job
    workdir = tmp_path / "work"
    shutil.copytree(done, workdir)
    assert str(QUICKSTART_DATA) in (workdir / "output" / "lorad-output.json").read_text()  # as trained, locally
    monkeypatch.setenv("HF_TOKEN", "hf_the_daemons_own_token")
    hub = start_hub()
    try:
        paths = local_paths(yaml.safe_load(dump_job(cfg)), tmp_path)
        refused = HubPush("tiny-1", workdir, "other/tiny-lora", RecLog(), ["team"], paths, endpoint=hub.url).start()
        refused.thread.join(10)
        assert not refused.thread.is_alive() and not refused.pushed and refused.tries == 0
        assert "hub_namespaces" in refused.status()["hub_error"]
        assert hub.requests == []  # the token went nowhere
        push = HubPush("tiny-1", workdir, "team/tiny-lora", RecLog(), ["team"], paths, endpoint=hub.url).start()
        wait_until(lambda: push.pushed or push.error, 60, "the push")
        assert push.pushed, push.error
    finally:
        hub.close()
    assert {path.split("/")[4] for _, path, _ in hub.requests if path.startswith("/api/models/")} == {"tiny-lora"}
    published = hub.files["team/tiny-lora"]
    assert {"lorad-output.json", "README.md", "adapter_model.safetensors"} <= set(published)
    machine = [str(REPO), str(tmp_path), str(cfg.model.path), str(QUICKSTART_DATA), "/tmp/", "/work/", "/root/"]
    for name, data in published.items():
        for path in machine:
            assert path.encode() not in data, f"{name} carries {path}"
    stamp = json.loads(published["lorad-output.json"])
    assert stamp["dataset"]["path"] == QUICKSTART_DATA.name  # cut to its last part, not dropped
    local = workdir / "output" / "adapter_model.safetensors"
    assert load_file(local).keys() == load(published["adapter_model.safetensors"]).keys()
