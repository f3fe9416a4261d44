"""Read an image file into the RGB uint8 array the engine takes.

Any format Pillow reads, from a file or from a web server (an http or https URL, fetched with a
time limit and a size cap). EXIF orientation is applied; grayscale, palette, alpha, CMYK and
16-bit or float images are converted to 8-bit RGB (transparency shown over mid grey:
`engine.request.flatten_alpha`). Every failure is an `ImageError` with a one-line message.
"""

from __future__ import annotations

import io
import os
import sys
import threading
import warnings
from collections import OrderedDict
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import numpy as np
from PIL import Image, UnidentifiedImageError

from engine.errors import ImageError
from engine.request import pil_to_rgb

from .sources import is_remote
from .pipe import STDIN, PipeReader
from .url import redact, unknown_host


FETCH_TIMEOUT_S = 15.0  # to connect, and between two reads
FETCH_MAX_BYTES = 64 << 20  # an "image" larger than this is not one a caption is for
# check_image fetches a URL to check it; read_image then takes those bytes, once, instead of a
# second request (`image URL URL ...` fetched every image twice). Oldest first out beyond this.
FETCH_KEEP_BYTES = 256 << 20
_kept: OrderedDict[str, bytes] = OrderedDict()
_kept_lock = threading.Lock()


def fetch(url: str, keep: bool = False) -> bytes:
    """An image's bytes from a web server; every failure is an ImageError naming the URL
    (without its password). keep: hold them for the next fetch of the URL (which takes them)."""
    return _kept_or(url, _download, keep)


def _kept_or(name: str, load, keep: bool) -> bytes:
    with _kept_lock:
        data = _kept.pop(name, None)
    if data is None:
        data = load(name)
    if keep:
        with _kept_lock:
            _kept[name] = data
            while sum(map(len, _kept.values())) > FETCH_KEEP_BYTES and len(_kept) > 1:
                _kept.popitem(last=False)
    return data


def _is_pipe(name: str | Path) -> bool:
    """Standard input ("-"), or a pipe by name (/dev/stdin, a shell's <(...)): read once, its
    size unknown (0) until then."""
    if str(name) == STDIN:
        return True
    try:
        return Path(name).is_fifo() or Path(name).is_char_device()
    except OSError:
        return False


def _read_pipe(name: str) -> bytes:
    """Everything a pipe holds until its writer closes it; an ImageError when nothing comes for
    FETCH_TIMEOUT_S (a writer that never writes), or beyond FETCH_MAX_BYTES."""
    shown = "standard input" if name == STDIN else name
    if name == STDIN:
        if sys.stdin is None or sys.stdin.isatty():
            raise ImageError("nothing is piped into standard input (-): e.g. rpicam-still -o - | vlmstream image -")
        fd, owned = sys.stdin.fileno(), False
    else:
        try:  # without waiting for a writer: a named pipe nobody writes to is "nothing came"
            fd, owned = os.open(name, os.O_RDONLY | os.O_NONBLOCK), True
        except OSError as e:
            raise ImageError(f"{name} could not be read: {e.strerror}") from None
    reader, chunks, size = PipeReader(fd, FETCH_TIMEOUT_S, lambda: False), [], 0  # live -'s timed reads
    try:
        while chunk := reader.read(1 << 20):
            chunks.append(chunk)
            size += len(chunk)
            if size > FETCH_MAX_BYTES:
                raise ImageError(f"{shown} is over {FETCH_MAX_BYTES >> 20} MB: not an image to caption")
    except TimeoutError:
        raise ImageError(f"cannot read {shown}: nothing came for {FETCH_TIMEOUT_S:g} s") from None
    finally:
        if owned:
            os.close(fd)
    if not size:
        raise ImageError(f"{shown} is empty (nothing came)")
    return b"".join(chunks)


