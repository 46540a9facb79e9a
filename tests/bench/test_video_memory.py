"""bench/video_memory.py: it builds the published shapes on the meta device and labels every job sum arithmetic."""

from __future__ import annotations

import runpy

from tests.helpers.processes import REPO


def test_video_memory_prints_the_published_sizes_and_labels_the_24gb_sums_arithmetic(capsys):
    # In this process (torch and diffusers are imported already): the script itself is two seconds of meta tensors.
    runpy.run_path(str(REPO / "bench" / "video_memory.py"), run_name="__main__")
    text = capsys.readouterr().out
    assert "parameters: 14.29 B" in text and "parameters: 5.00 B" in text and "parameters: 8.33 B" in text
    sums = [line for line in text.splitlines() if line.startswith("sum: ")]
    jobs = [line for line in text.splitlines() if line.startswith("## ") and "(arithmetic)" in line]
    assert len(sums) == len(jobs) == 3 and all(float(s.split()[1]) < 24 for s in sums)
