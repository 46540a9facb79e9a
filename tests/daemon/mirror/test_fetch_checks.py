"""A job fetched from a mirror has its files checked as the intake's are: in a worker with a deadline.

The fetch thread validated the job's text itself, with no deadline (issue 38, A: daemon/mirror/service.py called
validate_text directly), so a read that never returns (a data file on a hung network mount) pinned the download
for ever and the job stayed `fetching`. A daemon that starts with such jobs still fetching (resume) now fails
them within the check's deadline, naming the path: a FIFO at data.path (refused by the engine's opening rules),
and a data file whose open blocks (the hung mount: a syscall no Python code can bound, simulated here by an open
that waits). A file:// mirror; no trainer.
"""

from __future__ import annotations

import os
import threading
import time

import yaml

from daemon.config.daemon import DaemonConfig
from daemon.mirror.service import Mirrors
from daemon.store import states
from daemon.store.db import Store
from engine.config import bounded, sources
from tests.helpers.daemon import wait_until
from tests.helpers.fakes import RecLog
from tests.helpers.jobs import good_job


def test_a_fifo_or_a_hung_file_named_by_a_job_fetched_from_a_mirror_fails_it_within_the_deadline(tmp_path,
                                                                                                 monkeypatch):
    home, nas = tmp_path / "home", tmp_path / "nas"
    (home / "d").mkdir(parents=True)
    fifo, hung = home / "d" / "data.jsonl", home / "d" / "on-a-hung-mount.jsonl"
    os.mkfifo(fifo)  # a socket-group member's, inside allowed_roots: reading it blocks until a writer comes
    hung.write_text('{"text": "never read"}\n')
    released = threading.Event()
    real_open = sources.open_regular

    def open_regular(path, key):
        if str(path) == str(hung):
            bounded.tick(key, path)
            released.wait(60)  # the hung mount's read: it returns when the test ends, not before
        return real_open(path, key)

    monkeypatch.setattr(sources, "open_regular", open_regular)
    cfg = DaemonConfig.model_validate({"allowed_roots": ["{home}"], "intake_check_s": 1.0,
                                       "mirrors": {"nfs": {"url": f"file://{nas}"}}})
    store, log = Store(home / "state.db"), RecLog()
    for name, data in (("piped", fifo), ("hung", hung)):  # downloads the last daemon left behind
        text = yaml.safe_dump(good_job(name, data={"path": str(data), "seq_len": 32}))
        store.add_job(f"{name}-1a2b", name, home / "jobs" / f"{name}-1a2b", 0, 5, f"mirror:nfs/{name}-9f9f",
                      text=text, state=states.FETCHING)
    mirrors = Mirrors(home, cfg, store, log)
    try:
        t0 = time.monotonic()
        mirrors.resume()
        wait_until(lambda: all(store.get(j)["state"] == states.FAILED for j in ("piped-1a2b", "hung-1a2b")), 10,
                   "both fetches failed by their deadline")
        assert time.monotonic() - t0 < 5
        assert str(fifo) in store.get("piped-1a2b")["last_error"]
        assert str(hung) in store.get("hung-1a2b")["last_error"]
    finally:
        released.set()
        mirrors.close()
        store.close()
