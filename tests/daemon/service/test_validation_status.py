"""The trainer's `validation` events reach `lorad status` (VAL column), `lorad status ID` and the dashboard."""

from __future__ import annotations

import sqlite3
import time

from daemon.client.render import print_detail, print_table
from daemon.protocol import JobDetail, JobRow
from daemon.store.db import Store
from daemon.supervisor.trainer import Child
from daemon.web.storeview import Series

# what engine/run.py logs after an evaluation of data.validation
VALIDATION = {"event": "validation", "step": 4, "loss": 1.25, "batches": 2}


def _child(job_id: str, tmp_path) -> Child:
    return Child(job_id=job_id, name="tiny", workdir=tmp_path, popen=None, pid=1, pid_start=None, gpu=None,
                 attempt=1, start_step=0, total=12, power={})


def test_the_last_validation_loss_is_in_both_status_views_and_outlives_a_resume(tmp_path, capsys):
    store = Store(tmp_path / "state.db")
    store.add_job("tiny-1", "tiny", tmp_path, 0, 12, None)
    c = _child("tiny-1", tmp_path)
    c.heard({"event": "step", "step": 4, "total": 12, "loss": 2.5}, time.monotonic())
    c.heard(VALIDATION, time.monotonic())
    store.update("tiny-1", **c.progress())
    # a resumed attempt that has not validated yet keeps the last value
    store.update("tiny-1", **_child("tiny-1", tmp_path).progress())
    job = store.get("tiny-1")
    assert (job["val_loss"], job["val_step"]) == (1.25, 4)

    print_table({"jobs": [JobRow.model_validate(job).model_dump()]})
    header, row = (ln.split() for ln in capsys.readouterr().out.splitlines()[:2])
    assert header[header.index("LOSS") + 1] == "VAL" and row[header.index("VAL")] == "1.2500"
    print_detail({"job": JobDetail.model_validate({**job, "attempts": [], "events": []}).model_dump()})
    assert "validation loss: 1.2500 (step 4)" in capsys.readouterr().out


def test_the_val_column_is_there_only_when_a_job_validates(tmp_path, capsys):
    store = Store(tmp_path / "state.db")
    store.add_job("plain-1", "plain", tmp_path, 0, 12, None)
    print_table({"jobs": [JobRow.model_validate(store.get("plain-1")).model_dump()]})
    assert "VAL" not in capsys.readouterr().out.splitlines()[0].split()
    store.add_job("tiny-1", "tiny", tmp_path, 0, 12, None)
    store.update("tiny-1", val_loss=0.5, val_step=2)
    print_table({"jobs": [JobRow.model_validate(j).model_dump() for j in store.jobs()]})
    header, *rows = (ln.split() for ln in capsys.readouterr().out.splitlines())
    assert {r[0]: r[header.index("VAL")] for r in rows} == {"plain-1": "-", "tiny-1": "0.5000"}


def test_a_state_db_from_before_validation_gains_its_columns(tmp_path):
    Store(tmp_path / "state.db").close()
    db = sqlite3.connect(tmp_path / "state.db")
    db.execute("ALTER TABLE jobs DROP COLUMN val_loss")
    db.execute("ALTER TABLE jobs DROP COLUMN val_step")
    db.commit()
    db.close()
    store = Store(tmp_path / "state.db")
    store.add_job("tiny-1", "tiny", tmp_path, 0, 12, None)
    store.update("tiny-1", val_loss=0.5, val_step=2)
    assert store.get("tiny-1")["val_loss"] == 0.5


def test_the_dashboard_draws_the_validation_series():
    series = Series()
    series.add({"event": "step", "step": 4, "loss": 2.5})
    series.add(VALIDATION)
    assert series.val == {4: 1.25}
