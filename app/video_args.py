"""The arguments of `vlmstream video`, checked, and the input files they name.

`check_args` is every check that needs no model: a mistake (a bad number, outputs that do not go
together, a file named twice, a missing or unreadable named file, an output that cannot be written
or would overwrite a video) is a one-line UsageError (a SourceError for a named file), exit 2,
before the model loads; nothing is written yet but the output folders and a write check of each
output. Every input file is probed (opened once and closed again): one found in a folder that
cannot be read is skipped with a warning instead. The result, `VideoArgs`, is what the run needs:
its prompts, its outputs (an `Outputs` plan per file) and its files.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from app.cli import UsageError, check_changes_args, folder_files, sticky_arg
from app.outputs import (FORMATS, Outputs, check_not_busy, check_not_inputs, check_writable, folder_arg, parse_formats,
                         plan_outputs)
from app.parser import LOCATE_BATCH
from app.prompt_args import prompt_tasks


@dataclass
class VideoArgs:
    """What `check_args` found: the prompts, where the results go, and the files to read."""

    tasks: list[dict]
    one_prompt: dict | None  # what a JSONL line without a prompt answered
    out: Path | None  # -o FILE (not a folder, not -)
    kind: str | None  # -o FILE's format, "jsonl" for -o -
    to_stdout: bool
    out_dir: Path | None
    formats: tuple[str, ...]  # -o FOLDER/'s
    paths: list[tuple[str, int | None, Path]]  # each file, its announced frame count, its name in its folder
    skipped: list[str]  # files in a folder that could not be read
    plans: dict[str, Outputs]
    sticky: float
    snapshots: Path | None
    region: tuple[str, str] | None  # --detect/--point: (task, what)


def check_args(args: argparse.Namespace) -> VideoArgs:
    """Checks the arguments in the order the command always has (its first mistake is the one
    said); sets args.batch for --detect/--point."""
    from pipelines.sampling import MAX_FPS

    if args.fps is not None and not 0 < args.fps <= MAX_FPS or args.every_n is not None and args.every_n < 1:
        raise UsageError(f"--fps must be a finite number > 0 (at most {MAX_FPS:g}) and --every-n >= 1")  # NaN too
    tasks = prompt_tasks(args)
    one_prompt = tasks[0] if len(tasks) == 1 else None  # what a JSONL line without a prompt answered
    out_dir, ann_dir = folder_arg(args.output), folder_arg(args.annotate)
    to_stdout = args.output == "-"  # JSON lines on standard output, for piping
    out = None if out_dir or not args.output or to_stdout else Path(args.output)
    kind = "jsonl" if to_stdout else out.suffix.lower().lstrip(".") if out else None
    if out and kind not in FORMATS:
        raise UsageError("-o must end in .jsonl, .srt or .vtt, or name a folder (end it with /)")
    if args.annotate and not ann_dir and Path(args.annotate).suffix.lower() != ".mp4":
        raise UsageError("--annotate must end in .mp4, or name a folder (end it with /)")
    if args.format and not out_dir:
        raise UsageError("--format goes with -o FOLDER/ (a file's extension gives its format)")
    formats = parse_formats(args.format or "jsonl") if out_dir else ()
    region = None
    if args.detect is not None or args.point is not None:
        from app.prompt_args import region_task

        region = region_task(args)
        if args.sticky is not None:  # as `live --detect` says: it was ignored without a word
            raise UsageError(f"--sticky goes with captions and questions, not --{region[0]} (every processed "
                             "frame is located afresh)")
        args.batch = LOCATE_BATCH if args.batch is None else args.batch
        if args.batch < 1:
            raise UsageError("--batch must be >= 1")
    elif args.batch is not None:
        raise UsageError("--batch goes with --detect/--point (captions are batched by the engine)")
    paths, skipped, copies = _inputs(args.files, exclude=ann_dir)
    if len(paths) > 1 and kind in ("srt", "vtt"):
        raise UsageError(f"several files need a folder for their subtitles: -o FOLDER/ --format {kind}")
    if len(paths) > 1 and args.annotate and not ann_dir:
        raise UsageError("several files need a folder for their annotated videos: --annotate FOLDER/")
    if args.resume and to_stdout:
        raise UsageError("--resume needs a JSONL file to read back, not -o -")
    if args.resume and kind != "jsonl" and "jsonl" not in formats:
        raise UsageError("--resume needs -o OUT.jsonl, or -o FOLDER/ with jsonl among its --format")
    sticky = sticky_arg(args)
    check_changes_args(args)
    if args.changes and args.resume:
        raise UsageError("--changes writes only the answers that changed: --resume could not tell the frames done")
    if args.changes and (kind in ("srt", "vtt") or out_dir and "jsonl" not in formats):
        raise UsageError("--changes reports in JSONL or on the terminal (subtitles merge repeated captions already)")
    snapshots = Path(args.snapshots) if args.snapshots else None
    if snapshots and not (kind == "jsonl" or "jsonl" in formats):
        raise UsageError("--snapshots needs a JSONL output (-o OUT.jsonl, -o -, or -o FOLDER/), whose lines name "
                         "the pictures")
    if snapshots and out and resolved(snapshots) == resolved(out):  # it was made, then -o failed on it
        raise UsageError(f"--snapshots {snapshots} is -o's file: the pictures need a folder")
    if snapshots:
        check_writable([snapshots], [])
    ann_file = Path(args.annotate) if args.annotate and not ann_dir else None
    plans = plan_outputs(paths, out_dir, formats, ann_dir, ann_file, (out, kind) if kind in ("srt", "vtt") else None)
    if out is not None and kind == "jsonl":  # a link named .jsonl to a video had been cut and appended to
        check_not_inputs([out], [p for p, _, _ in paths])
    check_writable([d for d in (out_dir, ann_dir) if d], [p for p in (out, ann_file) if p])
    written = [p for plan in plans.values() for p in (plan.jsonl, *(s for s, _ in plan.subtitles), plan.annotate) if p]
    check_not_busy([out, *written] if out else written)  # another run writing one: refused, not spliced into
    if copies:  # once the run is sure to go (a mistake is its one line alone)
        print(f"vlmstream: note: {_copies(copies)} left out (name one to caption it)", file=sys.stderr)
    return VideoArgs(tasks, one_prompt, out, kind, to_stdout, out_dir, formats, paths, skipped, plans, sticky,
                     snapshots, region)


def _inputs(names: list[str], exclude: Path | None = None
            ) -> tuple[list[tuple[str, int | None, Path]], list[str], int]:
    """The files to caption, each with its announced frame count and its name relative to the
    folder it was found in (a named file: its own name), and the files skipped.

    A folder stands for the videos under it (`folder_files`). Every file is opened once here and
    closed again, so a named file that is missing or unreadable stops the run before it starts
    (SourceError); one found in a folder is skipped with a warning instead: one broken clip must
    not hold up a folder of good ones. A file named twice is a mistake (UsageError); one reached
    twice through folders is taken once. Videos in an output folder (`exclude`) inside an input
    folder are an earlier run's annotated videos, not inputs; so are those vlmstream wrote
    anywhere in an input folder (counted: the third value)."""
    from pipelines.sources import VIDEO_EXTENSIONS, FileSource, SourceError, file_name

    seen: set[str] = set()
    for name in names:
        if name in seen:  # named, among a glob's thousands
            raise UsageError(f"{name} is listed twice")
        seen.add(name)
    if "-" in names and not Path("-").exists():  # it said "video not found: -"
        raise UsageError("video reads files, not standard input: `vlmstream live -` captions a stream piped in")
    excluded = resolved(exclude) if exclude else None
    found: list[tuple[str, Path | None]] = []  # a named file keeps its spelling: it is the JSONL's source
    skipped: list[str] = []
    for name in names:
        p = Path(name)
        if p.is_dir():
            videos, unlisted = folder_files(p, VIDEO_EXTENSIONS)
            skipped += unlisted
            if excluded and excluded == resolved(p):  # a second run would take the annotated videos for inputs
                raise UsageError(f"--annotate {exclude} is an input folder: give the annotated videos a folder of "
                                 f"their own (a subfolder will do: --annotate {exclude / 'annotated'}/)")
            if excluded and excluded.is_relative_to(resolved(p)):
                videos = [v for v in videos if not resolved(v).is_relative_to(excluded)]
            if not videos:
                raise UsageError(f"no video files in {p} (looked for .mp4, .mkv, .webm, .mov, .avi and other "
                                 "video extensions, in subfolders too)")
            found += [(str(v), v.relative_to(p)) for v in videos]
        else:
            found.append((name, None))
    paths, seen, copies = [], set(), 0
    for p, rel in found:
        key = resolved(Path(p))
        if key in seen:
            continue
        seen.add(key)
        try:
            with FileSource(p) as src:
                if rel is not None and src.annotated:  # an earlier run's, annotated into a folder in here
                    copies += 1
                    seen.discard(key)  # named as well, it is captioned
                    continue
                paths.append((p, src.frame_count, rel or Path(file_name(p))))
        except SourceError as e:
            if rel is None:
                raise
            skipped.append(p)
            print(f"vlmstream: warning: skipped: {e}", file=sys.stderr)
    if not paths and copies and not skipped:
        raise UsageError(f"the videos found are {_copies(copies)}: name one to caption it")
    if not paths:
        raise UsageError(f"none of the {len(found)} video files found can be read")
    return paths, skipped, copies


def _copies(n: int) -> str:
    return f"{n} annotated cop{'y' if n == 1 else 'ies'} that vlmstream wrote"


def resolved(path: Path) -> Path:
    """The path with its links followed; a link that loops as it is, made absolute (resolve()
    raised RuntimeError: a traceback for a bad link in a folder of videos). Opening it says why."""
    try:
        return path.resolve()
    except (OSError, RuntimeError):
        return Path(os.path.abspath(path))
