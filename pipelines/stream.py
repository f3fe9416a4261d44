"""Network streams and pipes, read with PyAV: RTSP, UDP/RTP, HTTP(S) and HLS, RTMP, standard input.

Opening and reading are bounded by timeouts; a broken stream is reopened with backoff; a live
stream decoded slower than it comes catches up to its edge (`catch_up.py`); credentials never
appear in messages. What a URL's scheme says (the schemes read, the FFmpeg options, whether it is
a recording) is in schemes.py, why a failed open is given up at once in refusal.py.
"""

from __future__ import annotations

import time
from typing import Iterator

from .catch_up import CatchUp
from .connection import TIMED_OUT, Connection, span
from .frame import AS_SHOWN, Frame, Reading, SourceError, decoded, first_line, main_video, no_video, pixels, refuse_text
from .pipe import PIPE_PROBE, STDIN, PipeReader, is_named_pipe, open_pipe, wait_for_input
from .refusal import refusal
from .replayed import Replayed
from .schemes import CLOCKED_SCHEMES, WEB, check_url, is_recording, stream_options
from .url import shown_as, without_host

STALE_AFTER, BURST_S = 0.9, 0.05  # a silence this share of the read timeout; the burst it ends (see _frames)
STREAM_MAX_WAIT_S = 30.0  # a stream that never sent a frame and sends nothing this long is an error
BEHIND_EVERY_S = 60.0  # falling behind is said at most this often
UNDECODABLE_S = 10.0  # a stream that gave frames and then only packets the decoder rejects, this long: reopened


class _Undecodable(Exception):
    """No frame for UNDECODABLE_S, most packets rejected meanwhile: the stream changed codec."""


class _NoAnswer(OSError):
    """An RTSP server that took the connection and never answered, until the open timeout."""


class _TimedOut(OSError):
    """A read that timed out, and got what the demuxer held instead of an error (see `before`)."""


