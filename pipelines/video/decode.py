"""Video decoding and frame sampling for the video ingest (PyAV + numpy, no torch).

`decode_video` turns the bytes of one object into the sampled frames, resized
(shorter side to `size`, centre crop) to `(T, size, size, 3)` uint8 RGB, with
each frame's index in the source and the source fps; or raises `RejectedVideo`
with a short reason: empty file, not a video, an unsupported container or codec,
no video stream (audio only), no frames, corrupt or truncated data, too many
pixels per frame.

Frame indices count decoded frames in presentation order. Sampling is by index,
not time, so variable frame rates need no special case; the fps is recorded.
Indices are planned from a cheap demux pass (packets per stream); when the
decoder returns a different number of frames the plan is redone on the true
count.
"""

from __future__ import annotations

import io
import re
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

# Demuxers accepted (FFmpeg names): MP4/MOV, Matroska/WebM, AVI.
CONTAINERS = {"mov,mp4,m4a,3gp,3g2,mj2": "mp4", "matroska,webm": "mkv", "avi": "avi"}
TRUNCATED_COVERAGE = 0.75  # decoded frames spanning less of the declared duration than this: truncated


class RejectedVideo(Exception):
    """An object that cannot be used as a video; the message is the reason recorded in the manifest."""


@dataclass
class DecodedVideo:
    frames: np.ndarray  # (T, size, size, 3) uint8
    indices: np.ndarray  # (T,) int32, index of each frame in the source
    fps: float  # the source's average frame rate, 0.0 if unknown
    total_frames: int  # frames decoded from the source


def full_indices(total: int, max_frames: int) -> np.ndarray:
    """Up to `max_frames` indices spread uniformly over `total` frames: every frame of a short
    video, else the centres of `max_frames` equal segments (as `vit.vtn.sample_frame_indices`)."""
    if total <= max_frames:
        return np.arange(total, dtype=np.int32)
    return np.minimum(((np.arange(max_frames) + 0.5) * total / max_frames).astype(np.int64), total - 1).astype(np.int32)


def clip_indices(total: int, clip_length: int, frame_stride: int, clip_stride: int, max_clips: int) -> np.ndarray:
    """Clips back to back: `clip_length` frames `frame_stride` apart, starts `clip_stride` apart,
    at most `max_clips` spread evenly over the possible starts. A video shorter than one clip
    gives one clip resampled with repeated frames."""
    span = (clip_length - 1) * frame_stride + 1
    if total < span:
        return np.minimum(((np.arange(clip_length) + 0.5) * total / clip_length).astype(np.int64), total - 1).astype(np.int32)
    starts = np.arange(0, total - span + 1, clip_stride)
    if len(starts) > max_clips:
        starts = starts[np.round(np.linspace(0, len(starts) - 1, max_clips)).astype(int)]
    return (starts[:, None] + np.arange(clip_length) * frame_stride).reshape(-1).astype(np.int32)


def decode_video(data: bytes, size: int, select: Callable[[int], np.ndarray], *, max_pixels: int) -> DecodedVideo:
    """Decode the frames that `select(total_frames)` names, resized and centre-cropped to `size`."""
    import av

    if not data:
        raise RejectedVideo("empty file")
    container = _open(data)
    try:
        stream = _video_stream(container)
        cc = stream.codec_context
        if cc.width * cc.height > max_pixels:
            raise RejectedVideo(f"too many pixels ({cc.width}x{cc.height} > {max_pixels} per frame)")
        try:
            packets, data_end = _demux_pass(container, stream)
        except (av.FFmpegError, ValueError) as exc:
            raise RejectedVideo(f"corrupt or truncated ({_short(exc)})") from None
        declared, of_all_streams = _declared_seconds(container, stream)
        fps = float(stream.average_rate or stream.guessed_rate or 0.0)
    finally:
        container.close()

    wanted = select(max(packets, 1)) if packets else np.zeros(0, np.int32)
    total, stored, times = _decode(data, size, set(wanted.tolist()))
    if total == 0:
        if declared:
            raise RejectedVideo(f"corrupt or truncated (no frame decodes of {declared:.2f} s declared)")
        raise RejectedVideo("no video frames")
    if total != packets or not set(wanted.tolist()) <= stored.keys():
        wanted = select(total)  # the demux count was off: plan again on the decoded count
        if not set(wanted.tolist()) <= stored.keys():
            total, stored, times = _decode(data, size, set(wanted.tolist()))
    if declared and times is not None and fps > 0:
        covered = times[1] - times[0] + 1 / fps
        if of_all_streams:  # the container's duration spans every stream: a longer audio track is no truncation
            covered = max(covered, data_end)
        if covered < TRUNCATED_COVERAGE * declared - 1 / fps:
            raise RejectedVideo(f"corrupt or truncated (frames cover {covered:.2f} s of {declared:.2f} s declared)")
    if fps <= 0 and times is not None and times[1] > times[0]:
        fps = (total - 1) / (times[1] - times[0])
    frames = np.stack([stored[i] for i in wanted.tolist()]) if len(wanted) else np.zeros((0, size, size, 3), np.uint8)
    return DecodedVideo(frames, wanted.astype(np.int32), fps, total)


