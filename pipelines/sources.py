"""Frame sources: video files and network streams or a pipe (PyAV), cameras (OpenCV).

A source yields `Frame`s in decode order with presentation times from the container (variable
frame rates keep their real timestamps), as a player shows them: rotation metadata applied and
non-square pixels (anamorphic DVD, DV, broadcast) stretched to the display shape. Every failure to open
is a `SourceError` with a one-line message; a file that breaks off mid-way yields what decodes
and records the problem in `source.error` instead of raising, so batch jobs keep what they got.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from engine.errors import VlmstreamError

from .catch_up import CatchUp


class SourceError(VlmstreamError):
    """A source cannot be opened or read (missing, not a video, no video stream...)."""


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


def _rotate(rgb: np.ndarray, degrees: int) -> np.ndarray:
    """Apply a display rotation (counter-clockwise degrees, as FFmpeg's display matrix gives)."""
    turns = (int(round(degrees / 90)) % 4)
    return np.ascontiguousarray(np.rot90(rgb, k=turns)) if turns else rgb


def _shown(frame, sample_aspect) -> np.ndarray:
    """The frame's RGB pixels as a player shows them. Non-square pixels (a sample aspect ratio
    other than 1: DVD, DV, HDV, broadcast TV) are stretched to the display shape, in the same
    swscale pass as the colour conversion. Read as stored, a 16:9 PAL frame (720x576) squeezes every
    circle to an ellipse: of 60 scenes stored at half their width, the tiny model named all the
    objects of 65 % against 83 % unsqueezed. Stretching (never shrinking) keeps every stored
    pixel's detail. Then the display rotation."""
    width, height = frame.width, frame.height
    if sample_aspect and sample_aspect != 1:
        if sample_aspect > 1:
            width = max(2, round(width * sample_aspect / 2) * 2)
        else:
            height = max(2, round(height / sample_aspect / 2) * 2)
        rgb = frame.to_ndarray(format="rgb24", width=width, height=height)
    else:
        rgb = frame.to_ndarray(format="rgb24")
    return _rotate(rgb, getattr(frame, "rotation", 0) or 0)


def _decoded(container, stream, on_damage: Callable[[], None],
             before_packet: Callable[[], None] | None = None) -> Iterator:
    """The stream's frames, packet by packet, skipping the packets the decoder rejects (damaged
    data: a bad sector, a lost datagram, a stream joined between keyframes), as FFmpeg's own tools
    do. `container.decode` ended at the first: a file with 20 KB damaged in its middle gave 180 of
    its 329 decodable frames."""
    import av

    for packet in container.demux(stream):
        if before_packet is not None:
            before_packet()
        try:
            frames = packet.decode()
        except av.InvalidDataError:
            on_damage()
            continue
        yield from frames


def _main_video(container):
    """The video stream a player would show: FFmpeg's choice (the most frames, the default
    disposition), not the first. A Matroska file with a cover picture first gave one frame of
    the cover and no word about the film."""
    return container.streams.best("video") or container.streams.video[0]


class FileSource:
    """A video file read with PyAV: whatever FFmpeg decodes."""

    def __init__(self, path: str | Path, source_id: str | None = None, threads: bool = True):
        import av

        self.path = Path(path)
        self.source_id = source_id or str(path)
        self.error: str | None = None
        self.decoded = 0  # frames decoded by the last frames() so far
        self.damaged = 0  # packets the decoder rejected in the last frames(), skipped
        self.seconds = 0.0  # the video time they cover: first frame's start to last frame's end
        self._closed = False
        if not self.path.exists():
            if "://" in str(path):  # Path() would print it as "http:/host/..."
                raise SourceError(f"{redact(str(path))} is a stream, not a file: `vlmstream live` reads streams")
            raise SourceError(f"video not found: {self.path}")
        if self.path.is_dir():
            raise SourceError(f"{self.path} is a folder, not a video")
        if self.path.is_char_device() or self.path.is_block_device():
            raise SourceError(f"{self.path} is a device, not a video file (a camera is webcam:N or /dev/videoN, "
                              "read by `vlmstream live`)")
        if self.path.is_fifo():  # opening it would wait for a writer with no time limit
            raise SourceError(f"{self.path} is a named pipe: `vlmstream live -` reads a stream piped in "
                              f"(vlmstream live - < {self.path})")
        if self.path.stat().st_size == 0:
            raise SourceError(f"{self.path} is empty (0 bytes)")
        try:
            self._container = av.open(str(self.path))
        except (av.FFmpegError, OSError, ValueError) as e:
            raise SourceError(f"{self.path} is not a readable video: {_first_line(e)}") from None
        if not self._container.streams.video:
            self._container.close()
            raise SourceError(f"{self.path} has no video stream")
        self._stream = _main_video(self._container)
        if threads:
            self._stream.thread_type = "AUTO"  # frame + slice threads: batch work wants throughput

    @property
    def _open_stream(self):
        # PyAV 19 refuses to read a closed container's stream (AssertionError); 18 answered. Refusing
        # here on every version keeps a use after close() from passing the tests on one of them.
        if self._closed:
            raise RuntimeError(f"{self.path} was closed: read its fields before close()")
        return self._stream

    @property
    def fps(self) -> float | None:
        rate = self._open_stream.average_rate or self._stream.guessed_rate
        return float(rate) if rate else None

    @property
    def frame_count(self) -> int | None:
        """Frames the container announces (may be 0/None for streams that do not say)."""
        if self._open_stream.frames:
            return int(self._stream.frames)
        if self._container.duration and self.fps:
            return int(self._container.duration / 1_000_000 * self.fps)
        return None

    def frames(self, pick: Callable[[int, float], bool] | None = None,
               need_rgb: Callable[[int], bool] | None = None, lazy: bool = False) -> Iterator[Frame]:
        """Every decoded frame in order, or those `pick(index, pts)` accepts: the others are
        decoded (later frames may depend on them) but never converted to RGB, which costs more
        than decoding (1.6 of 2.7 ms a 1280x720 H.264 frame). A picked frame for which
        `need_rgb(index)` is False comes without its pixels (`rgb` None): a resumed run that
        only replays its answer. `decoded` counts them all. lazy: frames come with `convert`
        instead of their pixels (`Frame.load`), for a consumer that keeps only some."""
        import av

        index, first = 0, None
        self.decoded, self.seconds, self.damaged = 0, 0.0, 0
        fps, time_base = self.fps, float(self._stream.time_base or 0)

        def damage() -> None:
            self.damaged += 1

        try:
            for frame in _decoded(self._container, self._stream, damage):
                pts = float(frame.time) if frame.time is not None else (index / fps if fps else 0.0)
                self.decoded = index + 1
                # Up to the end of the last frame: its start alone made a one-frame video 0 s long
                # (and "0.0x real time"), and every video a frame short.
                first = pts if first is None else first
                ticks = getattr(frame, "duration", None)  # not on every PyAV the package accepts
                shown = ticks * time_base if ticks and time_base else None
                self.seconds = max(self.seconds, pts - first + (shown or (1.0 / fps if fps else 0.0)))
                if pick is None or pick(index, pts):
                    if need_rgb is not None and not need_rgb(index):
                        yield Frame(self.source_id, index, pts, None)
                    else:
                        # The decoder's value, not the header's: broadcasts switch between 4:3 and 16:9
                        aspect = self._stream.codec_context.sample_aspect_ratio
                        if lazy:
                            yield Frame(self.source_id, index, pts, None, convert=partial(_shown, frame, aspect))
                        else:
                            yield Frame(self.source_id, index, pts, _shown(frame, aspect))
                index += 1
        except (av.FFmpegError, OSError, ValueError) as e:
            self.error = f"{self.path}: decoding stopped after {index} frames: {_first_line(e)}"
        if index == 0 and self.error is None:
            self.error = f"{self.path}: no frame could be decoded"
        if self.damaged and self.error is None:
            self.error = (f"{self.path}: {self.damaged} damaged packets skipped (their frames are missing, or "
                          "show decoding damage until the next keyframe)")
        announced = self._announced_frames()
        if self.error is None and announced and index < announced * 0.9 and announced - index >= 3:
            # FFmpeg ends a cut-off file quietly: a copy still downloading, a recording killed
            self.error = (f"{self.path}: decoding ended after {index} of the {announced} frames its container "
                          "announces (a truncated or damaged file?)")

    def _announced_frames(self) -> int | None:
        """`frame_count`, where it is evidence enough of a cut-off file: the container's own count
        (MP4, MOV), or the duration's worth where the video is its only stream (MKV, WebM: an audio
        track may run longer than the video)."""
        if not self._stream.frames and len(self._container.streams) > 1:
            return None
        return self.frame_count

    def close(self) -> None:
        self._closed = True
        self._container.close()

    def __enter__(self) -> "FileSource":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# What `vlmstream video FOLDER` picks up (any case); anything else in a folder is left alone.
# Raw H.264 / H.265 too: what many IP cameras and recorders export.
VIDEO_EXTENSIONS = frozenset({".mp4", ".m4v", ".mov", ".mkv", ".webm", ".avi", ".ts", ".mts", ".m2ts", ".mpg",
                              ".mpeg", ".flv", ".wmv", ".3gp", ".ogv", ".h264", ".264", ".h265", ".265", ".hevc"})


def video_files(folder: str | Path) -> list[Path]:
    return files_under(folder, VIDEO_EXTENSIONS)


def files_under(folder: str | Path, extensions: frozenset[str]) -> list[Path]:
    """The files under a folder and its subfolders with one of these extensions (any case),
    folder by folder with names sorted, so a run and its `--resume` see the same list. Hidden files
    and folders are skipped; symbolic links to folders are not followed (a link loop would never end)."""
    import os

    found = []
    for root, dirs, files in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        found += [Path(root) / f for f in sorted(files)
                  if not f.startswith(".") and Path(f).suffix.lower() in extensions]
    return found


def _first_line(e: Exception) -> str:
    # FFmpeg's and the OS's own words ("Server returned 404 Not Found"), without the "[Errno N]"
    # and the file name that str() adds: every message here names the source already.
    text = (getattr(e, "strerror", None) or str(e)).strip()
    return text.splitlines()[0] if text else type(e).__name__


STREAM_SCHEMES = ("rtsp", "rtsps", "rtmp", "rtmps", "udp", "rtp", "tcp", "srt", "http", "https")
# Streams pushed as they are shot, with the sender's clock in their timestamps: the ones whose
# lateness says whether decoding keeps up (CatchUp). Not HTTP (HLS comes a segment of seconds at a
# time, each frame of it "late" by up to its length) nor a pipe (raw H.264 carries no clock, and
# a pipe that is not read holds its writer back).
CLOCKED_SCHEMES = ("rtsp", "rtsps", "rtmp", "rtmps", "udp", "rtp", "tcp", "srt")


def redact(url: str) -> str:
    """The URL with any user:password replaced, for messages and logs."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    if parts.username or parts.password:
        host = parts.hostname or ""
        if parts.port:
            host += f":{parts.port}"
        return urlunsplit((parts.scheme, "***@" + host, parts.path, parts.query, parts.fragment))
    return url


STREAM_MAX_WAIT_S = 30.0  # a stream that sends nothing (and cannot be reopened) this long is an error
STDIN = "-"  # the live source name of standard input: a stream piped in


class StreamSource:
    """A network stream through PyAV (RTSP, UDP/RTP, HTTP(S) and HLS, RTMP, SRT...).

    Opening and reading are bounded by timeouts. When the stream breaks (sender restarted,
    network gone), it is reopened with exponential backoff; if nothing can be read for
    `max_wait` seconds, `frames()` raises a SourceError. Presentation times are seconds since the
    source started (stream timestamps restart when a sender does). Credentials never appear in
    messages. A recording (a stream that says how long it lasts) is read once, at its own pace
    unless `pace` is False.
    """

    def __init__(self, url: str, source_id: str | None = None, open_timeout: float = 5.0,
                 read_timeout: float = 3.0, max_wait: float | None = None, reconnect: bool = True,
                 pace: bool = True, lazy: bool = False):
        scheme = url.split("://", 1)[0].lower() if "://" in url else ""
        self.url, self.display = url, redact(url)
        if url == STDIN:
            # A program's output piped in (rpicam-vid, ffmpeg, gst-launch): FFmpeg's pipe protocol.
            # It cannot be opened twice, and the program may take seconds to start its camera.
            self.url, self.display, scheme = "pipe:0", "standard input", "pipe"
            reconnect, open_timeout, read_timeout = False, STREAM_MAX_WAIT_S, STREAM_MAX_WAIT_S
        elif scheme not in STREAM_SCHEMES:
            raise SourceError(f"unsupported URL scheme {scheme!r} in {self.display} "
                              f"(use one of {', '.join(STREAM_SCHEMES)})")
        self.source_id = source_id or self.display
        self.open_timeout, self.read_timeout = open_timeout, read_timeout
        self.max_wait, self.reconnect, self.pace = STREAM_MAX_WAIT_S if max_wait is None else max_wait, reconnect, pace
        self.lazy = lazy  # frames come with `convert` instead of their pixels (see Frame.load)
        self._clocked = scheme in CLOCKED_SCHEMES
        self.error: str | None = None
        self.reconnects = self.damaged = self.catch_ups = 0
        self.max_late = 0.0  # seconds the decoding fell behind a live stream at most (see CatchUp)
        self._options = {"fifo_size": "1000000", "overrun_nonfatal": "1"} if scheme == "udp" else {}
        if scheme.startswith("rtsp"):
            self._options["rtsp_transport"] = "tcp"
        if scheme.startswith("rtmp"):
            # FLV may add streams at any time, so FFmpeg probes it for its whole analyzeduration (5 s)
            # before the first frame; the video's parameters come in its first tag
            self._options["analyzeduration"] = "500000"

    def _open(self):
        import av

        return av.open(self.url, timeout=(self.open_timeout, self.read_timeout), options=self._options)

    def frames(self) -> Iterator[Frame]:
        import av

        t0 = time.perf_counter()
        last_ok, delay, index = time.perf_counter(), 0.25, 0
        while True:
            try:
                container = self._open()
            except (av.FFmpegError, OSError) as e:
                # A client error (404, 401, 403...) from a stream that never sent a frame is a wrong
                # URL or password, not an outage: said at once, not after max_wait of retries (the
                # live CLI's --duration often ended first, and the reason was never shown).
                refused = (index == 0 and isinstance(e, av.HTTPClientError)  # 429 is "later", not "no"
                           and not isinstance(e, getattr(av, "HTTPTooManyRequestsError", ())))
                if isinstance(e, av.ProtocolNotFoundError):  # srt:// with PyAV's own FFmpeg (built without libsrt)
                    scheme = self.url.split(":", 1)[0]
                    raise SourceError(f"cannot read {self.display}: the FFmpeg inside PyAV reads no {scheme}:// "
                                      f"streams; pipe it in with an ffmpeg that does: ffmpeg -i '{self.display}' "
                                      "-c copy -f mpegts - | vlmstream live -") from None
                if refused or time.perf_counter() - last_ok > self.max_wait or not self.reconnect:
                    raise SourceError(f"cannot read {self.display}: {self._clean(e)}") from None
                time.sleep(delay)
                delay = min(delay * 2, 4.0)
                continue
            ended = False
            try:
                if not container.streams.video:
                    raise SourceError(f"{self.display} has no video stream")
                # A recording served over the network (a file over HTTP, a finished HLS playlist)
                # says how long it lasts; a live stream does not. A recording plays at its own pace,
                # as a file does in `live`, not as fast as it downloads (a 25 fps clip went by at
                # 60), and its end ends the source instead of being reopened from the start.
                recording = bool(container.duration)
                clock = None  # (wall time, frame time) that the pacing counts from
                stream = _main_video(container)
                # A live stream faster than this machine decodes: keyframes only until caught up
                guard = CatchUp(stream.codec_context) if self._clocked and not recording else None
                before = None if guard is None else (lambda: guard.packet(time.perf_counter()))
                catch_ups = self.catch_ups
                for frame in _decoded(container, stream, self._damage, before):
                    if guard is not None:
                        guard.frame(frame.time, time.perf_counter())
                        self.catch_ups, self.max_late = catch_ups + guard.catch_ups, max(self.max_late, guard.max_late)
                    if recording and self.pace and frame.time is not None:
                        now = time.perf_counter()
                        clock = clock or (now, frame.time)
                        ahead = (frame.time - clock[1]) - (now - clock[0])
                        if ahead > 2.0:  # a jump in the timestamps: count from here
                            clock = (now, frame.time)
                        elif ahead > 0:
                            time.sleep(ahead)
                    last_ok, delay = time.perf_counter(), 0.25
                    pixels = partial(_shown, frame, stream.codec_context.sample_aspect_ratio)
                    if self.lazy:
                        yield Frame(self.source_id, index, last_ok - t0, None, convert=pixels)
                    else:
                        yield Frame(self.source_id, index, last_ok - t0, pixels())
                    index += 1
                ended = recording
            except (av.FFmpegError, OSError) as e:
                self.error = f"{self.display}: {self._clean(e)}"
            finally:
                container.close()
            if not self.reconnect or ended:
                return
            self.reconnects += 1

    def _damage(self) -> None:
        self.damaged += 1  # a lost datagram, a stream joined between keyframes: the next keyframe heals it

    def _clean(self, e: Exception) -> str:
        return _first_line(e).replace(self.url, self.display)


class WebcamSource:
    """A local camera through OpenCV (`webcam:N`). Frames are timed by the wall clock."""

    def __init__(self, index: int, source_id: str | None = None, read_timeout: float = 3.0):
        import os

        os.environ.setdefault("OPENCV_LOG_LEVEL", "ERROR")  # no driver chatter for a missing camera
        import cv2

        self._cv2 = cv2
        self.index, self.source_id = index, source_id or f"webcam:{index}"
        self.read_timeout = read_timeout
        self.error: str | None = None
        self._cap = cv2.VideoCapture(index)
        if not self._cap.isOpened():
            self._cap.release()
            raise SourceError(f"no camera at webcam:{index} (is it connected, and not used by another program?)")

    def frames(self) -> Iterator[Frame]:
        t0 = last_ok = time.perf_counter()
        index = 0
        try:
            while True:
                ok, bgr = self._cap.read()
                now = time.perf_counter()
                if not ok or bgr is None:
                    if now - last_ok > self.read_timeout:
                        self.error = f"webcam:{self.index} stopped delivering frames"
                        return
                    time.sleep(0.01)
                    continue
                last_ok = now
                yield Frame(self.source_id, index, now - t0, self._cv2.cvtColor(bgr, self._cv2.COLOR_BGR2RGB))
                index += 1
        finally:
            self._cap.release()


def parse_webcam(source: str) -> int | None:
    """The camera index of 'webcam:N' or of a Linux camera device (/dev/videoN, or a link to one such
    as /dev/v4l/by-id/usb-...-video-index0), None for anything else; a bad N is a SourceError."""
    import os
    import re

    if not source.startswith("webcam:"):
        device = re.fullmatch(r"/dev/video(\d+)", os.path.realpath(source)) if "://" not in source else None
        return int(device.group(1)) if device else None
    try:
        index = int(source.removeprefix("webcam:"))
    except ValueError:
        raise SourceError(f"a webcam is written webcam:N with N a number, got {source!r}") from None
    if index < 0:
        raise SourceError(f"webcam index must be >= 0, got {index}")
    return index


@dataclass(frozen=True)
class LiveSource:
    """A source opened for watching live (`open_live`)."""

    frames: Callable[[], Iterator[Frame]]  # a fresh iterator of its frames at each call
    paced: bool  # its frames come as fast as they decode: the grabber paces them by their times (a file)
    loops: bool  # it can be played again from its start when it ends (a file, or a recording over the network)
    stream: StreamSource | None = None  # a network stream or a pipe: its reconnections and damaged packets


def open_live(source: str) -> LiveSource:
    """A source to watch live, by name: webcam:N, a stream URL, or a video file.

    The source is checked now (camera present, URL scheme, file readable), so a mistake fails
    here. A recording served over the network paces itself (StreamSource) and ends; called
    again, its frames start over, as a file's do. A live stream never ends that way (it
    reconnects), so looping it changes nothing; a camera is not looped (an unplugged one
    would be asked again and again).
    """
    camera = parse_webcam(source)
    if camera is not None:
        return LiveSource(WebcamSource(camera).frames, paced=False, loops=False)
    # Frames come unconverted: the grabber keeps the newest, and the feed converts the ones it takes.
    if "://" in source:
        stream = StreamSource(source, lazy=True)  # checks the scheme; redacts credentials
        return LiveSource(stream.frames, paced=False, loops=True, stream=stream)
    if source == STDIN:
        import sys

        if sys.stdin is None or sys.stdin.isatty():
            raise SourceError("nothing is piped into standard input (-): e.g. rpicam-vid -t 0 -o - | vlmstream live -")
        stream = StreamSource(source, lazy=True)
        return LiveSource(stream.frames, paced=False, loops=False, stream=stream)
    FileSource(source).close()

    def frames() -> Iterator[Frame]:
        src = FileSource(source, threads=False)
        try:
            yield from src.frames(lazy=True)
        finally:
            src.close()

    return LiveSource(frames, paced=True, loops=True)
