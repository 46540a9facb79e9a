"""Video data (engine/data/videos.py): resampling to data.fps, the windows of data.frames, stills as one frame."""

from __future__ import annotations

import numpy as np
import pytest

from engine.data.clip_files import write_animated
from engine.data.videos import make_video_items, read_window, scan_videos


def _numbered_gif(path, frames: int, fps: float):
    """Frame k is flat grey 20·k: which source frame a window shows can be read back from its pixels."""
    write_animated(np.stack([np.full((16, 16, 3), 20 * k, dtype=np.uint8) for k in range(frames)]), path, fps)


def _shown(x) -> list[int]:
    return [round(float((x[0, f].mean() + 1) * 127.5) / 20) for f in range(x.shape[1])]


@pytest.mark.parametrize("fps,shown", [(5, [0, 2, 4, 6, 8]), (10, list(range(10))),
                                       (20, [k // 2 for k in range(20)])])
def test_a_clip_is_resampled_to_data_fps_showing_the_frame_on_screen_at_each_time(fps, shown, tmp_path):
    _numbered_gif(tmp_path / "n.gif", 10, 10)  # 10 frames at 10 fps: one second
    (rec,) = scan_videos(tmp_path, fps, "txt", None)
    assert rec.frames == len(shown) and not rec.still
    (item,) = make_video_items([rec], [16], [len(shown)])
    assert _shown(read_window(item, fps)) == shown


def test_windows_are_consecutive_per_length_and_the_short_tail_is_dropped(tmp_path):
    _numbered_gif(tmp_path / "n.gif", 10, 10)
    (rec,) = scan_videos(tmp_path, 14, "txt", None)  # 14 frames at 14 fps
    items = make_video_items([rec], [16], [5, 9, 17])
    assert [(it.bucket[0], it.start) for it in items] == [(5, 0), (5, 5), (9, 0)]
    assert {it.bucket[1:] for it in items} == {(16, 16)}
    second = read_window(items[1], 14)
    assert _shown(second) == [int(k * 10 / 14 + 1e-9) for k in range(5, 10)]  # the frame on screen at k / 14 s


def test_a_still_is_a_one_frame_video_in_a_bucket_of_its_own(tmp_path):
    from PIL import Image

    Image.new("RGB", (32, 16), (40, 40, 40)).save(tmp_path / "s.png")
    _numbered_gif(tmp_path / "n.gif", 10, 10)
    recs = scan_videos(tmp_path, 10, "txt", "sks")
    items = make_video_items(recs, [16, 64], [5])
    still = [it for it in items if it.record.still]
    assert [(it.bucket[0], it.resolution, it.start) for it in still] == [(1, 16, 0), (1, 64, 0)]
    f, w, h = still[1].bucket
    assert read_window(still[1], 10).shape == (3, 1, h, w) and w > h and recs[1].caption == "sks"


def test_a_folder_that_cannot_be_read_is_named_by_the_key_that_gave_it(tmp_path):
    from engine.errors import JobInvalid

    (tmp_path / "empty").mkdir()
    with pytest.raises(JobInvalid, match=r"^data\.path: .*empty contains no clips or images$"):
        scan_videos(tmp_path / "empty", 10, "txt", None)
    (tmp_path / "val").mkdir()
    (tmp_path / "val" / "cut.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42" + b"\x00" * 40)  # not a playable clip
    with pytest.raises(JobInvalid, match=r"^data\.validation\.path: cut\.mp4 "):
        scan_videos(tmp_path / "val", 10, "txt", None, key="data.validation.path")
