"""What a stream's URL says of it, before and after it is opened.

STREAM_SCHEMES: those `live` reads as streams (`check_url` refuses any other, and a bad port);
CLOCKED_SCHEMES: those whose timestamps carry the sender's clock (CatchUp watches them); `stream_options`: the FFmpeg options a stream of a scheme
is opened with; `is_recording`: whether an opened network source says how long it lasts.
"""

from __future__ import annotations

from .frame import SourceError

STREAM_SCHEMES = ("rtsp", "rtsps", "rtmp", "rtmps", "udp", "rtp", "tcp", "srt", "http", "https")
# Streams pushed as they are shot, with the sender's clock in their timestamps: the ones whose
# lateness says whether decoding keeps up (CatchUp). Not HTTP (HLS comes a segment of seconds at a
# time, each frame of it "late" by up to its length) nor a pipe (raw H.264 carries no clock, and
# a pipe that is not read holds its writer back).
CLOCKED_SCHEMES = tuple(s for s in STREAM_SCHEMES if not s.startswith("http"))
WEB = ("http", "https")


def is_recording(container, url: str) -> bool:
    """Whether an opened network source is a recording: one that says how long it lasts (a file
    over HTTP, a finished HLS playlist), or a file whose web server gave its size though not a
    way to seek to its end, where its length is (an MPEG-TS file from a server without ranges,
    Python's http.server among them, was taken for a live stream: reopened ~20 times a second,
    its frames read as fast as they came). A live stream does neither."""
    if container.duration:
        return True
    web = url.split(":", 1)[0].lower() in WEB
    return web and (container.size or 0) > 0 and "hls" not in container.format.name  # a live playlist's size is its text's


def check_url(url: str, scheme: str, display: str) -> None:
    """A SourceError for a URL that is no stream `live` reads: its scheme, or its port."""
    if scheme not in STREAM_SCHEMES:
        raise SourceError(f"unsupported URL scheme {scheme!r} in {display} "
                          f"(use one of {', '.join(STREAM_SCHEMES)})")
    from urllib.parse import urlsplit

    try:  # udp://host:99999 waited as for a quiet stream, then said "nothing came"
        urlsplit(url).port
    except ValueError as e:
        raise SourceError(f"{display}: {e}") from None


LIVE_START_INDEX = -2  # the segment of a live HLS playlist it is joined at, from its end


def stream_options(scheme: str) -> dict[str, str]:
    """The FFmpeg options a network stream of this scheme is opened with."""
    options = {"fifo_size": "1000000", "overrun_nonfatal": "1"} if scheme == "udp" else {}
    if scheme.startswith("rtsp"):
        # RTP over the RTSP connection (over UDP, a camera behind NAT or on a lossy Wi-Fi link
        # gave grey, smeared frames), and over UDP where a camera plays it no other way (forced
        # TCP, such a camera was "Protocol not supported" for its 30 s, then given up)
        options["rtsp_flags"] = "prefer_tcp"
    if scheme in CLOCKED_SCHEMES:
        # FFmpeg decodes 20 frames to guess a frame rate that nothing here uses (a live stream's
        # frames are timed as they come): an RTSP camera's MJPEG opened in 1.4 s instead of
        # 0.07, a 30 fps MPEG-TS stream over UDP in 0.75 s instead of 0.3
        options["fpsprobesize"] = "0"
    if scheme.startswith(("rtsp", "rtmp")):
        # FLV may add streams at any time, so FFmpeg probes it for its whole analyzeduration (5 s)
        # before the first frame; the video's parameters come in its first tag. RTSP's are in
        # its first key frame (or the SDP), yet FFmpeg read on 2 s past it: an IP camera's first
        # frame came 2.9 s after the open instead of 0.8 s, and as long after each reconnection
        options["analyzeduration"] = "500000"
    if scheme in WEB:
        # A live HLS playlist is joined two segments from its end, not three (FFmpeg's and the
        # HLS spec's default): paced, its frames are a segment less behind the encoder (2 s
        # segments: 6.0 s instead of 8.0), one segment still in hand. From its last segment
        # the next was often not there yet: 15 % of the frames came in bursts, 1.1 s stalls.
        options["live_start_index"] = str(LIVE_START_INDEX)
    return options
