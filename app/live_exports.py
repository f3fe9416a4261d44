"""A live feed's downloads: its captions as a JSONL file and its change pictures as a ZIP, each
written among the server's kept outputs (`VideoJobs.new_folder`). Each takes the feeds to export
from, the running one first: the first that has something gives it (a stopped feed's captions
stay for the tab's Export). Nothing to export, or a disk that cannot take it, is a UIError."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from app.errors import UIError
from app.video_jobs import VideoJobs


def export_log(feeds: list, kind: str, jobs: VideoJobs) -> Path:
    """The captions of the first of `feeds` that has any ("pull": a source's, "push": a camera's)
    as a JSONL file: the last EXPORT_LINES answers, one `LiveResult.records` line each."""
    lines = next((r for r in (f.records() for f in feeds) if r), None)
    if not lines:
        raise UIError("nothing captioned yet: start a live source first" if kind == "pull" else
                      "nothing captioned yet: start your camera first")
    return _export(jobs, "live-captions.jsonl",
                   lambda path: path.write_text("\n".join(lines) + "\n", encoding="utf-8"))


def export_shots(feeds: list, kind: str, jobs: VideoJobs) -> Path:
    """The change pictures of the first of `feeds` that has any, at full size, as a ZIP:
    `change_NNNN_frame_I.jpg` each, and `changes.jsonl` with a line per picture (its change number,
    UTC time, stream time, frame index, answers, file name)."""
    import zipfile
    from datetime import datetime, timezone

    shots = next((x for x in (f.snapshot().shots for f in feeds) if x), None)
    if not shots:
        raise UIError("no changes yet: start a live source first" if kind == "pull" else
                      "no changes yet: start your camera first")

    def write(path: Path) -> None:
        lines = []
        with zipfile.ZipFile(path, "w") as z:
            for shot in shots:
                name = f"change_{shot.number:04d}_frame_{shot.index}.jpg"
                z.writestr(name, shot.full)  # JPEG: stored, not compressed again
                when = datetime.fromtimestamp(shot.wall, timezone.utc).isoformat(timespec="milliseconds")
                lines.append(json.dumps({"number": shot.number, "time": when, "pts": round(shot.pts, 6),
                                         "index": shot.index, "text": shot.text, "file": name},
                                        ensure_ascii=False))
            z.writestr("changes.jsonl", "\n".join(lines) + "\n", compress_type=zipfile.ZIP_DEFLATED)

    return _export(jobs, "live-changes.zip", write)


def _export(jobs: VideoJobs, name: str, write: Callable[[Path], None]) -> Path:
    """A file for a download, among the kept outputs. One the server's disk cannot take is a
    UIError (a full disk had shown the page a bare "[Errno 28]" and left a part file)."""
    path = None
    try:
        path = jobs.new_folder() / name
        write(path)
    except OSError as e:
        if path is not None:
            path.unlink(missing_ok=True)
        raise UIError(f"cannot write {name} on the server: {e.strerror or e}") from None
    return path
