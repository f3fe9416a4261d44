"""Why a video file cannot be read, said before FFmpeg is asked or after it refused.

`check_file` raises a one-line `SourceError` for a local path that is no video file (missing, a
folder, a device, a named pipe, empty); `no_index` is what to add to FFmpeg's "Invalid data"
about an MP4 that has no index yet ("" when that is not why).
"""

from __future__ import annotations

from pathlib import Path

from .frame import SourceError


def check_file(path: Path) -> None:
    if not path.exists():
        raise SourceError(f"video not found: {path}")
    if path.is_dir():
        raise SourceError(f"{path} is a folder, not a video")
    if path.is_char_device() or path.is_block_device():
        raise SourceError(f"{path} is a device, not a video file (a camera is webcam:N or /dev/videoN, "
                          "read by `vlmstream live`)")
    if path.is_fifo():  # opening it would wait for a writer with no time limit
        raise SourceError(f"{path} is a named pipe, not a video file: `vlmstream live {path}` reads "
                          "a stream from it")
    if path.stat().st_size == 0:
        raise SourceError(f"{path} is empty (0 bytes)")


def no_index(url: str | None, path: str, error: Exception) -> str:
    """Why an MP4 or MOV file that FFmpeg cannot read may be so: one that begins as an MP4 does
    ("ftyp") but has no index (its "moov", written last), a recording still going on or cut off
    before its end. FFmpeg says only "Invalid data found when processing input"."""
    import av

    if url or not isinstance(error, av.InvalidDataError):
        return ""
    try:
        with open(path, "rb") as f:
            head = f.read(8)
    except OSError:
        return ""
    return (" (an MP4 without its index: a recording still being written, or one cut off before its end)"
            if head[4:8] == b"ftyp" else "")
