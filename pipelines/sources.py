"""Frame sources by name: `open_live` opens any source for watching live (a file, `webcam:N`, a
stream URL or `-`), and the video files of a folder. The sources themselves: files in
file_source.py (`FileSource`; one on a web server: remote_file.py), streams and pipes in stream.py, cameras in webcam.py; every failure
to open one is a `SourceError` with a one-line message. Their names are importable from here.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from .connection import Connection
from .file_source import FileSource
from .remote_file import is_remote, takes_ranges
from .frame import AS_SHOWN, Frame, Reading, SourceError, SourceSilent
from .pipe import STDIN, is_named_pipe
from .stream import StreamSource
from .url import redact
from .webcam import WebcamSource, parse_webcam

# The names a caller takes from here, whichever module holds them
__all__ = ["FileSource", "Frame", "LiveSource", "Reading", "SourceError", "SourceSilent", "StreamSource",
           "VIDEO_EXTENSIONS", "file_name", "files_under", "is_remote", "open_live", "redact", "shown_names",
           "takes_ranges", "video_files"]

MIN_PASS_S = 0.2  # a network recording is played again at most this often (a snapshot URL: 5 a second)


# What `vlmstream video FOLDER` picks up (any case); anything else in a folder is left alone.
# Raw H.264 / H.265 too: what many IP cameras and recorders export. And a DVD's .vob, a tape's
# .dv capture, a broadcast camera's .mxf, an old Windows camera's .asf: a folder of them was
# "no video files", and one among others was passed over without a word.
VIDEO_EXTENSIONS = frozenset({".mp4", ".m4v", ".mov", ".mkv", ".webm", ".avi", ".ts", ".mts", ".m2ts", ".mpg",
                              ".mpeg", ".flv", ".wmv", ".3gp", ".ogv", ".h264", ".264", ".h265", ".265", ".hevc",
                              ".vob", ".dv", ".mxf", ".asf", ".m2v", ".3g2", ".f4v", ".divx"})


def file_name(source: str) -> str:
    """A video's file name: a path's last part, or a URL's (without its query: an S3 link's
    signature is not a name), for progress bars and the outputs named after it."""
    if is_remote(source):
        from urllib.parse import unquote, urlsplit

        return Path(unquote(urlsplit(source).path)).name or "video"
    return Path(source).name


def shown_names(sources: list[str]) -> dict[str, str]:
    """Each video's name on the terminal among `sources`: its file name, or where another has that
    name too (DCIM/100/clip.mp4, DCIM/101/clip.mp4: both had said "clip.mp4"), the path as given
    (a URL without its credentials). Made once for a run: a folder may hold thousands."""
    from collections import Counter

    names = {s: file_name(s) for s in sources}
    twice = Counter(names.values())
    return {s: (redact(s) if is_remote(s) else s) if twice[n] > 1 else n for s, n in names.items()}


def video_files(folder: str | Path) -> list[Path]:
    return files_under(folder, VIDEO_EXTENSIONS)


def files_under(folder: str | Path, extensions: frozenset[str], unlisted: list[OSError] | None = None) -> list[Path]:
    """The files under a folder and its subfolders with one of these extensions (any case),
    folder by folder with names sorted, so a run and its `--resume` see the same list. Hidden files
    and folders are skipped; symbolic links to folders are not followed (a link loop would never end).
    A folder that cannot be listed (no read permission) adds its error to `unlisted`: its videos
    had been left out without a word, and the run said it was complete."""
    import os

    found = []
    for root, dirs, files in os.walk(folder, onerror=None if unlisted is None else unlisted.append):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        found += [Path(root) / f for f in sorted(files)
                  if not f.startswith(".") and Path(f).suffix.lower() in extensions]
    return found


@dataclass(frozen=True)
class LiveSource:
    """A source opened for watching live (`open_live`)."""

    frames: Callable[[], Iterator[Frame]]  # a fresh iterator of its frames at each call
    paced: bool  # its frames come as fast as they decode: the grabber paces them by their times (a file)
    loops: bool  # it can be played again from its start when it ends (a file, or a recording over the network)
    stream: StreamSource | None = None  # a network stream or a pipe: how it held up (reconnects, damage, lateness)
    connection: Connection | None = None  # a stream's or a camera's: its outages and health, a way to stop it
    # A file's: what a pass through it found wrong (cut short, damaged packets), each said once
    problems: list[str] = field(default_factory=list)


def open_live(source: str, max_outage: float | None = None, reading: Reading = AS_SHOWN,
              name: str | None = None) -> LiveSource:
    """A source to watch live, by name: webcam:N, a stream URL, standard input (-) or a named pipe
    (each read once, as a program writes it), or a video file. A stream or a camera that has sent
    frames is reopened for ever, or given up after `max_outage` seconds without any.

    The source is checked now (camera present, URL scheme, file readable), so a mistake fails
    here. `reading`: as a player shows its frames, or as stored. A recording served over the
    network paces itself (StreamSource) and ends; called again, its frames start over, as a file's
    do. A live stream or a camera never ends that way (it is reopened, `Connection`), so looping
    it changes nothing. `name`: the frames' source id (the web UI's upload by its own name, not its
    scratch path; a listed source by its name, not its URL); else the path, URL (redacted) or webcam:N.
    """
    if not isinstance(source, str) or not source.strip():  # "" had been read as the folder "."
        raise SourceError("no source given: a file, a stream URL, webcam:N or - (standard input)")
    camera = parse_webcam(source)
    if camera is not None:
        cam = WebcamSource(camera, source_id=name, max_outage=max_outage)
        return LiveSource(cam.frames, paced=False, loops=False, connection=cam.connection)
    # Frames come unconverted: the grabber keeps the newest, and the feed converts the ones it takes.
    if "://" in source or source == STDIN or is_named_pipe(source):
        import sys

        if source == STDIN and (sys.stdin is None or sys.stdin.isatty()):
            raise SourceError("nothing is piped into standard input (-): e.g. rpicam-vid -t 0 -o - | vlmstream live -")
        stream = StreamSource(source, name, lazy=True, max_outage=max_outage, reading=reading)  # checks the scheme; redacts credentials

        def passes() -> Iterator[Frame]:
            began = time.perf_counter()
            yield from stream.frames()
            # A still image over HTTP (a camera's snapshot URL) is a recording of one frame, each
            # pass a new request: 400 a second, until passes took at least this long.
            stream.connection.pause(MIN_PASS_S - (time.perf_counter() - began))

        return LiveSource(passes, paced=False, loops="://" in source, stream=stream,  # a pipe reads once
                          connection=stream.connection)
    FileSource(source).close()
    problems: list[str] = []

    def frames() -> Iterator[Frame]:
        src = FileSource(source, source_id=name, threads=False, reading=reading)
        try:
            yield from src.frames(lazy=True)
        finally:
            src.close()
            if src.error and src.error not in problems:  # `video` says these; `live` had kept quiet
                problems.append(src.error)

    return LiveSource(frames, paced=True, loops=True, problems=problems)
