"""bench/video_memory.py: it builds the published shapes on the meta device and labels every job sum arithmetic."""

from __future__ import annotations

import subprocess
import sys

from tests.helpers.processes import REPO, child_env


def test_video_memory_prints_the_published_sizes_and_labels_the_24gb_sums_arithmetic():
    out = subprocess.run([sys.executable, str(REPO / "bench" / "video_memory.py")], capture_output=True, text=True,
                         env=child_env(), cwd=REPO, timeout=300)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "parameters: 14.29 B" in text and "parameters: 5.00 B" in text and "parameters: 8.33 B" in text
    sums = [line for line in text.splitlines() if line.startswith("sum: ")]
    jobs = [line for line in text.splitlines() if line.startswith("## ") and "(arithmetic)" in line]
    assert len(sums) == len(jobs) == 3 and all(float(s.split()[1]) < 24 for s in sums)
