"""Where `vlmstream video` writes: one output file, or one per video in a folder.

The plan is made before anything runs, so a mistake (an unwritable path, two videos that would
write one file, an output that would overwrite a video) is a one-line UsageError before the
model loads.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from app.cli import UsageError

FORMATS = ("jsonl", "srt", "vtt")
NAME_MAX = 255  # bytes in a file name: Linux's file systems, and most others


@dataclass(frozen=True)
class Outputs:
    """Where one input file's results go, besides a JSONL shared by all files."""

    jsonl: Path | None = None
    subtitles: tuple[tuple[Path, str], ...] = ()
    annotate: Path | None = None


def folder_arg(value: str | None) -> Path | None:
    """An output argument naming a folder (an existing one, or any path ending in a separator)."""
    if not value:
        return None
    p = Path(value)
    return p if value.endswith(("/", os.sep)) or p.is_dir() else None


def check_writable(folders: list[Path], files: list[Path]) -> None:
    """Output folders are made now and output files' folders must exist, so a mistyped path is a
    one-line error before the model loads, not a traceback at the first frame. Each is tried for
    real (a file opened to append and removed again if it was new, a scratch file in a folder):
    permission bits said yes where the write then failed (/proc, a read-only or root-squashed
    mount, a root user)."""
    for d in folders:
        try:
            d.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise UsageError(f"cannot create the output folder {d}: {e.strerror or e}") from None
    for f in files:
        parent = f.parent if str(f.parent) else Path(".")
        if not parent.is_dir():
            raise UsageError(f"cannot write {f}: no folder {parent}")
        if f.is_dir():
            raise UsageError(f"cannot write {f}: it is a folder")
        _try_writing(f, f)
    for d in folders:
        _try_writing(d / f".vlmstream-write-check-{os.getpid()}", d)


def check_not_busy(files: list[Path]) -> None:
    """A UsageError where another run is writing one of these outputs now (it holds its lock:
    pipelines.output_file.open_output), said before the model loads; a file is opened to ask, not changed."""
    from pipelines.output_file import OutputBusy, output_busy

    for f in files:
        try:
            fd = os.open(f, os.O_RDONLY | os.O_NONBLOCK)  # (a FIFO named as an output: not waited on)
        except OSError:  # none yet, or unreadable: its writer says
            continue
        try:
            busy = output_busy(fd)
        finally:
            os.close(fd)
        if busy:
            raise UsageError(str(OutputBusy(f)))


def _try_writing(path: Path, named: Path) -> None:
    existed = path.exists()
    if existed and not path.is_file() and not path.is_dir():
        # A FIFO (`mkfifo log.jsonl`) is asked, not opened: opened, its reader took the close for
        # the end and left, and the run's own open then waited for ever for a reader.
        if not os.access(path, os.W_OK):
            raise UsageError(f"cannot write {named}: {os.strerror(13)}")
        return
    try:
        with open(path, "a"):
            pass
        if not existed:
            path.unlink()
    except OSError as e:
        where = f"into {named}" if named != path else str(named)
        raise UsageError(f"cannot write {where}: {e.strerror or e}") from None


def parse_formats(text: str) -> tuple[str, ...]:
    names = tuple(dict.fromkeys(f.strip().lower().lstrip(".") for f in text.split(",") if f.strip()))
    bad = [f for f in names if f not in FORMATS]
    if bad or not names:
        raise UsageError(f"--format takes jsonl, srt and vtt, separated by commas (got {text!r})")
    return names


