"""The files a `live` run writes, and how they are named (app/live.py, app/live_locate.py).

`open_log` opens its per-frame log (-o), which errors name by `log_name`; `recording_paths` are
its recordings' (--annotate), `save_change_frame` writes a snapshot of a change (--snapshots); in
all of them a source goes by its `file_names` name. A path that cannot be written is a UsageError.
"""

from __future__ import annotations

import sys
from pathlib import Path

from app.cli import UsageError
from app.outputs import check_writable, folder_arg


def save_change_frame(folder: Path, source: str, frame) -> Path:
    """The frame of a change as a JPEG named by the UTC time it was saved (names sort in time
    order), the source's `file_names` name (with several) and the frame's index. A label given
    as it is shown (--detect's: `Front door`, a URL's `rtsp://***@cam/live`) is made a file name
    here as `file_names` makes it: its slashes had named folders that are not there, and the run
    stopped at its first change ("cannot write a snapshot")."""
    from datetime import datetime, timezone

    from pipelines.sinks import file_label, save_jpeg

    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S.%f")[:-3] + "Z"
    source = source and (file_label(source) or "source")
    return save_jpeg(folder / f"{stamp}{'_' + source if source else ''}_{frame.index}.jpg", frame.rgb)


def file_names(sources: list[str], labels: list[str], listed: list[str | None] | None = None) -> list[str]:
    """Each source as its recordings and snapshots name it: a file's name without its folder and
    suffix, a stream's address without credentials, a source of `live --sources` by its name
    (`listed`, None for the others), made unique. Snapshots had carried a file's whole path
    (_work_clips_door.mp4) where its recording said door."""
    from pipelines.sinks import file_label

    listed = listed or [None] * len(sources)
    # standard input is "stdin": its recordings and snapshots were STAMP_-.mp4 and ..._-_0.jpg
    names = [file_label(name or ("stdin" if source == "-" else Path(source).stem if Path(source).is_file() else label))
             or "source" for source, label, name in zip(sources, labels, listed)]
    # A name no other source has is kept; the others get the first free _1, _2...: door_2.mp4
    # beside a/door.mp4 and b/door.mp4 stays door_2, they become door_1 and door_3
    taken = {n for n in names if names.count(n) == 1}
    unique: list[str] = []
    for n in names:
        name, k = n, 1
        while names.count(n) > 1 and (name == n or name in taken):
            name, k = f"{n}_{k}", k + 1
        taken.add(name)
        unique.append(name)
    return unique


def recording_paths(annotate: str | None, sources: list[str], labels: list[str],
                    listed: list[str | None] | None = None) -> list[Path] | None:
    """--annotate: OUT.mp4 (one source), or FOLDER/: a file per source named by the UTC time the
    run began and the source (`file_names`), so a restarted job starts new files beside the old
    ones."""
    if not annotate:
        return None
    folder = folder_arg(annotate)
    if folder is None:
        if Path(annotate).suffix.lower() != ".mp4":
            raise UsageError("--annotate must end in .mp4, or name a folder (end it with /)")
        if len(labels) > 1:
            raise UsageError("several sources need a folder for their recordings: --annotate FOLDER/")
        check_writable([], [Path(annotate)])
        return [Path(annotate)]
    check_writable([folder], [])
    from datetime import datetime, timezone

    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    return [folder / f"{stamp}_{name}.mp4" for name in file_names(sources, labels, listed)]


def open_log(output: str | None):
    """The per-frame log: None, standard output ('-'), or a file opened for appending (a
    restarted stream continues its log). A path that cannot be written, or that another run
    writes now, is a UsageError now."""
    if output is None:
        return None
    if output == "-":
        return sys.stdout
    from pipelines.output_file import OutputBusy, cut_partial_line, open_output

    try:
        # Locked first: two runs appending to one log spliced their lines (each flushes 8 KB at a
        # time, not whole lines), and one starting cut the other's half-written last line off.
        log = open_output(output, "a")
    except OutputBusy as e:
        raise UsageError(str(e)) from None
    except OSError as e:
        raise UsageError(f"cannot write {output}: {e.strerror or e}") from None
    try:
        cut_partial_line(output)  # a line the last run's end (a kill, a full disk) cut short
    except OSError as e:
        log.close()
        raise UsageError(f"cannot write {output}: {e.strerror or e}") from None
    return log


def log_name(output: str | None) -> str:
    """The log as an error names it: `-o -` (or no -o: `--json` lines) is standard output."""
    return "standard output" if output in (None, "-") else output
