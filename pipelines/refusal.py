"""Why a stream that failed to open is given up at once rather than retried.

`refusal` is the reason a try's error is no outage (a wrong URL or password, a host with no
address, a web page that is no video), said at once; None when the stream may yet come. An
FFmpeg that cannot read the scheme at all raises its SourceError here.
"""

from __future__ import annotations

from typing import Callable

from .frame import SourceError
from .schemes import WEB
from .url import PLAYLIST_UNREAD, is_playlist, unknown_host


def refusal(e: Exception, url: str, display: str, first: bool, open_timeout: float,
            clean: Callable[[Exception, float], str]) -> str | None:
    """`first`: the stream never sent a frame; `clean`: the error in one line, its waiting time given."""
    import av

    # A client error (404, 401, 403...) from a stream that never sent a frame is a wrong
    # URL or password, not an outage: said at once, not after max_wait of retries (the
    # live CLI's --duration often ended first, and the reason was never shown).
    refused = (first and isinstance(e, av.HTTPClientError)  # 429 is "later", not "no"
               and not isinstance(e, getattr(av, "HTTPTooManyRequestsError", ())))
    if isinstance(e, av.ProtocolNotFoundError):  # srt:// with PyAV's own FFmpeg (built without libsrt)
        scheme = url.split(":", 1)[0]
        raise SourceError(f"cannot read {display}: the FFmpeg inside PyAV reads no {scheme}:// "
                          f"streams; pipe it in with an ffmpeg that does: ffmpeg -i '{display}' "
                          "-c copy -f mpegts - | vlmstream live -") from None
    # So is a host with no address, or a web server's answer that is no video (a page):
    # retried for 30 s, they were said as FFmpeg's "Input/output error" / "Invalid data".
    hopeless = unknown_host(url) if first else None
    if first and isinstance(e, av.InvalidDataError) and url.split(":", 1)[0].lower() in WEB:
        why = clean(e, 0)
        hopeless = PLAYLIST_UNREAD.format(why) if is_playlist(url) else f"not a video ({why})"
    if refused or hopeless:
        return hopeless or clean(e, open_timeout)
    return None
