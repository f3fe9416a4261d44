"""What a source's URL says before it is opened: the name to show (`redact`: no credential in a
message, a log or an output) and why its host cannot be reached (`unknown_host`); and, once
FFmpeg found no video there, whether it is an HLS playlist (`is_playlist`).
"""

from __future__ import annotations

from .frame import SourceError

# Query parameters that carry a credential or its signature: presigned S3 (SigV2 and SigV4),
# Google Cloud Storage and CloudFront links, tokens of CDNs and cameras. A presigned link is a
# bearer credential until it expires, and a new one is drawn each time: kept, it leaked into every
# output line, and --resume with a fresh link of the same file redid it all.
SECRET_PARAMS = frozenset({
    "signature", "sig", "awsaccesskeyid", "googleaccessid", "key-pair-id", "policy", "expires", "token",
    "access_token", "auth", "authorization", "api_key", "apikey", "password", "passwd", "pwd", "secret",
    "hdnts", "hdnea", "wmsauthsign", "jwt"})
SECRET_PREFIXES = ("x-amz-", "x-goog-")
# An Azure SAS link's other parameters (its expiry, permissions, version...) change with each
# link too; short names, so only where the link is signed (`sig`).
SAS_PARAMS = frozenset({"se", "st", "sp", "sv", "sr", "spr", "ss", "srt", "si", "skoid", "sktid", "skt", "ske",
                        "sks", "skv", "sdd", "ses"})


def unknown_host(url: str) -> str | None:
    """Why a URL's host cannot be reached, where it has no address (FFmpeg says only
    "Input/output error")."""
    import socket
    from urllib.parse import urlsplit

    host = urlsplit(url).hostname
    if not host:  # udp://:1234 listens on every address
        return None
    try:
        socket.getaddrinfo(host, None)
    except socket.gaierror as e:
        # not a DNS server that failed for now (EAI_AGAIN): a camera is tried again for that
        if e.errno in (socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)):
            return f"no address for the host {host} (a typo, or no network?)"
        return None
    except UnicodeError:
        return f"no address for the host {host} (a typo, or no network?)"
    except (OSError, TypeError):
        return None
    return None


PLAYLIST_UNREAD = "an HLS playlist whose segments cannot be read (missing on the server, or not video: {})"


def is_playlist(url: str, timeout: float = 5.0) -> bool:
    """Whether a web URL is an HLS playlist: where FFmpeg read no video from one, its segments
    failed (a 404 each), and "not a video" blamed the playlist."""
    import http.client
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=timeout) as answer:
            return answer.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n").startswith(b"#EXTM3U")
    except (OSError, ValueError, http.client.HTTPException):  # credentials in the URL: InvalidURL
        return False


def redact(url: str) -> str:
    """The URL with any user:password and the values of its credential query parameters
    (SECRET_PARAMS) replaced by ***: for messages, logs and outputs, and the name a --resume
    finds a file's results by (the same with each new presigned link)."""
    from urllib.parse import urlsplit, urlunsplit

    try:
        parts = urlsplit(url)
    except ValueError as e:  # "udp://[::1": Invalid IPv6 URL (a traceback where the name was first shown)
        raise SourceError(f"{url} is not a valid URL: {e}") from None
    if not parts.scheme or not parts.netloc:  # a path (a colon in a file name is no scheme)
        return url
    try:
        parts.port
        raw = "@" not in parts.netloc and "@" in parts.fragment  # a fragment is never a stream's
    except ValueError:
        raw = "@" in url.split("://", 1)[-1]
    if raw:  # a password's raw "#", "?" or "/" ended the host early, for FFmpeg as well: said with
        # the password in it ("Port could not be cast to integer value as 'a b'"), or shown whole
        rest = url.split("://", 1)[-1]
        raise SourceError(f"{parts.scheme}://***@{rest.rpartition('@')[2]} is not a valid URL: in a password, "
                          "write # as %23, ? as %3F and / as %2F")
    netloc, query = parts.netloc, parts.query
    if parts.username or parts.password:
        netloc = "***@" + netloc.rpartition("@")[2]  # the host as written ([::1] keeps its brackets)
    if query:
        pairs = [pair.partition("=") for pair in query.split("&")]
        signed = any(name.lower() == "sig" for name, _, _ in pairs)

        def secret(name: str) -> bool:
            name = name.lower()
            return name in SECRET_PARAMS or name.startswith(SECRET_PREFIXES) or signed and name in SAS_PARAMS

        query = "&".join(f"{name}=***" if eq and secret(name) else name + eq + value for name, eq, value in pairs)
    if (netloc, query) == (parts.netloc, parts.query):
        return url
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def shown_as(url: str, name: str | None = None) -> str:
    """The URL as messages show it (`redact`); a URL that is none, said by its `name` where it has
    one (a listed source, `--sources`: the reason alone, since redact's message has the URL as
    written, its password in it)."""
    try:
        return redact(url)
    except SourceError as e:
        if name is None:
            raise
        raise SourceError(f"{name}: not a valid URL ({str(e).partition(' is not a valid URL: ')[2]})") from None


def without_host(said: str | None, url: str) -> str | None:
    """A listed source's message without the URL's host, which the list keeps as it keeps its
    password: a page that played "Front door" was told "no address for the host cam1.lan"."""
    import re
    from urllib.parse import urlsplit

    host = urlsplit(url).hostname if said else None
    if host:
        said = re.sub(rf"(the host )?{re.escape(host)}", "its host", said, flags=re.IGNORECASE)
    return said
