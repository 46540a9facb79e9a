"""The dashboard's samples of an edit job: each prompt's control image beside its samples."""

from __future__ import annotations

import json

from daemon.web.history import Series
from daemon.web.pages import samples_grid


def test_an_edit_jobs_samples_show_each_prompts_control_left_of_its_samples():
    ev = {"event": "samples", "step": 4, "paths": ["/w/samples/step-00000004/00.png", "/w/samples/step-00000004/01.png"],
          "prompts": ["make it red", "plain"], "controls": [["/data/c.png"], []],
          "control_images": [["/w/samples/step-00000004/00-control-0.png"], []]}
    h = Series()
    h.add(json.loads(json.dumps(ev)))  # as the dashboard reads a line of events.jsonl
    html = samples_grid("job-1", h.samples)
    assert "<th>control</th>" in html
    row = html.split("<tr>")[2]  # the first prompt's row: its control, then its sample
    assert row.index("/jobs/job-1/samples/4/00-control-0.png") < row.index("/jobs/job-1/samples/4/00.png")
    assert "control" not in html.split("<tr>")[3].split("</td>", 1)[1].split("<td>")[1]  # the plain prompt: none


def test_samples_without_controls_keep_their_grid():
    html = samples_grid("j", {2: {"paths": ["/p/00.png"], "prompts": ["a cat"]}})
    assert "<th>control</th>" not in html and "/jobs/j/samples/2/00.png" in html