def _download(url: str) -> bytes:
    import urllib.error
    import urllib.request

    shown = redact(url)
    try:
        plain, headers = _without_credentials(url)
        request = urllib.request.Request(plain, headers=headers)
        with urllib.request.urlopen(request, timeout=FETCH_TIMEOUT_S) as response:
            data = response.read(FETCH_MAX_BYTES + 1)
    except urllib.error.HTTPError as e:
        raise ImageError(f"cannot read {shown}: the server answered {e.code} {e.reason}") from None
    except (urllib.error.URLError, OSError, ValueError) as e:
        reason = getattr(e, "reason", None) or e
        reason = unknown_host(url) or getattr(reason, "strerror", None) or reason
        raise ImageError(f"cannot read {shown}: {reason}") from None
    if len(data) > FETCH_MAX_BYTES:
        raise ImageError(f"{shown} is larger than {FETCH_MAX_BYTES >> 20} MB: not an image to caption")
    if not data:
        raise ImageError(f"{shown} is empty (0 bytes)")
    return data


def _without_credentials(url: str) -> tuple[str, dict]:
    """The URL without its user:password, which urllib cannot take there, and the headers that
    carry them instead (HTTP basic authentication, as a NAS asks)."""
    import base64
    from urllib.parse import unquote, urlsplit, urlunsplit

    parts = urlsplit(url)
    headers = {"User-Agent": "vlmstream"}
    if parts.username is None:
        return url, headers
    user_pass = f"{unquote(parts.username)}:{unquote(parts.password or '')}".encode()
    headers["Authorization"] = "Basic " + base64.b64encode(user_pass).decode("ascii")
    host = parts.netloc.rpartition("@")[2]  # as written: `hostname` drops an IPv6 address's brackets
    return urlunsplit((parts.scheme, host, parts.path, parts.query, parts.fragment)), headers


# What `vlmstream image FOLDER` picks up (any case).
IMAGE_EXTENSIONS = frozenset({".jpg", ".jpeg", ".jpe", ".jfif", ".png", ".webp", ".avif", ".bmp", ".gif", ".tif",
                              ".tiff", ".ppm", ".pgm", ".pbm", ".pnm"})


def check_image(path: str | Path) -> None:
    """Cheap checks before a run (the file exists and its header is an image Pillow reads),
    so a mistyped name among many fails at once; decoding may still fail later."""
    with _opened(path, "read", keep=True):
        pass


def read_image(path: str | Path) -> np.ndarray:
    """(H, W, 3) uint8 RGB array of the image's first frame."""
    with _opened(path, "decoded") as img:
        img.load()
        return pil_to_rgb(img)


@contextmanager
def _opened(name: str | Path, verb: str, keep: bool = False) -> Iterator[Image.Image]:
    """The image opened by Pillow; every way that fails is one ImageError ("could not be <verb>")."""
    path = Path(name)
    if is_remote(name) and not path.exists():  # Path() would print it as "http:/host/..."
        source = io.BytesIO(fetch(str(name), keep))
        path = redact(str(name))  # what messages name
    elif _is_pipe(name):  # read once: check_image keeps its bytes for read_image
        source = io.BytesIO(_kept_or(str(name), _read_pipe, keep))
        path = "standard input" if str(name) == STDIN else path
    elif "://" in str(name) and not path.exists():
        raise ImageError(f"{name} is not an image file or an http(s) URL")
    else:
        _check_file(path)
        source = path
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with Image.open(source) as img:
                yield img
    except UnidentifiedImageError:
        raise ImageError(f"{path} is not an image (or not a format Pillow can read)") from None
    except Image.DecompressionBombError as e:
        raise ImageError(f"{path} is too large to decode safely: {e}") from None
    except (OSError, ValueError, SyntaxError, RuntimeError) as e:  # RuntimeError: Pillow's AVIF decoder
        raise ImageError(f"{path} could not be {verb}: {e}") from None


def _check_file(path: Path) -> None:
    if not path.exists():
        raise ImageError(f"image not found: {path}")
    if path.is_dir():
        raise ImageError(f"{path} is a folder, not an image")
    if path.stat().st_size == 0:
        raise ImageError(f"{path} is empty (0 bytes)")