def plan_outputs(paths: list[tuple[str, int | None, Path]], out_dir: Path | None, formats: tuple[str, ...],
                 ann_dir: Path | None, annotate: Path | None,
                 subtitles: tuple[Path, str] | None) -> dict[str, Outputs]:
    """Each input's outputs: in a folder, its path relative to the folder it was found in with the
    format's extension (so `-o` the input folder itself puts subtitles beside the videos, where
    players look for them). Two inputs that would write one file, or an output that would
    overwrite an input, are a UsageError before anything runs."""
    plans, owner = {}, {}
    inputs = {Path(p).resolve(): p for p, _, _ in paths}
    # and by the file itself: a hard link to a video is another path to it (it was overwritten)
    inputs.update((_file_id(Path(p)), p) for p, _, _ in paths if _file_id(Path(p)))  # (a URL has none)
    for path, _, rel in paths:
        names = {f: out_dir / rel.with_suffix("." + f) for f in formats} if out_dir else {}
        if subtitles:  # -o OUT.srt: one file
            names = {subtitles[1]: subtitles[0]}
        ann = ann_dir / rel.with_suffix(".mp4") if ann_dir else annotate
        for target in [*names.values(), *([ann] if ann else [])]:
            # first: asking the file system about a name too long raised ENAMETOOLONG (a traceback)
            if len(os.fsencode(target.name)) > NAME_MAX:  # a long video name: each file failed after the run
                raise UsageError(f"cannot write {target}: its name is longer than {NAME_MAX} bytes")
            key = target.resolve()
            if target.is_dir():  # said before the model loads (it was exit 1 after the run)
                raise UsageError(f"cannot write {target}: it is a folder")
            same = inputs.get(key) or inputs.get(_file_id(target))
            if same:
                raise UsageError(f"an output would overwrite the input {same}; choose another folder")
            # --annotate FOLDER/ beside the videos: clip.mov's clip.mp4 replaced the clip.mp4 there
            if target == ann and ann_dir and _someone_elses_video(target):
                raise UsageError(f"{target} is a video vlmstream did not write: the annotated copy of {path} "
                                 "would replace it; choose another folder")
            if key in owner:
                raise UsageError(f"{owner[key]} and {path} would both write {target}; caption them in separate runs")
            owner[key] = path
        plans[path] = Outputs(names.get("jsonl"), tuple((p, f) for f, p in names.items() if f != "jsonl"), ann)
    return plans


def check_not_inputs(targets: list[Path], sources: list[str]) -> None:
    """A UsageError where an output is one of the sources, by its path or as the file itself (a
    hard link): `live clip.mp4 --annotate clip.mp4` replaced the clip with its recording."""
    inputs = {Path(s).resolve(): s for s in sources if os.path.isfile(s)}
    inputs.update((_file_id(Path(s)), s) for s in sources if os.path.isfile(s) and _file_id(Path(s)))
    for target in targets:
        same = inputs.get(target.resolve()) or inputs.get(_file_id(target))
        if same:
            raise UsageError(f"an output would overwrite the source {same}; write it elsewhere")


def _someone_elses_video(path: Path) -> bool:
    """Whether a file plays as a video that is not one of our annotated copies (those a run
    writes over: a second run, a --resume). One cut off before its index (a killed run) plays
    as nothing, and is written over."""
    if not path.is_file():
        return False
    import av

    from pipelines.annotated import ANNOTATED_COMMENT

    try:
        with av.open(str(path)) as container:
            return bool(container.streams.video) and container.metadata.get("comment") != ANNOTATED_COMMENT
    except (av.FFmpegError, OSError, UnicodeDecodeError):
        return False


def _file_id(path: Path) -> tuple[int, int] | None:
    """The file itself (device, inode), whatever path reaches it; None where there is none yet."""
    try:
        st = path.stat()
    except (OSError, ValueError):
        return None
    return st.st_dev, st.st_ino


def read_resumed(read: Callable[[Path], dict], model_of: Callable, out: Path | None, plans: dict, model: str,
                 what: str) -> tuple[dict, dict]:
    """The lines a `--resume` run continues: those of the shared JSONL `out` and of each video's
    own (`plans`: path -> its OutputPlan), read by `read` and all checked before the model loads
    (a folder's files had been checked each in its turn, and those before a refused one written
    with the other model). A UsageError where one holds the `what` (answers, places) of another
    model than --model `model` (`model_of(line)`; lines without one are not asked): resumed with
    another model, the two had been mixed in silence."""
    from engine.models.loader import model_id

    def check(lines: dict, jsonl: Path | None) -> None:
        theirs = {model_id(m) for m in map(model_of, lines.values()) if isinstance(m, str) and m}
        if theirs and theirs != {model_id(model)}:
            raise UsageError(f"{jsonl} holds the {what} of {', '.join(sorted(theirs))}, not of --model {model}: "
                             "resume it with that model, or write to another file")

    done = read(out) if out is not None else {}
    check(done, out)
    if out is not None:
        _say_other_spellings(done, list(plans), out)
    resumed = {path: read(plan.jsonl) for path, plan in plans.items() if plan.jsonl}
    for path, lines in resumed.items():
        check(lines, plans[path].jsonl)
    return done, resumed


