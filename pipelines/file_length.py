"""How long a video file says it is, and whether its decoding came short of that.

`stated_rate` is the frame rate a container (or, in a raw stream, its decoder) states;
`announced_frames` the frame count it announces (None when it does not say); `cut_short` where
decoding ended well before either, None when nothing is missing. All read an open PyAV container
and its video stream; `FileSource` answers `fps` and `frame_count` with them.
"""

from __future__ import annotations

import math

AVFMT_NOTIMESTAMPS = 0x80  # FFmpeg's flag of a format that stores no times: a raw H.264/H.265 stream (a camera's export)
MAX_RATE = 1000  # frames a second past which a stream's stated rate is taken for nonsense


def stated_rate(container, stream) -> float | None:
    if container.format.flags & AVFMT_NOTIMESTAMPS:
        # A raw stream's "average" is the demuxer's default of 25; the rate the stream itself
        # states (its SPS) is the decoder's. A 15 fps camera's export ran 1.67x fast, its
        # frames' times (index / fps: it has no others) too early, --fps picked other frames.
        stated = stream.codec_context.framerate
        # A stream may state nonsense (90000 fps: every frame at 0 s); then FFmpeg's guess.
        rate = stated if stated and 0.5 <= stated <= MAX_RATE else stream.guessed_rate or stream.average_rate
    else:
        rate = stream.average_rate or stream.guessed_rate
        if rate and rate > MAX_RATE and stream.guessed_rate:
            # A raw DV file's (a camcorder tape's capture) "average" is its time base, 60000
            # fps for 25: a bar to 120000 frames, its subtitles and annotated video cut short.
            rate = stream.guessed_rate
    return float(rate) if rate else None


def announced_frames(container, stream, fps: float | None) -> int | None:
    """Frames the container announces (may be 0/None for streams that do not say)."""
    if stream.frames:
        seconds = float(stream.duration * stream.time_base) if stream.duration and stream.time_base else None
        if seconds and fps:
            # An edit list hides frames its file keeps: a clip cut with `ffmpeg -ss -c copy` or
            # trimmed on a phone holds the frames back to the keyframe before its start, which
            # are never shown. Counted, they made a false "truncated file?" warning.
            return min(int(stream.frames), math.ceil(seconds * fps - 1e-6))
        return int(stream.frames)
    if container.duration and fps:
        # The container's duration runs from its earliest stream's start: an MKV or TS recording's
        # video begins at its first keyframe, after its sound. A second late, a bar to 90 frames
        # ended at 60 (a folder's total, too).
        micros = container.duration  # in microseconds, as FFmpeg's are
        if stream.start_time is not None and stream.time_base:
            late = round(stream.start_time * stream.time_base * 1_000_000) - (container.start_time or 0)
            micros -= max(0, late)
        # (to the microsecond: 30 frames of NTSC, 1.001 s at 30000/1001 fps, came to 29.999999)
        return int(micros / 1_000_000 * fps + 1e-6) if micros > 0 else None
    return None


def cut_short(container, stream, announced: int | None, fps: float | None, index: int, end: float | None,
              shown_end: float | None, damaged: bool = False) -> str | None:
    """Where decoding ended well before the container's own frame count (MP4, MOV), or before
    its duration where the video is its only stream (MKV, WebM: an audio track may run longer
    than the video). By time there, not by the duration's worth of frames at the average rate:
    a variable-rate file has no such count, nor one whose video starts late (7 s in), and
    complete ones of both kinds were said to be cut. `end`: the last frame's end, in the
    file's own time; `shown_end`: where it stops showing (`FileSource.end`). None when nothing
    is missing. `damaged`: packets were rejected on the way, their frames missing wherever they
    were, so that only a last frame well before the video's own end (by its stream's duration)
    says the file was cut short."""
    by_time = None  # (where decoding ended, the video's length), in seconds
    if damaged and stream.frames:
        if shown_end is not None and stream.duration and stream.time_base:  # from the file's start
            by_time = shown_end, float(stream.duration * stream.time_base)
    elif stream.frames:
        if announced and index < announced * 0.9 and announced - index >= 3:
            return f"after {index} of the {announced} frames"
    elif len(container.streams) == 1 and container.duration and end is not None:
        by_time = end, container.duration / 1_000_000
    if by_time is not None:
        done, total = by_time
        if done < total * 0.9 and total - done >= 3 / (fps or 30.0):
            return f"at {done:.1f} s of the {total:.1f} s"
    return None
