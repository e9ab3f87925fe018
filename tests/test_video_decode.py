"""`pipelines.video.decode` on single files made here (no Ray): what is kept and what is refused."""

from __future__ import annotations

import io

import av
import numpy as np
import pytest

from pipelines.video.decode import RejectedVideo, decode_video, full_indices


def encode(fmt: str, frames: int = 25, audio_seconds: float = 0.0) -> bytes:
    """A 25 fps MPEG-4 video of `frames` frames, with an AAC track of `audio_seconds` when > 0."""
    buf = io.BytesIO()
    with av.open(buf, "w", format=fmt) as container:
        video = container.add_stream("mpeg4", rate=25)
        video.width, video.height, video.pix_fmt = 32, 32, "yuv420p"
        audio = container.add_stream("aac", rate=8000) if audio_seconds else None
        for i in range(frames):
            frame = av.VideoFrame.from_ndarray(np.full((32, 32, 3), i * 9 % 255, np.uint8), format="rgb24")
            frame.pts = i
            for packet in video.encode(frame):
                container.mux(packet)
        for packet in video.encode():
            container.mux(packet)
        for start in range(0, int(audio_seconds * 8000) if audio else 0, 1024):
            samples = av.AudioFrame.from_ndarray(np.zeros((1, 1024), np.float32), format="fltp", layout="mono")
            samples.sample_rate, samples.pts = 8000, start
            for packet in audio.encode(samples):
                container.mux(packet)
        for packet in audio.encode() if audio else []:
            container.mux(packet)
    return buf.getvalue()


def decode(data: bytes):
    return decode_video(data, 16, lambda total: full_indices(total, 8), max_pixels=10**6)


@pytest.mark.parametrize("fmt", ["matroska", "mp4"])
def test_a_whole_video_with_a_longer_audio_track_is_kept_not_called_truncated(fmt):
    video = decode(encode(fmt, frames=25, audio_seconds=10.0))
    assert video.total_frames == 25 and video.frames.shape == (8, 16, 16, 3)


def test_a_video_only_matroska_file_cut_in_half_is_still_rejected_as_truncated():
    data = encode("matroska", frames=100)
    with pytest.raises(RejectedVideo, match="corrupt or truncated"):
        decode(data[: len(data) // 2])


def test_a_matroska_file_with_audio_cut_in_half_is_still_rejected_as_truncated():
    data = encode("matroska", frames=100, audio_seconds=4.0)
    with pytest.raises(RejectedVideo, match="corrupt or truncated"):
        decode(data[: len(data) // 2])
