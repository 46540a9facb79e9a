"""output.push_to_hub: never part of success; a push that cannot land is said once and retried."""

from __future__ import annotations

import shutil

from daemon.mirror.hub import HubPush
from engine.report.events import read_events
from tests.helpers.daemon import wait_until
from tests.helpers.fakes import RecLog


def test_a_push_the_hub_refuses_is_reported_once_and_retried_with_backoff(tmp_path, finished_tiny_job):
    workdir = tmp_path / "work"
    shutil.copytree(finished_tiny_job[2], workdir)
    log = RecLog()
    # Nothing listens there: the network being down, as the push sees it.
    push = HubPush("tiny-1", workdir, "someone/tiny-lora", log, retry_base_s=0.05, retry_max_s=0.1,
                   endpoint="http://127.0.0.1:9").start()
    wait_until(lambda: push.tries >= 3, 60, "three tries")
    push.close()
    assert not push.pushed and push.status()["hub_error"]
    assert len(log.named("hub_push_failed")) == 1  # said once per cause, not per try
    said = [e for e in read_events(workdir) if e.get("event") == "hub_push_failed"]
    assert len(said) == 1 and said[0]["repo"] == "someone/tiny-lora"
