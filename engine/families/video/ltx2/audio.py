"""LTX-2's sound: a clip's audio track read through PyAV, turned into the log-mel spectrogram its audio VAE encodes,
and sample clips written with their sound. No dependency beyond PyAV and torch.

Reading. The window [start, start + F) of a clip at data.fps is the span start / fps … (start + F) / fps seconds
of its audio track, resampled by PyAV's own resampler (libswresample) to the audio VAE's sample rate in stereo
(a mono track is duplicated; LTX-2's audio VAE takes two channels), zero-padded where the track ends early. A clip
without an audio track (or a still, a GIF) has no sound: `window_audio` returns None and the window trains the
video branch only (engine/families/video/ltx2/family.py).

Spectrogram, as LTX-2's trainer computes it for its audio VAE: an STFT with a 1024-sample Hann window, hop
`mel_hop_length` (160), centred with reflect padding, its magnitude (power 1) through a Slaney-scale,
Slaney-normalised mel filter bank of `mel_bins` bands from 0 Hz to the Nyquist frequency, then log(max(x, 1e-5)).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

N_FFT = 1024
AUDIO_EXTS = (".mp4", ".webm", ".mov", ".mkv")


def has_audio(path: Path) -> bool:
    """Whether the file has an audio stream PyAV can open."""
    if Path(path).suffix.lower() not in AUDIO_EXTS:
        return False
    import av

    try:
        with av.open(str(path)) as box:
            return len(box.streams.audio) > 0
    except (av.error.FFmpegError, OSError):
        return False


def window_audio(path: Path, start: float, seconds: float, rate: int) -> torch.Tensor | None:
    """The clip's sound from `start` for `seconds`, [2, round(seconds · rate)] float in [-1, 1] at `rate` Hz, or None
    where the file has no audio track."""
    if not has_audio(path):
        return None
    import av
    import numpy as np

    want = round(seconds * rate)
    first = round(start * rate)
    chunks: list[np.ndarray] = []
    got = 0
    resampler = av.AudioResampler(format="fltp", layout="stereo", rate=rate)
    with av.open(str(path)) as box:
        for frame in box.decode(box.streams.audio[0]):
            for out in resampler.resample(frame):
                chunks.append(out.to_ndarray())
                got += chunks[-1].shape[1]
            if got >= first + want:
                break
        else:
            for out in resampler.resample(None):  # flush what the resampler still holds
                chunks.append(out.to_ndarray())
    wave = np.concatenate(chunks, axis=1) if chunks else np.zeros((2, 0), dtype=np.float32)
    wave = wave[:, first:first + want]
    if wave.shape[1] < want:
        wave = np.pad(wave, ((0, 0), (0, want - wave.shape[1])))
    return torch.from_numpy(np.ascontiguousarray(wave, dtype=np.float32))


def _hz_to_mel(f: torch.Tensor) -> torch.Tensor:
    """Slaney's mel scale: linear below 1 kHz, logarithmic above."""
    lin = f / (200.0 / 3)
    log = 15.0 + torch.log(f.clamp(min=1e-10) / 1000.0) / (math.log(6.4) / 27.0)
    return torch.where(f >= 1000.0, log, lin)


def _mel_to_hz(m: torch.Tensor) -> torch.Tensor:
    lin = m * (200.0 / 3)
    log = 1000.0 * torch.exp((math.log(6.4) / 27.0) * (m - 15.0))
    return torch.where(m >= 15.0, log, lin)


def mel_filters(rate: int, n_mels: int, n_fft: int = N_FFT) -> torch.Tensor:
    """[n_fft // 2 + 1, n_mels] triangular Slaney filters, each normalised to unit area (2 / bandwidth)."""
    freqs = torch.linspace(0, rate / 2, n_fft // 2 + 1, dtype=torch.float64)
    edges = _mel_to_hz(torch.linspace(float(_hz_to_mel(torch.tensor(0.0))),
                                      float(_hz_to_mel(torch.tensor(rate / 2.0))), n_mels + 2, dtype=torch.float64))
    diff = edges[1:] - edges[:-1]
    slopes = edges[None, :] - freqs[:, None]
    down = -slopes[:, :-2] / diff[:-1]
    up = slopes[:, 2:] / diff[1:]
    fb = torch.clamp(torch.minimum(down, up), min=0.0)
    return (fb * (2.0 / (edges[2:] - edges[:-2]))[None, :]).float()


def log_mel(wave: torch.Tensor, rate: int, n_mels: int, hop: int) -> torch.Tensor:
    """[1, 2, T, n_mels] log-mel spectrogram of a [2, N] waveform (module docstring), T = N // hop + 1."""
    spec = torch.stft(wave.float(), N_FFT, hop_length=hop, win_length=N_FFT, window=torch.hann_window(N_FFT),
                      center=True, pad_mode="reflect", return_complex=True).abs()  # [2, F, T]
    mel = torch.einsum("cft,fm->ctm", spec, mel_filters(rate, n_mels))
    return torch.log(mel.clamp(min=1e-5))[None]


def write_mp4_with_audio(frames, path, fps: float, audio, rate: int) -> None:
    """An H.264 MP4 of uint8 frames [F, H, W, 3] with an AAC stereo track of `audio` ([2, N] float in [-1, 1] at
    `rate` Hz); `path` a path or a writable binary file."""
    from fractions import Fraction

    import av
    import numpy as np

    wave = np.clip(np.asarray(audio, dtype=np.float32), -1, 1)
    with av.open(path if hasattr(path, "write") else str(path), mode="w", format="mp4") as box:
        video = box.add_stream("libx264", rate=Fraction(fps).limit_denominator(1000))
        video.width, video.height = int(frames.shape[2]), int(frames.shape[1])
        video.pix_fmt = "yuv420p"
        video.options = {"crf": "18", "preset": "veryfast"}
        sound = box.add_stream("aac", rate=rate, layout="stereo")
        for f in frames:
            box.mux(video.encode(av.VideoFrame.from_ndarray(f, format="rgb24")))
        box.mux(video.encode())
        step = sound.codec_context.frame_size or 1024
        for i in range(0, wave.shape[1], step):
            chunk = av.AudioFrame.from_ndarray(np.ascontiguousarray(wave[:, i:i + step]), format="fltp",
                                               layout="stereo")
            chunk.sample_rate, chunk.pts = rate, i
            box.mux(sound.encode(chunk))
        box.mux(sound.encode())
