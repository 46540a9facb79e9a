"""What the captioner sees of one record: an image, or a clip's frames sampled evenly.

A clip of n frames at data.fps (engine/data/videos.py's count, the frames its windows are cut from) is shown as
data.captioner.frames images in one prompt: frames round(k·(n − 1)/(N − 1)) for k = 0 … N − 1, the first and the
last included (the middle one for N = 1), each repeated index once (a clip shorter than N gives fewer). They are
decoded as the video dataset decodes a window (engine/data/videos.py: PyAV, or Pillow for GIF and WebP; the frame
shown at each time), at full size: the captioner's processor resizes them as it resizes images.

Several images rather than a video input: every transformers vision-language model reads several images in one
prompt (Qwen3-VL, LLaVA, Gemma 3, SmolVLM), few read videos, and those through processors that need torchvision's
or another library's video decoding. The settings that decide which frames are seen (their count, data.fps, this
sampling's name) are part of the captioner's identity for clips (stage.py), so the store never hands one clip's
caption from other frames.
"""

from __future__ import annotations

SAMPLING = "even-v1"  # this module's rule, in the captioner's identity: another rule writes other captions


def frame_indices(n: int, count: int) -> list[int]:
    """The frames (at data.fps) of an n-frame clip that the captioner sees, ascending and distinct."""
    if n <= 1 or count == 1:
        return [max(n - 1, 0) // 2]
    return sorted({round(k * (n - 1) / (count - 1)) for k in range(count)})


class Unseeable(Exception):
    """A file the captioner cannot be shown (str: why, phrased after "it"). `lasting` when its bytes are at fault, so
    the same content breaks the same way again and the skip may be recorded (stage.py); not when the machine is
    (an OSError with an errno: gone, no permission, an I/O error; out of memory), which the next job retries."""

    def __init__(self, reason: str, lasting: bool):
        super().__init__(reason)
        self.lasting = lasting


def _lasting(e: BaseException | None) -> bool:
    return not isinstance(e, MemoryError) and not (isinstance(e, OSError) and e.errno is not None)


def images_of(record, fps: float, count: int) -> list:
    """The PIL images the captioner sees of one record: a still (or a plain image record) as itself, a clip's
    sampled frames. Unseeable when the image does not decode or the clip breaks before its last sampled frame."""
    from engine.config.clips import ClipUnreadable
    from engine.data.images import load_upright
    from engine.data.videos import _frames_at

    try:
        if getattr(record, "still", True):  # an image job's record has no `still`: an image
            return [load_upright(record.path)]
        return _frames_at(record.path, [i / fps for i in frame_indices(record.frames, count)])
    except ClipUnreadable as e:  # raised `from None`: what broke is its context
        raise Unseeable(str(e), _lasting(e.__context__)) from None
    except Exception as e:  # noqa: BLE001 - Pillow raises many kinds for a broken image (a truncated one: OSError)
        raise Unseeable(f"is not a readable image ({type(e).__name__}: {e})", _lasting(e)) from None
