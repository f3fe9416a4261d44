"""Named sources (`vlmstream ui --sources FILE`, `vlmstream live --sources FILE`): the cameras and
streams an operator sets up once, chosen by name on the web UI's Live tab or on `live`'s command
line (where a URL's password would show in `ps`).

The file has one source a line, `NAME = SOURCE` (a stream URL, webcam:N or a video file, whose
relative path is taken from the file's own folder; spaces around the `=` and quotes around a name
or a source ignored, blank lines and lines starting with # skipped), each name once. A page
sees only the names: its Start plays the source behind one (`SourceList.resolve`), its frames,
Export and the activity log are named by it, so the URL's password never reaches a browser. With
`only` (`ui --listed-only`), a page plays nothing else but the samples and its own uploads: no
path or URL of the server's typed in.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from app.errors import UIError, UsageError


@dataclass(frozen=True)
class SourceList:
    named: dict[str, str] = field(default_factory=dict)  # name -> source, in the file's order
    only: bool = False  # nothing else plays (the samples and uploads aside)

    def resolve(self, choice: str, samples: list[str]) -> tuple[str, str | None]:
        """(the source to open, the name its frames go by: None for a sample, path or URL as
        typed). A UIError for a source that is not listed, where only listed ones play."""
        choice = (choice or "").strip()
        if choice in self.named:
            return self.named[choice], choice
        if self.only and choice and choice not in samples:
            names = ", ".join(self.named) or "none"
            raise UIError(f"this server plays only its listed sources ({names}) and the samples, or an "
                          "uploaded file (vlmstream ui --listed-only)")
        return choice, None


def read_sources(path: str | None, only: bool = False, samples: list[str] | tuple = ()) -> SourceList:
    """The --sources file read; a UsageError, with its line, for a line that is not NAME = SOURCE or
    a name given twice. `only` without a file is a mistake too (nothing would play but the samples).
    A SOURCE among `samples` (the web UI's sample videos, by file name) is that sample, wherever
    the list is."""
    if path is None:
        if only:
            raise UsageError("--listed-only needs --sources FILE: the sources it lets pages play")
        return SourceList()
    try:
        lines = Path(path).read_text(encoding="utf-8-sig").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"--sources: cannot read {path}: {getattr(e, 'strerror', None) or e}") from None
    named: dict[str, str] = {}
    for n, line in enumerate(lines, 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, source = (_unquoted(part.strip()) for part in line.partition("="))
        if not sep or not name or not source or "://" in name:  # a URL's query: not a name
            raise UsageError(f"--sources {path}, line {n}: expected NAME = SOURCE (a URL, webcam:N or a file)")
        if name in named:
            raise UsageError(f"--sources {path}, line {n}: {name} is named twice")
        named[name] = source if source in samples else _beside(source, Path(path).parent)
    if not named:
        raise UsageError(f"--sources {path} has no NAME = SOURCE line")
    return SourceList(named, only)


def _beside(source: str, folder: Path) -> str:
    """A file's path as the list gives it, relative to the list's own folder (~ for the home
    folder), as a setup file's paths are: `Demo = clips/demo.mp4` beside /etc/vlmstream/cams.txt
    had been looked for in whatever folder the server or the run was started from. A URL,
    webcam:N and - (standard input) are kept as they are."""
    import os

    if "://" in source or source == "-" or source.startswith("webcam:"):
        return source
    source = os.path.expanduser(source)
    return source if os.path.isabs(source) or folder == Path(".") else os.path.join(folder, source)


def _unquoted(text: str) -> str:
    """A name or source without the quotes around it (`"Front door" = "rtsp://..."`, as a shell or
    an INI file has them): the name had kept them, so `live --sources cams.txt "Front door"` found
    no such name, and the source was a URL of the scheme '"rtsp'."""
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1].strip()
    return text


def chosen(given: list[str], path: str | None) -> tuple[list[str], list[str | None]]:
    """`live`'s sources and their names (None for one given as itself): with a --sources file,
    each SOURCE that is a name in it is that source (all of them where none is given), the others
    as they are. A UsageError for no source at all, a name given twice, or a SOURCE that is
    neither a name in the file nor a file, URL or camera (a mistyped name had been "video not
    found: Frnt door")."""
    import os

    names: list[str | None] = [None] * len(given)
    sources = given
    if path is not None:
        listed = read_sources(path).named
        picked = given or list(listed)
        for c in picked:
            if c not in listed and "://" not in c and c != "-" and not c.startswith(("webcam:", "/dev/")) \
                    and not os.path.exists(c):
                raise UsageError(f"{c} is no name in {path} ({', '.join(listed)}) and no file")
        names = [c if c in listed else None for c in picked]
        sources = [listed.get(c, c) for c in picked]
    elif not given:
        raise UsageError("name a SOURCE (a file, webcam:N, a stream URL, -), or give --sources FILE")
    if len(set(filter(None, names))) != len(list(filter(None, names))):
        raise UsageError("a source is listed twice")
    return sources, names


def open_listed(source: str, name: str | None, **options):
    """`open_live(source, name=name, **options)`; a listed source's failure to open says its name
    (`live --sources cams.txt` plays them all: "no camera at webcam:0" or "video not found:
    clips/door.mp4" said which entry only by what it stands for). Its kind (and exit code) kept."""
    from pipelines.sources import SourceError, open_live

    try:
        return open_live(source, name=name, **options)
    except SourceError as e:
        if name is not None and name not in str(e):
            e.args = (f"{name}: {e}",)
        raise