class StreamSource:
    """A network stream through PyAV (RTSP, UDP/RTP, HTTP(S) and HLS, RTMP...), or standard input
    (`STDIN`: a program's stream piped in, read once) or a named pipe (`is_named_pipe`), alike.

    Opening and reading are bounded by timeouts. When the stream breaks (sender restarted,
    network gone), it is reopened as `connection` (a `Connection`) says: for ever once it has
    sent frames, unless `max_outage` is given; `frames()` raises a SourceError when it gives up,
    and after `max_wait` seconds for a stream that never sent a frame. Presentation times are
    seconds since the source started (stream timestamps restart when a sender does).
    Credentials never appear in messages. A recording (a stream that says how long it lasts) is
    read once, at its own pace unless `pace` is False.
    """

    def __init__(self, url: str, source_id: str | None = None, open_timeout: float = 5.0,
                 read_timeout: float = 3.0, max_wait: float | None = None, reconnect: bool = True,
                 pace: bool = True, lazy: bool = False, max_outage: float | None = None,
                 reading: Reading = AS_SHOWN):
        scheme = url.split("://", 1)[0].lower() if "://" in url else ""
        # The path of a pipe to read (STDIN for standard input), or None for a network stream
        self._pipe: str | None = url if url == STDIN or is_named_pipe(url) else None
        self._pipe_fd: int | None = None  # a named pipe's, opened by the first _open
        if self._pipe is not None:
            # A program's output piped in (rpicam-vid, ffmpeg, gst-launch): read through PipeReader.
            # It cannot be opened twice, and the program may take seconds to start its camera.
            # FFmpeg's name for standard input, in the messages that _clean rewrites
            self.url, self.display = ("pipe:0", "standard input") if url == STDIN else (url, url)
            scheme, reconnect, open_timeout, read_timeout = "pipe", False, STREAM_MAX_WAIT_S, STREAM_MAX_WAIT_S
        else:
            # A listed source (`--sources`): its messages name it as its frames do, not by its URL
            # (a page was to see the name alone), from the first: a mistyped scheme or port had
            # been said with the URL's host, and a URL that does not parse with its password.
            shown = shown_as(url, source_id)
            self.url, self.display = url, source_id or shown
            check_url(url, scheme, self.display)
        self._named = bool(source_id) and self._pipe is None  # its host is not said (`_unnamed`)
        self.source_id = source_id or self.display
        self.open_timeout, self.read_timeout = open_timeout, read_timeout
        self.reconnect, self.pace = reconnect, pace
        self.connection = Connection(self.display, STREAM_MAX_WAIT_S if max_wait is None else max_wait, max_outage)
        self.connection.counters = self._counters
        self.lazy = lazy  # frames come with `convert` instead of their pixels (see Frame.load)
        self.reading = reading
        self._clocked = scheme in CLOCKED_SCHEMES
        self.error: str | None = None
        # A live stream was opened (not a recording); and it has ended for good (see _frames)
        self._was_live = self._over = False
        self._replayed = Replayed()  # a live HLS playlist's frames, which a reopen may give again
        self.reconnects = self.damaged = self.catch_ups = 0
        self.max_late = self.late = 0.0  # seconds the decoding fell behind a live stream, at most and now (CatchUp)
        self._behind_said = -float("inf")  # when falling behind was last said (through `connection`)
        self._options = stream_options(scheme)

    def _open(self, started: float | None = None):
        import av

        if self._pipe is not None:  # read through PipeReader: FFmpeg's timeouts do not reach a pipe's read
            fd = self._open_pipe()
            wait_for_input(fd, self.open_timeout, lambda: self.connection.stopped, self.display)
            if self.connection.stopped:  # the run ended while the program piped in had not begun
                return None
            reader = PipeReader(fd, self.read_timeout, lambda: self.connection.stopped)
            # FFmpeg probes 5 MB or 5 s of a stream before its first frame: a camera's MJPEG came
            # after 11 s, one that sent 2 s and paused never, and the backlog then came at once.
            return refuse_text(av.open(reader, mode="r", timeout=None, options=PIPE_PROBE), self.display)
        timeout, read = self.connection.try_timeouts(self.open_timeout, self.read_timeout, started)
        began = time.perf_counter()
        try:
            return refuse_text(av.open(self.url, timeout=(timeout, read), options=self._options), self.display)
        except av.InvalidDataError:
            # FFmpeg's RTSP client says our timeout as "Invalid data found...": a camera still booting
            # (its port open, its server not up), or hung, was given up in those words, having sent nothing
            if self.url.lower().startswith("rtsp") and time.perf_counter() - began >= timeout:
                raise _NoAnswer() from None
            raise

    def _open_pipe(self) -> int:
        """Standard input's descriptor, or the named pipe's (`open_pipe`), opened once."""
        if self._pipe == STDIN:
            return 0
        if self._pipe_fd is None:
            self._pipe_fd = open_pipe(self._pipe, self.display)
        return self._pipe_fd

    def frames(self) -> Iterator[Frame]:
        try:
            yield from self._frames()
        except SourceError:
            self.connection.set("failed")
            raise
        finally:
            if self._pipe_fd is not None:
                import os

                os.close(self._pipe_fd)
                self._pipe_fd = None
        self.connection.set("ended")

    def _frames(self) -> Iterator[Frame]:
        import av

        if self._over:  # played again (a live source loops): a live stream that ended has nothing more
            return
        t0 = time.perf_counter()
        connection, index, tries = self.connection, 0, 0
        while not connection.stopped:
            # every try to open it after the first, refused ones too (a reboot's), as README says;
            # counted by the breaks instead, a camera given up had one reopen that never happened
            self.reconnects, tries = tries, tries + 1
            try:
                container = self._open(t0)
                if container is None:
                    return
            except (av.FFmpegError, OSError) as e:
                # A pipe's reader says end-of-input once the run ends (Ctrl-C, --duration): no error of
                # the pipe's (a network source's try says why it had not opened yet: retry, below).
                if connection.stopped and self._pipe is not None:
                    return
                given_up = self._unnamed(refusal(e, self.url, self.display, index == 0, self.open_timeout,
                                                 self._clean))
                if given_up or not self.reconnect:
                    raise SourceError(f"cannot read {self.display}: {given_up or self._clean(e, self.open_timeout)}"
                                      ) from None
                if not connection.retry(self._clean(e, time.perf_counter() - (connection.last_frame or t0)), t0):
                    return
                continue
            ended, broke, came = False, "the stream ended", index
            read_timeout = getattr(container, "read_timeout", None) or self.read_timeout  # as _open cut it
            try:
                missing = no_video(container, self.display)
                if missing:
                    raise missing
                # A recording plays at its own pace, as a file does in `live`, not as fast as it
                # downloads (a 25 fps clip went by at 60), and its end ends the source instead of
                # being reopened from the start.
                recording = is_recording(container, self.url)
                # So does a live HLS playlist: it comes a segment (seconds of frames) at a time,
                # decoded in a blink, and the latest-frame grabber kept only the last few of each
                # (a 30 fps stream in 1 s segments was captioned at 3 fps, 93 % of its frames
                # overwritten, the model idle between segments). Paced, it is at most a segment
                # later than it came, as any HLS player shows it.
                web = self.url.split(":", 1)[0].lower() in WEB
                paced = self.pace and (recording or web and "hls" in container.format.name)
                if recording and self._was_live:
                    # A live HLS playlist that got its end (#EXT-X-ENDLIST) is over. Reopened after
                    # its last segment it is a finished playlist, a recording: its last minute or
                    # so had been played again, and again (looped as a file is), for ever.
                    self._over = True
                    connection.say("the stream has ended (its playlist is finished)")
                    return
                self._was_live = self._was_live or not recording
                live_hls = web and not recording and "hls" in container.format.name
                if live_hls:
                    self._replayed.reopened()
                clock = None  # (wall time, frame time) that the pacing counts from
                stream = main_video(container)
                # A master playlist's other variants (and any stream not shown) are left unread: each
                # variant's segments had been downloaded all along, all but one for nothing (a CDN's
                # ladder of four renditions cost the bandwidth of all four)
                for other in container.streams if web else ():
                    if other is not stream:
                        other.discard = av.stream.Discard.all
                # A live stream faster than this machine decodes: keyframes only until caught up
                guard = CatchUp(stream.codec_context) if self._clocked and not recording else None
                # When a live stream's read times out, the MPEG-TS demuxer lets go of the packets it
                # held, at once: frames from before the break, handed over as new ones a read
                # timeout late. They reset the outage's clock ("back after 2.7 s" from an outage of
                # 5.7; --max-outage measured from them). Packets that come after such a silence,
                # in one burst, are left out; the stream's next packets are read as ever.
                arrived = [time.perf_counter(), None]  # the last packet's arrival; when a burst after a silence began
                # A sender that changed codec on the same port (H.264 to HEVC): the demuxer keeps the
                # stream it probed, and its decoder rejected every packet from then on, silently, for
                # as long as the stream ran. Once it has given frames and then none for UNDECODABLE_S,
                # the decoder rejecting most packets meanwhile, it is reopened (probed again). Not
                # before its first frame: a stream joined far from a keyframe is rejected until one comes.
                since: list = [None, 0, self.damaged]  # the last frame's time; packets since; self.damaged then

                def before(waited: float) -> None:
                    # A read that timed out (the sender silent) and got a packet the demuxer held
                    # (RTP's last, MPEG-TS's): the silence is an outage. Taken for a packet, it
                    # began the read timeout anew, and a hung camera was found lost after two.
                    if not recording and self._pipe is None and waited >= read_timeout:
                        raise _TimedOut()
                    now = time.perf_counter()
                    since[1] += 1
                    if (since[0] is not None and now - since[0] > UNDECODABLE_S
                            and 2 * (self.damaged - since[2]) >= since[1]):
                        raise _Undecodable(f"no frame for {span(now - since[0])}, the {stream.codec_context.name} decoder "
                                           "rejecting its packets: has the stream changed format?")
                    if not recording and now - arrived[0] > STALE_AFTER * read_timeout:
                        arrived[1] = now
                    arrived[0] = now
                    if guard is not None:
                        guard.packet(now, waited)

                catch_ups = self.catch_ups
                # Packets the demuxer marks corrupt are decoded, not counted: `damaged_packets` are those
                # skipped, and every live HLS segment restarts MPEG-TS's continuity counters.
                for frame in decoded(container, stream, self._damage, before, self.reading):
                    if arrived[1] is not None and arrived[0] - arrived[1] < BURST_S:
                        continue
                    if live_hls and self._replayed.again(frame.time):
                        continue
                    if guard is not None:
                        guard.frame(frame.time, time.perf_counter())
                        if catch_ups + guard.catch_ups > self.catch_ups:
                            self._behind(guard.late, catch_ups + guard.catch_ups)
                        self.catch_ups, self.late = catch_ups + guard.catch_ups, guard.late
                        self.max_late = max(self.max_late, guard.max_late)
                    if paced and frame.time is not None:
                        now = time.perf_counter()
                        clock = clock or (now, frame.time)
                        ahead = (frame.time - clock[1]) - (now - clock[0])
                        # A jump in the timestamps, either way: count from here. Back (recordings
                        # joined end to end, each from its own start), it had left the rest unpaced:
                        # three 8 s MPEG-TS recordings went by in 8.5 s.
                        if abs(ahead) > 2.0:
                            clock = (now, frame.time)
                        elif ahead > 0:
                            time.sleep(ahead)
                    connection.frame()
                    since[:] = [connection.last_frame, 0, self.damaged]
                    yield Frame(self.source_id, index, connection.last_frame - t0,
                                **pixels(frame, stream.codec_context.sample_aspect_ratio, self.lazy, self.reading))
                    index += 1
                ended = recording
            except (av.FFmpegError, OSError, _Undecodable) as e:
                if connection.stopped and self._pipe is not None:  # a read the run's end broke off
                    return
                broke = str(e) if isinstance(e, _Undecodable) else self._clean(e, read_timeout)
                self.error = f"{self.display}: {broke}"
                if not self.reconnect:  # standard input broken off: said, not taken for its end
                    raise SourceError(f"cannot read {self.error}") from None
            finally:
                container.close()
            if not self.reconnect or ended:
                return
            connection.lost(broke)
            if index != came:
                # Reopened at once, if there is time left where the read's timeout was cut to
                # --max-outage (a stream that stopped otherwise, a codec change, has its try)
                if broke.startswith(TIMED_OUT):
                    connection.check(broke, t0)
            else:  # opened, nothing came: not hammered
                if broke.startswith(TIMED_OUT):
                    # The whole silence, as a try that could not open says it: a camera that
                    # answered its tries and sent nothing was given up as "nothing came for 3.0 s"
                    # (this try's read timeout) after 30 s, or after --max-outage.
                    broke = f"{TIMED_OUT} {time.perf_counter() - (connection.last_frame or t0):.1f} s"
                if not connection.retry(broke, t0):
                    return

    def health(self) -> dict:
        """How the stream is doing now (`Connection.health`, with `_counters`)."""
        return self.connection.health()

    def _counters(self) -> dict:
        """How often it was reopened, damaged packets, times decoding skipped ahead, how late it is."""
        return {"reconnects": self.reconnects, "damaged_packets": self.damaged, "catch_ups": self.catch_ups,
                "late_s": round(self.late, 3), "max_late_s": round(self.max_late, 3)}

    def _behind(self, late: float, times: int) -> None:
        now = time.perf_counter()
        if now - self._behind_said >= BEHIND_EVERY_S:  # a stream too heavy for this machine skips every few seconds
            self._behind_said = now
            self.connection.say(f"decoding is {late:.1f} s behind the stream: skipping to its newest keyframe "
                                f"({times} {'time' if times == 1 else 'times'} so far; a lighter stream would "
                                "keep up)")

    def _damage(self) -> None:
        self.damaged += 1  # a lost datagram, a stream joined between keyframes: the next keyframe heals it

    def _clean(self, e: Exception, waited: float) -> str:
        import av

        if isinstance(e, (av.ExitError, _NoAnswer, _TimedOut)):  # "Immediate exit requested": our timeout, in FFmpeg's words
            return f"{TIMED_OUT} {waited:.1f} s"
        return self._unnamed(first_line(e).replace(self.url, self.display))

    def _unnamed(self, said: str | None) -> str | None:
        """A listed source's message without its host (`without_host`)."""
        return without_host(said, self.url) if self._named else said
