"""A video file on a web server (an http or https URL): how it is named and opened.

`is_remote` says whether a name is one; `takes_ranges` whether its server answers a byte-range
request (a seek, or FFmpeg's reconnect mid-file, needs one); REMOTE_TIMEOUTS_S and REMOTE_OPTIONS
are what `FileSource` opens it with.
"""

from __future__ import annotations

from pathlib import Path

REMOTE_SCHEMES = ("http", "https")  # a file on a web server: `video` reads it as a file
REMOTE_TIMEOUTS_S = (15.0, 30.0)  # to open, and for a read, before a remote file is given up
# FFmpeg's http client reopens a connection dropped mid-file at the byte it had reached (a Range
# request: a file cut in half by a reset came whole, 480 frames against 178). Not on a failed
# connect ("reconnect_on_network_error"): a server that is down is said at once, not in 15 s.
REMOTE_OPTIONS = {"reconnect": "1", "reconnect_delay_max": "30"}


def is_remote(name: str | Path) -> bool:
    """Whether a name is an http(s) URL: a file on a web server."""
    text = str(name)
    return "://" in text and text.split("://", 1)[0].lower() in REMOTE_SCHEMES


def takes_ranges(url: str, timeout: float = 5.0) -> bool | None:
    """Whether a web server answers a request for a byte range with that range (206), None
    when it cannot be asked (no answer, an error, credentials in the URL)."""
    import urllib.request

    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers={"Range": "bytes=0-0"}), timeout=timeout) as r:
            return r.status == 206  # the body of a whole-file answer is not read
    except (OSError, ValueError):
        return None
