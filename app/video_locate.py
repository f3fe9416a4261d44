"""`vlmstream video --detect OBJECT` / `--point OBJECT`: where an object is in every processed
frame of video files, through the model's region head (engine/region_decoder.py).

Moondream 2's region protocol runs one frame at a time through the reference decoder (batch 1,
a host sync a step: the engine does not batch it), so a frame costs what `image --detect` costs.
Each frame gives a JSON line (-o OUT.jsonl, -o -, or -o FOLDER/ with jsonl) with the boxes (or
points) as fractions of the frame and in pixels, and its timings; without -o, a terminal line a
frame. `--annotate` draws them on the frames. `--resume` continues the JSON lines of an interrupted
run: frames written for the same object are not located again (a new `--annotate` draws them from
their lines). `--changes` reports a frame only when the number found differs from the last report
of its file (held `--hold` frames; `previous` and `since` in its line), and `--snapshots` keeps the
frame of each change with the places drawn. Subtitles (-o OUT.srt, OUT.vtt, or a folder's
--format srt,vtt) say the number found ("star: 2 found"), one cue while it stays the same. The
embedded tiny model's region head was never trained: asking it is exit 2 before anything is
written. Files that cannot be read, or end early, are a warning and exit 1 once the others are
done, as for captions.

app/video.py checks the arguments and probes the files (app/video_args.py), then calls `run`; the
files are located one after another, and the state they share is app/video_locate_run.py's. The
errors (warnings when some work was done) and one summary line go to stderr. Exit 0; 1 when some
of the work is missing (a file unreadable or cut off) or an output could not be written; 2 when
every file failed (the JSONL this run made goes again) or the region head is untrained; 130 when
Ctrl-C stopped it (143 for SIGTERM: app/launcher.py), what was written kept whole; 0 when the
reader of -o - closed it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from app.cli import UsageError
from app.outputs import read_resumed

if TYPE_CHECKING:
    from app.video_locate_run import VideoLocateRun


def done_places(path: Path | None, task: str, what: str) -> dict[tuple[str, int], dict]:
    """(source_key, frame index) -> the line a previous run wrote for this object (for --resume);
    a line cut short by an interruption, or written for another object, is not done."""
    from pipelines.sinks import source_key

    done: dict[tuple[str, int], dict] = {}
    if path is None or not path.exists():
        return done
    changes = False
    # What follows the last newline was cut short (the sink drops it: done_frames says why).
    for raw in path.read_bytes().split(b"\n")[:-1]:
        try:
            r = json.loads(raw.decode("utf-8"))
            if r.get(task) == what and isinstance(r.get("pixels"), list):
                done[(source_key(str(r["source"])), int(r["index"]))] = r
                changes = changes or {"previous", "since"} <= r.keys()
        except (ValueError, KeyError, TypeError, AttributeError, OverflowError):
            continue
    if changes:  # its frames in between are not there: all would be located again, and appended out of order
        raise UsageError(f"{path} holds the counts that changed (written with --changes), not every frame's: "
                         "--resume cannot continue it; write to another file")
    return done


def run(args: argparse.Namespace, paths: list[tuple[str, int | None, Path]], plans: dict, out: Path | None,
        to_stdout: bool, sampling, skipped: list[str], task: str, what: str) -> int:
    """The run of app/video.py's checked and probed files (`paths`: each file, its announced frame
    count, its name in its folder; `plans`: path -> its Outputs; `skipped`: those unreadable) for
    `task` ("detect" or "point") of `what`, one file after another; its exit code."""
    from engine.models.loader import load_model, model_id
    from engine.region_decoder import RegionDecoder

    from app.cli import realtime_dtype
    from app.video_locate_run import VideoLocateRun

    done, resumed = read_resumed(lambda p: done_places(p, task, what), lambda r: r.get("model"), out, plans,
                                 args.model, "places") if args.resume else ({}, {})
    model = model_id(args.model)
    t0 = time.perf_counter()
    loaded = load_model(args.model, device=args.device, dtype=realtime_dtype(args.device, args.dtype))
    load_ms = round((time.perf_counter() - t0) * 1000.0, 1)
    decoder = RegionDecoder(loaded)  # an untrained region head: RequestError, exit 2, nothing written yet
    work = VideoLocateRun(args, paths, plans, out, to_stdout, sampling, task, what, decoder, done, resumed,
                          model, load_ms)  # the shared JSONL opened
    started = time.perf_counter()
    try:
        for path, count, _ in paths:
            work.locate_file(path, count)
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: what was written stays whole
        work.interrupted = True
    except BrokenPipeError:  # -o - into a reader that has had enough
        return 0
    except OSError as e:  # a full disk, a folder gone: what was written stays, and the run says so
        work.write_error = e
    finally:
        work.close()
    return _report(work, time.perf_counter() - started, skipped)


def _report(work: VideoLocateRun, seconds: float, skipped: list[str]) -> int:
    """The errors and the summary line on stderr; the exit code."""
    interrupted, write_error, frames = work.interrupted, work.write_error, work.frames
    # Nothing located and nothing to resume from: every file failed. Said as errors, with no
    # "0 frames" summary, and the JSONL this run made goes again.
    failed = frames == 0 and not work.replayed and bool(work.errors) and not interrupted and write_error is None
    for err in work.errors:
        print(f"vlmstream: {'error' if failed else 'warning'}: {err}", file=sys.stderr)
    if failed:
        if work.made and work.jsonl_out.exists() and work.jsonl_out.stat().st_size == 0:
            work.jsonl_out.unlink()
        return 2
    print(f"vlmstream: {frames} frames, {work.found_total} {work.key} found ({work.what}), {len(work.paths)} file(s)"
          + (f", {work.replayed} done before (resume)" if work.resume else "")
          + (f", {len(skipped)} unreadable skipped" if skipped else "")
          + (f", {work.changes.count} changes" if work.changes is not None else "")
          + f", {frames / seconds if seconds else 0.0:.2f} frames/s" + (" (interrupted)" if interrupted else ""),
          file=sys.stderr)
    if write_error is not None:
        print(f"vlmstream: error: cannot write {write_error.filename or 'the output'}: "
              f"{write_error.strerror or write_error}", file=sys.stderr)
        return 1
    if interrupted:
        return 130
    return 1 if work.incomplete or skipped else 0