def _open(data: bytes):  # -> av.container.InputContainer
    import av

    try:
        container = av.open(io.BytesIO(data), mode="r", metadata_errors="ignore")
    except Exception as exc:  # untrusted bytes: any parser failure is a rejection, never a crash
        if _container_magic(data):
            raise RejectedVideo(f"corrupt or truncated ({_short(exc)})") from None
        raise RejectedVideo("not a video (unrecognised format)") from None
    name = container.format.name
    if name not in CONTAINERS:
        container.close()
        raise RejectedVideo(f"unsupported container ({name}; accepted: MP4, MKV/WebM, AVI)")
    return container


def _video_stream(container):  # -> av.video.stream.VideoStream
    if not container.streams.video:
        if container.streams.audio:
            raise RejectedVideo("no video stream (audio only)")
        raise RejectedVideo("no video stream")
    stream = container.streams.video[0]
    if stream.codec_context is None:
        raise RejectedVideo("unsupported codec (no decoder for the video stream)")
    stream.codec_context.thread_count = 1  # a Ray task holds one CPU
    return stream


def _decode(data: bytes, size: int, wanted: set[int]) -> tuple[int, dict[int, np.ndarray], tuple[float, float] | None]:
    """Decode every frame, keeping those in `wanted`; returns the frame count, the kept frames
    and the presentation times of the first and last frame (None if unknown)."""
    import av

    container = _open(data)
    stored: dict[int, np.ndarray] = {}
    first = last = None
    total = 0
    try:
        stream = _video_stream(container)
        for frame in container.decode(stream):
            if total in wanted:
                stored[total] = _resize(frame, size)
            if frame.time is not None:
                first = frame.time if first is None else first
                last = frame.time
            total += 1
    except RejectedVideo:
        raise
    except (av.FFmpegError, ValueError, MemoryError) as exc:
        raise RejectedVideo(f"corrupt or truncated ({_short(exc)})") from None
    finally:
        container.close()
    return total, stored, (first, last) if first is not None and last is not None else None


def _resize(frame, size: int) -> np.ndarray:
    """Shorter side to `size` (area filter when shrinking), then the centre `size`×`size` crop, RGB."""
    w, h = frame.width, frame.height
    if w <= h:
        nw, nh = size, max(size, round(h * size / w))
    else:
        nw, nh = max(size, round(w * size / h)), size
    shrink = nw < w
    rgb = frame.reformat(width=nw, height=nh, format="rgb24", interpolation="AREA" if shrink else "BILINEAR")
    arr = rgb.to_ndarray()
    top, left = (nh - size) // 2, (nw - size) // 2
    return np.ascontiguousarray(arr[top:top + size, left:left + size])


def _demux_pass(container, stream) -> tuple[int, float]:
    """(non-empty packets of the video stream, seconds from the start at which the last packet of any stream ends)."""
    packets, end = 0, 0.0
    for p in container.demux():
        if p.stream.index == stream.index and p.size:
            packets += 1
        if p.pts is not None and p.time_base:
            end = max(end, float((p.pts + (p.duration or 0)) * p.time_base))
    return packets, end - (container.start_time or 0) / 1_000_000


def _declared_seconds(container, stream) -> tuple[float, bool]:
    """The video's declared duration (its own, else its Matroska DURATION tag, else the container's), 0 if none;
    and whether it is the container's for several streams (then it is the longest stream's)."""
    if stream.duration and stream.time_base:
        return float(stream.duration * stream.time_base), False
    tag = re.fullmatch(r"(\d+):(\d+):(\d+(?:\.\d*)?)", str(stream.metadata.get("DURATION", "")).strip())
    if tag:
        return int(tag[1]) * 3600 + int(tag[2]) * 60 + float(tag[3]), False
    if container.duration:
        return container.duration / 1_000_000, len(container.streams) > 1
    return 0.0, False


def _container_magic(data: bytes) -> bool:
    """Whether the bytes start like an MP4/MOV, Matroska/WebM or AVI file (then a failure is corruption)."""
    return (
        data[4:8] in (b"ftyp", b"moov", b"mdat", b"free", b"wide", b"skip")
        or data[:4] == b"\x1a\x45\xdf\xa3"
        or (data[:4] == b"RIFF" and data[8:12] == b"AVI ")
    )


def _short(exc: BaseException) -> str:
    # FFmpeg errors read "[Errno N] Message: '<none>'"; keep the message.
    text = " ".join(str(exc).split())
    text = re.sub(r"^\[Errno -?\d+\] ", "", text)
    text = re.sub(r": '<none>'$", "", text)
    text = re.sub(r" ?(<[^>]*>|at 0x[0-9a-fA-F]+)", "", text)
    return (text or type(exc).__name__)[:120]
