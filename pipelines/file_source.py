"""A video file (or one on a web server) read with PyAV: `FileSource`.

It yields `Frame`s in decode order with presentation times from the container (variable frame
rates keep their real timestamps), as a player shows them (frame.py). Every failure to open is a
`SourceError` with a one-line message; a file that breaks off mid-way yields what decodes and
records the problem in `source.error` instead of raising, so batch jobs keep what they got. A
resumed read (`frames(resume=)`) seeks near where it starts and finds its frame by its time.
What a file says of its length is in file_length.py, why one cannot be read in file_check.py, and
what marks a file on a web server in remote_file.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterator

from .frame import AS_SHOWN, Frame, Reading, SourceError, decoded, first_line, main_video, no_video, pixels, refuse_text
from .file_check import check_file, no_index
from .file_length import AVFMT_NOTIMESTAMPS, announced_frames, cut_short, stated_rate
from .remote_file import REMOTE_OPTIONS, REMOTE_TIMEOUTS_S, is_remote, takes_ranges
from .timestamps import BestEffort, Continuous
from .schemes import is_recording
from .url import PLAYLIST_UNREAD, is_playlist, redact, unknown_host

AVFMT_TS_DISCONT = 0x200  # FFmpeg's flag of a format whose timestamps may jump
DISCONTINUITY_S = 10.0  # a packet this far from where the one before ended: a jump (as ffmpeg)
EPSILON_S = 1e-3
SEEK_MARGIN_S = 1.0  # `frames(resume=)` seeks this long before the frame it starts at
MATCH_S = 1e-5  # ... and finds it by its time, as recorded (to the microsecond)


class _NotThere(Exception):
    """The frame a resumed read starts at is not where the seek led."""


class FileSource:
    """A video file read with PyAV: whatever FFmpeg decodes. A file on a web server (an http or
    https URL) is read as a file is."""

    def __init__(self, path: str | Path, source_id: str | None = None, threads: bool = True,
                 reading: Reading = AS_SHOWN):
        import av

        text = str(path)
        # A file on a web server (http, https: S3, a NAS, a CDN) is read as a file is, its bytes
        # fetched as decoding needs them; its name in messages and outputs has no password.
        self.url = text if is_remote(text) else None
        self.path = None if self.url else Path(path)
        self.name = redact(text) if self.url else str(self.path)
        self.source_id = source_id or (self.name if self.url else text)
        self.error: str | None = None
        self.end: float | None = None  # where the last frame of the last frames() stops showing
        self.incomplete = False  # the last frames() ended before the file's end (the error says why)
        self.decoded = 0  # frames decoded by the last frames() so far
        self.damaged = 0  # packets the decoder rejected in the last frames(), skipped
        self.corrupt = 0  # packets after data the demuxer saw lost (decoded all the same)
        self.concealed = 0  # frames the decoder patched over damaged data (flagged corrupt), given all the same
        self.seconds = 0.0  # the video time they cover: first frame's start to last frame's end
        self._closed = False
        self.reading = reading  # as a player shows the frames, or as stored
        if self.url is None:
            if "://" in text and not self.path.exists():  # Path() would print it as "rtsp:/host/..."
                raise SourceError(f"{redact(text)} is a stream, not a file: `vlmstream live` reads streams")
            check_file(self.path)
        try:
            if self.url:
                self._container = av.open(self.url, timeout=REMOTE_TIMEOUTS_S, options=REMOTE_OPTIONS)
            else:
                self._container = av.open(text)
        except (av.FFmpegError, OSError, ValueError) as e:
            if self.url and not isinstance(e, av.InvalidDataError):  # refused, not found, no answer
                reason = (f"nothing came for {REMOTE_TIMEOUTS_S[0]:g} s" if isinstance(e, av.ExitError)
                          else unknown_host(self.url) or first_line(e).replace(text, self.name))
                raise SourceError(f"cannot read {self.name}: {reason}") from None
            if self.url and isinstance(e, av.InvalidDataError) and is_playlist(self.url):
                raise SourceError(f"cannot read {self.name}: {PLAYLIST_UNREAD.format(first_line(e))}") from None
            raise SourceError(f"{self.name} is not a readable video: {first_line(e)}{no_index(self.url, text, e)}") from None
        refuse_text(self._container, self.name)
        missing = no_video(self._container, self.name)
        if missing:
            self._container.close()
            raise missing
        if self.url and not is_recording(self._container, self.url):
            self._container.close()
            raise SourceError(f"{self.name} is a live stream (it has no end): `vlmstream live` reads it")
        self._stream = main_video(self._container)
        # Non-square pixels as players show them (FFmpeg's av_guess_sample_aspect_ratio): those
        # the container states (Matroska's display size, MP4's pasp box) over the decoder's. VP8,
        # VP9 and AV1 carry none of their own, nor does a file fixed with `ffmpeg -aspect 4:3 -c
        # copy`: their frames came unstretched. A container that says no more than the decoder
        # leaves it to the decoder, frame by frame (broadcasts switch between 4:3 and 16:9).
        stated = self._stream.sample_aspect_ratio  # the container's, else the header's
        self._aspect = stated if stated != self._stream.codec_context.sample_aspect_ratio else None
        if threads:
            self._stream.thread_type = "AUTO"  # frame + slice threads: batch work wants throughput

    @property
    def annotated(self) -> bool:
        """Whether this is an annotated copy that vlmstream wrote (`annotated.ANNOTATED_COMMENT`)."""
        from .annotated import ANNOTATED_COMMENT

        return self._container.metadata.get("comment") == ANNOTATED_COMMENT

    @property
    def _open_stream(self):
        # PyAV 19 refuses to read a closed container's stream (AssertionError); 18 answered. Refusing
        # here on every version keeps a use after close() from passing the tests on one of them.
        if self._closed:
            raise RuntimeError(f"{self.name} was closed: read its fields before close()")
        return self._stream

    @property
    def fps(self) -> float | None:
        return stated_rate(self._container, self._open_stream)

    @property
    def frame_count(self) -> int | None:
        """Frames the container announces (may be 0/None for streams that do not say)."""
        return announced_frames(self._container, self._open_stream, self.fps)


    def frames(self, pick: Callable[[int, float], bool] | None = None,
               need_rgb: Callable[[int], bool] | None = None, lazy: bool = False,
               resume: tuple[int, float, float] | None = None, seek: bool = True) -> Iterator[Frame]:
        """Every decoded frame in order, or those `pick(index, pts)` accepts: the others are
        decoded (later frames may depend on them) but never converted to RGB, which costs more
        than decoding (1.6 of 2.7 ms a 1280x720 H.264 frame). A picked frame for which
        `need_rgb(index)` is False comes without its pixels (`rgb` None): a resumed run that
        only replays its answer. `decoded` counts them all. lazy: frames come with `convert`
        instead of their pixels (`Frame.load`), for a consumer that keeps only some.

        resume (index, pts, first): the frames start at the one of that index and time (`first`:
        the time of the file's first frame), for a `video --resume` that has the answers before
        it. Where the container can seek, decoding starts at the keyframe before it, and that
        frame, found by its time, tells the index; elsewhere (or when it is not there) the frames
        before it are decoded and passed over (`seek` False: always). `pick` is not asked about them."""
        import av

        index, first = 0, None
        # end: where the last frame decoded stops showing, in its own times (subtitles end there)
        self.decoded, self.seconds, self.damaged, self.corrupt, self.end = 0, 0.0, 0, 0, None
        self.concealed = 0
        fps, time_base = self.fps, float(self._stream.time_base or 0)
        # Times as a player shows them: from the file's start. An MPEG-TS recording's clock starts
        # where the camera's or the broadcast's was (1.4 s after a plain remux, hours into a
        # broadcast day): its subtitles came that late, and `live` waited that long to show a frame.
        start = (self._container.start_time or 0) / 1_000_000  # AV_TIME_BASE
        # MPEG-TS, HLS, MPEG-PS, live FLV: formats whose timestamps may jump (recordings joined end to end, a
        # camera's clock reset). A jump is a discontinuity, not time that passed: the frame after it
        # follows the one before, as players play them. An hour's jump left `live` waiting an hour.
        # Taken out of the packets' times before decoding (`timestamps.Continuous`).
        jumps = bool(self._container.format.flags & AVFMT_TS_DISCONT)
        clock = Continuous(self._stream.time_base, 1.0 / (fps or 30.0), DISCONTINUITY_S) if jumps else None
        best = BestEffort()  # AVI's and ASF's frames with B-frames: their packets' times, in decode order
        last_shown, end = 1.0 / (fps or 30.0), None

        def damage() -> None:
            self.damaged += 1

        # An HLS recording's segments each restart MPEG-TS's continuity counters, as files joined
        # with a jump of their clocks do: the demuxer's "corrupt" there is no data lost.
        segmented = "hls" in self._container.format.name

        def concealed() -> None:
            self.concealed += 1

        def corrupt() -> None:
            if clock is not None:
                clock.mark_corrupt()
            else:
                self.corrupt += not segmented

        skip, at = 0, None  # frames before index `skip` are passed over; `at`: (index, pts) a seek went to
        ahead: list = []  # the frame after the one resumed at, read to check it (then given as the next)

        def in_order(frames: Iterator) -> Iterator:
            for f in frames:
                yield f
                while ahead:
                    yield ahead.pop()

        try:
            if resume is not None:
                skip, first = resume[0], resume[2]
                at = resume[:2] if seek and skip and not jumps and self._seek(resume[1] + start) else None
            under = decoded(self._container, self._stream, damage, reading=self.reading, on_corrupt=corrupt,
                            retime=clock, on_concealed=concealed)
            for frame in in_order(under):
                tb = frame.time_base or self._stream.time_base  # a deinterlaced frame's is the filter's
                seconds = best(None if frame.pts is None or not tb else float(frame.pts * tb),
                               None if frame.dts is None or not time_base else frame.dts * time_base)
                pts = seconds - start if seconds is not None else (index / fps if fps else 0.0)
                if -EPSILON_S < pts < 0:  # the start's rounding (-3e-7 s in a TS): not a time before it
                    pts = 0.0
                if at is not None:  # from the keyframe before the frame resumed at, to it
                    if pts < at[1] - MATCH_S:
                        continue
                    if pts > at[1] + MATCH_S:  # not there (a file changed since its answers?)
                        raise _NotThere
                    following = next(under, None)
                    if following is not None and following.pts is not None and following.pts == frame.pts:
                        raise _NotThere  # two frames at its time (a screen recorder's): which one it was is a guess
                    ahead += [following] if following is not None else []
                    index, at = at[0], None
                self.decoded = index + 1
                # Up to the end of the last frame: its start alone made a one-frame video 0 s long
                # (and "0.0x real time"), and every video a frame short.
                first = pts if first is None else first
                ticks = getattr(frame, "duration", None)  # not on every PyAV the package accepts
                tb = float(frame.time_base or 0) or time_base  # a deinterlaced frame's is the filter's
                shown = ticks * tb if ticks and tb else None
                last_shown = shown or last_shown
                self.end = pts + last_shown
                if seconds is not None:
                    end = seconds + last_shown
                self.seconds = max(self.seconds, pts - first + (shown or (1.0 / fps if fps else 0.0)))
                if index >= skip and (pick is None or pick(index, pts)):
                    if need_rgb is not None and not need_rgb(index):
                        yield Frame(self.source_id, index, pts, None)
                    else:
                        # The decoder's value, not the header's: broadcasts switch between 4:3 and 16:9
                        aspect = self._aspect or self._stream.codec_context.sample_aspect_ratio
                        yield Frame(self.source_id, index, pts, **pixels(frame, aspect, lazy, self.reading))
                index += 1
            if at is not None:  # the file ends before it
                raise _NotThere
        except _NotThere:  # read from the start instead, the frames before the one resumed at passed over
            try:
                self._container.seek(self._container.start_time or 0)
            except (av.FFmpegError, OSError, ValueError) as e:
                self.error, self.incomplete = f"{self.name}: cannot read it from its start again: {first_line(e)}", True
                return
            yield from self.frames(pick, need_rgb, lazy, resume, seek=False)
            return
        except (av.FFmpegError, OSError, ValueError) as e:
            self.error = f"{self.name}: decoding stopped after {index} frames: {first_line(e)}"
            if self.url and index == 0 and "mp4" in self._container.format.name and takes_ranges(self.url) is False:
                self.error += (" (its web server sends no byte ranges, which FFmpeg needs to read an MP4 whose index "
                               "is at its end: download the file first, or serve it from a server that sends ranges)")
        if index == 0 and self.error is None:
            self.error = f"{self.name}: no frame could be decoded"
        self.incomplete = self.error is not None  # damaged packets skipped on the way are not that
        # A jump leaves the container's duration meaningless. A packet after lost data is decoded,
        # and one that is rejected counted as damaged (a truncated file's last one is either, as
        # decoded in one thread: `live`'s): the file may still be cut short.
        short = (cut_short(self._container, self._stream, self.frame_count, self.fps,
                           index, end, self.end, damaged=bool(self.damaged))
                 if self.error is None and not (clock and clock.jumps) else None)
        if short:  # FFmpeg ends a cut-off file quietly: a copy still downloading, a recording killed
            self.error = f"{self.name}: decoding ended {short} its container announces (a truncated or damaged file?)"
            if self.damaged:
                self.error += f"; {self.damaged} damaged packet{'s' if self.damaged > 1 else ''} skipped"
            self.incomplete = True
        if self.damaged and self.error is None:
            self.error = (f"{self.name}: {self.damaged} damaged packets skipped (their frames are missing, or "
                          "show decoding damage until the next keyframe)")
        if clock is not None and not segmented:
            self.corrupt = clock.lost()
        if self.corrupt and self.error is None:
            self.error = (f"{self.name}: data lost at {self.corrupt} point{'s' if self.corrupt > 1 else ''} (or files "
                          "joined there): frames may be missing, or show decoding damage until the next keyframe")
        if self.concealed and self.error is None:  # damage the decoder patched over rather than rejected
            self.error = (f"{self.name}: {self.concealed} frame{'s' if self.concealed > 1 else ''} decoded with damage "
                          "(the decoder patched over damaged data: they, and those after them until the next "
                          "keyframe, may show it)")

    def _seek(self, seconds: float) -> bool:
        """Whether decoding now starts at the keyframe before `seconds` (the file's own time, a
        little earlier: a frame's time and the index's may differ by its reordering). Not in a
        stream that stores no times (raw H.264), nor in a file on a web server: one that takes no
        byte ranges (Python's http.server) broke the reading off at the seek."""
        import av

        time_base = self._stream.time_base
        if self.url or self._container.format.flags & AVFMT_NOTIMESTAMPS or not time_base:
            return False
        target = int((seconds - SEEK_MARGIN_S) / time_base)
        if target <= (self._stream.start_time or 0):  # near the start: read from it
            return False
        try:
            self._container.seek(target, stream=self._stream)
        except (av.FFmpegError, OSError, ValueError):  # no index to seek by: read from the start
            # A failed seek may have moved the demuxer (AVI's did, its frames then decoded damaged)
            self._container.seek(self._container.start_time or 0)
            return False
        return True

    def close(self) -> None:
        self._closed = True
        self._container.close()

    def __enter__(self) -> "FileSource":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
