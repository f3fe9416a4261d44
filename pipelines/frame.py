"""What every frame source yields (`Frame`), how it fails (`SourceError`), and the decoding they
share: packets the decoder rejects are skipped, the stream a player would show is the one read,
and pixels come as a player shows them (interlaced frames made whole, display rotation applied,
non-square pixels stretched), unless a `Reading` says to read them as stored.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Iterator

import numpy as np

from engine.errors import VlmstreamError

from .deinterlace import Deinterlacer
from .hdr import is_hdr, to_sdr


class SourceError(VlmstreamError):
    """A source cannot be opened or read (missing, not a video, no video stream...)."""


class SourceSilent(SourceError):
    """A stream, a pipe's program or a webcam given up because it sent nothing for longer than it
    may (`Connection.retry`, `wait_for_input`, `WebcamSource`): a camera that is off, not a wrong
    address or password.
    A run that ends on it exits 1, as one in which no source delivered a frame does, not 2: it had
    exited as a wrong URL does, which a supervisor is right not to restart."""

    exit_code = 1


@dataclass(frozen=True)
class Reading:
    """How a source's decoded frames become pixels. The defaults show them as a player does;
    each switch off reads them as stored, for a video whose flags say otherwise than its
    pictures: a progressive film flagged interlaced (PsF masters, some capture cards), or SDR video
    tagged HLG or PQ by a wrong export (tone-mapped, it comes out dim and flat)."""

    deinterlace: bool = True  # frames flagged interlaced made whole (`deinterlace.py`)
    tonemap: bool = True  # HDR frames (HLG, PQ) tone-mapped to SDR BT.709 (`hdr.py`)


AS_SHOWN = Reading()


@dataclass
class Frame:
    source_id: str
    index: int  # position in the source's decode order (every decoded frame counts)
    pts: float  # presentation time in seconds
    rgb: np.ndarray | None = field(repr=False)  # (H, W, 3) uint8; None: not converted (see FileSource.frames)
    captured_at: float = field(default_factory=time.perf_counter)
    # A live source's frame comes unconverted (rgb None) with this to convert it: a frame a slower
    # consumer never takes costs no conversion (23 ms a 4K frame)
    convert: Callable[[], np.ndarray] | None = field(default=None, repr=False, compare=False)

    def load(self) -> "Frame":
        """The frame with its pixels converted, if they were left for later (`convert`)."""
        if self.rgb is None and self.convert is not None:
            self.rgb, self.convert = self.convert(), None
        return self


def rotate(rgb: np.ndarray, degrees: int) -> np.ndarray:
    """Apply a display rotation (counter-clockwise degrees, as FFmpeg's display matrix gives)."""
    turns = (int(round(degrees / 90)) % 4)
    return np.ascontiguousarray(np.rot90(rgb, k=turns)) if turns else rgb


def as_shown(frame, sample_aspect, tonemap: bool = True) -> np.ndarray:
    """The frame's RGB pixels as a player shows them. Non-square pixels (a sample aspect ratio
    other than 1: DVD, DV, HDV, broadcast TV) are stretched to the display shape, in the same
    swscale pass as the colour conversion. Read as stored, a 16:9 PAL frame (720x576) squeezes every
    circle to an ellipse: of 60 scenes stored at half their width, the tiny model named all the
    objects of 65 % against 83 % unsqueezed. Stretching (never shrinking) keeps every stored
    pixel's detail. HDR video is tone-mapped to SDR (`hdr.py`; `tonemap` False: converted as if
    SDR). Then the display rotation."""
    width, height = frame.width, frame.height
    if sample_aspect and sample_aspect != 1:
        if sample_aspect > 1:
            width = max(2, round(width * sample_aspect / 2) * 2)
        else:
            height = max(2, round(height / sample_aspect / 2) * 2)
    if tonemap and is_hdr(frame):  # tone-mapped, in the same pass
        rgb = to_sdr(frame, width, height)
    elif (width, height) != (frame.width, frame.height):
        rgb = frame.to_ndarray(format="rgb24", width=width, height=height)
    else:
        rgb = frame.to_ndarray(format="rgb24")
    return rotate(rgb, getattr(frame, "rotation", 0) or 0)


def pixels(frame, sample_aspect, lazy: bool, reading: Reading = AS_SHOWN) -> dict:
    """A decoded frame's pixels as `Frame` fields: converted now, or (lazy) left to `Frame.load`."""
    if lazy:
        return {"rgb": None, "convert": partial(as_shown, frame, sample_aspect, reading.tonemap)}
    return {"rgb": as_shown(frame, sample_aspect, reading.tonemap)}


def decoded(container, stream, on_damage: Callable[[], None],
            before_packet: Callable[[float], None] | None = None, reading: Reading = AS_SHOWN,
            on_corrupt: Callable[[], None] | None = None, retime: Callable | None = None,
            on_concealed: Callable[[], None] | None = None) -> Iterator:
    """The stream's frames, packet by packet, skipping the packets the decoder rejects (damaged
    data: a bad sector, a lost datagram, a stream joined between keyframes), as FFmpeg's own tools
    do. `container.decode` ended at the first: a file with 20 KB damaged in its middle gave 180 of
    its 329 decodable frames. A packet the demuxer marks corrupt (an MPEG-TS packet after lost
    ones: 6 frames went missing without a word) is decoded, and said to `on_corrupt` if given.
    A frame the decoder patched over damaged data it did not reject (error concealment: FFmpeg's
    "error while decoding MB") is given, and said to `on_concealed` if given.
    `before_packet(waited)` is told before each packet how many seconds the demuxer took to
    give it (a live stream's reader waiting for the sender). `retime(packet)` may move a packet's times before it is decoded
    (`timestamps.Continuous`). Interlaced frames come whole (`Deinterlacer`), unless `reading`
    says to leave them woven."""
    import av

    deinterlacer = Deinterlacer()
    sent = made = 0
    last_pts = None

    def shown(frame) -> Iterator:
        return deinterlacer.push(frame) if reading.deinterlace else iter((frame,))

    packets = container.demux(stream)
    while True:
        asked = time.perf_counter()
        packet = next(packets, None)
        if packet is None:
            break
        if before_packet is not None:
            before_packet(time.perf_counter() - asked)
        if retime is not None:
            retime(packet)
        try:
            frames = packet.decode()
        except av.InvalidDataError:
            on_damage()
            continue
        if packet.is_corrupt and on_corrupt is not None:  # the demuxer saw data lost (MPEG-TS continuity)
            on_corrupt()
        sent += packet.size > 0
        for frame in frames:
            made += 1
            if on_concealed is not None and frame.is_corrupt:
                on_concealed()
            last_pts = frame.pts if frame.pts is not None else last_pts
            yield from shown(frame)
    if made < sent and last_pts is not None and stream.codec_context.thread_type & av.codec.context.ThreadType.FRAME:
        for frame in _frames_after(container, stream, last_pts):
            yield from shown(frame)
    yield from deinterlacer.flush()


def _frames_after(container, stream, pts: int) -> Iterator:
    """The frames after `pts` that frame threads decoded but never gave: PyAV ends its drain at
    the first frame the decoder says is damaged (a truncated file's last packet), and the frames
    the other threads held after it were lost (a file cut short gave 58 of its 60 frames, FFmpeg
    60). They come from the last keyframe again, decoded one frame at a time. Files only: a
    network source is not asked twice."""
    import os

    import av

    if not os.path.isfile(container.name):
        return
    try:
        with av.open(container.name) as again:
            copy = again.streams[stream.index]
            again.seek(pts, stream=copy, backward=True, any_frame=False)
            for packet in again.demux(copy):
                try:
                    frames = packet.decode()
                except av.InvalidDataError:
                    continue
                yield from (f for f in frames if f.pts is not None and f.pts > pts)
    except (av.FFmpegError, OSError, ValueError):  # what the first reading gave stands
        return


# FFmpeg demuxers that draw a file's bytes as pictures (ANSI art: any text of a few hundred bytes
# with a .txt, .nfo, .asc ... name or URL is "video" to them), and its playlist of other files by
# name. A web UI user gave a server path (the --auth-file) or an internal URL ending "?x=.txt" as
# a source and read its text in the frames.
TEXT_FORMATS = frozenset({"tty", "bintext", "xbin", "adf", "idf"})
PLAYLIST_FORMATS = frozenset({"concat"})


def refuse_text(container, name: str):
    """The container, unless FFmpeg opened it as text or as a list of other files: it is then
    closed and refused."""
    formats = set(container.format.name.split(","))
    if formats & (TEXT_FORMATS | PLAYLIST_FORMATS):
        container.close()
        what = "text" if formats & TEXT_FORMATS else "a list of other files (ffconcat)"
        raise SourceError(f"{name} is not a readable video: FFmpeg reads it as {what}")
    return container


AV_DISPOSITION_ATTACHED_PIC = 0x400


def video_streams(container) -> list:
    """The container's video streams, less cover pictures (an MP3's or an audio MP4's album art
    is a "video" stream of one picture: read as a video of one frame at 90000 fps, with a 1 ms
    subtitle, or looped in `live` at 30 fps)."""
    def cover(stream) -> bool:  # PyAV has Stream.disposition from 14.1, first as a Flag, then an IntFlag
        disposition = getattr(stream, "disposition", 0)
        return bool(getattr(disposition, "value", disposition) & AV_DISPOSITION_ATTACHED_PIC)

    return [s for s in container.streams.video if not cover(s)]


def no_video(container, name: str) -> SourceError | None:
    """The error of a container with no video to read (none, or only a cover picture), else None."""
    if video_streams(container):
        return None
    return SourceError(f"{name} has no video stream" + (" (only a cover picture)" if container.streams.video else ""))


MAX_VARIANT_PIXELS = 1920 * 1080


def main_video(container):
    """The video stream a player would show: FFmpeg's choice (the most frames, the default
    disposition), not the first, and never a cover picture; of an HLS master playlist's
    variants, the largest up to 1080p. A Matroska file with a cover picture
    first gave one frame of the cover and no word about the film. Call it on a container that
    has `video_streams`."""
    streams = video_streams(container)
    # An HLS master playlist's variants are renditions of one video, and FFmpeg's choice is its
    # first (a ladder listed from 320x180 up was captioned at 320x180): the most pixels up to
    # 1080p, past which the model's tiling reads no more detail and decoding costs more.
    variants = [s for s in streams if "variant_bitrate" in s.metadata]
    if len(variants) > 1:
        def area(s) -> int:
            return (s.codec_context.width or 0) * (s.codec_context.height or 0)

        fit = [s for s in variants if area(s) <= MAX_VARIANT_PIXELS]
        def rate(s) -> int:  # the playlist's BANDWIDTH, as FFmpeg read it
            text = s.metadata.get("variant_bitrate", "")
            return int(text) if text.isdigit() else 0

        return max(fit, key=lambda s: (area(s), rate(s))) if fit else min(variants, key=area)
    best = container.streams.best("video")
    return best if best in streams else streams[0]


def first_line(e: Exception) -> str:
    # FFmpeg's and the OS's own words ("Server returned 404 Not Found"), without the "[Errno N]"
    # and the file name that str() adds: every message here names the source already.
    text = (getattr(e, "strerror", None) or str(e)).strip()
    return text.splitlines()[0] if text else type(e).__name__