def _say_other_spellings(done: dict, inputs: list[str], out: Path) -> None:
    """Warn of an input whose answers the JSONL seems to hold under a path that is not its own: a
    relative one from where the first run ran, neither from here nor from the JSONL's folder
    (`done_frames`). Its frames are asked again and appended a second time; said, the run can be
    stopped and resumed from there. Only a file name the input shares is taken for a sign: one
    JSONL may hold other videos' answers too, on purpose."""
    import sys

    from pipelines.sinks import source_key

    theirs: dict[str, str] = {}  # key -> the path as the JSONL spells it
    for key, line in done.items():
        if key[0] not in theirs:
            theirs[key[0]] = line.source if hasattr(line, "source") else str(line.get("source"))
    ours = {source_key(p): p for p in inputs}
    by_name: dict[str, list[str]] = {}
    for key in theirs.keys() - ours.keys():
        by_name.setdefault(os.path.basename(key), []).append(theirs[key])
    for key, path in ours.items():
        spelt = by_name.get(os.path.basename(key)) if key not in theirs else None
        if spelt:
            print(f"vlmstream: warning: {out} holds answers for {', '.join(sorted(spelt)[:3])}, not for {path} (the "
                  "same video under another path? a relative one is read from where the first run ran): its frames "
                  "are asked again", file=sys.stderr)


class Rebuilds:
    """The outputs a `--resume` run rebuilds from the start (subtitles, annotated MP4s): each that
    exists is written beside itself (a fixed hidden name, so that one a killed run left is
    written over) and replaces it only when `finish` says the new one is whole. Rebuilt in place,
    a resumed run stopped early cut complete ones back to its first frames (an MP4 to nothing).
    A link is written through (the file it names is replaced, its mode kept); one to what is no
    regular file (/dev/null, a FIFO) is written to as it is: replaced, a device node became a file.
    The old one is held locked until then (`output_file.open_output`'s lock): unlocked, a run
    started meanwhile into it alone (`--format srt`) wrote it, and was replaced at this one's end."""

    def __init__(self, resume: bool):
        self.resume = resume
        self._swaps: list[tuple[Path, Path]] = []
        self._held: list = []  # the old ones, open for their locks

    def path(self, target: Path) -> Path:
        """Where to write `target` now."""
        if not (self.resume and target.is_file()):
            return target
        import hashlib
        import shutil

        from pipelines.output_file import OutputBusy, output_busy

        real = Path(os.path.realpath(target))
        try:  # first: a busy one's hidden copy is the other run's own
            held = open(real, "rb")
        except OSError:  # one this user may write but not read: not locked, as before
            held = None
        if held is not None and output_busy(held.fileno()):
            held.close()
            raise OutputBusy(target)
        tag = hashlib.sha1(os.fsencode(real.name)).hexdigest()[:12]
        part = real.with_name(f".vlmstream-resume-{tag}{real.suffix}")
        try:
            part.touch()
            shutil.copymode(real, part)
        except OSError:  # a folder this run may not add a file to: rebuilt in place (locked as it opens)
            part.unlink(missing_ok=True)
            if held is not None:
                held.close()
            return target
        self._held.append(held)
        self._swaps.append((part, real))
        return part

    def finish(self, whole: bool) -> None:
        """Put each rebuilt output in its place if `whole`, else drop it (the old one stays)."""
        swaps, self._swaps = self._swaps, []
        try:
            for part, real in swaps:
                if whole and part.exists():
                    os.replace(part, real)
                else:
                    part.unlink(missing_ok=True)
        finally:
            held, self._held = self._held, []
            for f in held:
                if f is not None:
                    f.close()
