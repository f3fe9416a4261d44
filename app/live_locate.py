"""`vlmstream live SOURCE --detect OBJECT` / `--point OBJECT`: where an object is in live video.

The region decoder (engine/region_decoder.py) takes the newest frame of every source at once, in
one batch (pipelines/locator.py): its pace is the frame rate, frames that come while it works are
passed over and counted. Each located frame is a terminal line (time, latency, places in pixels) or,
with -o, a JSON line (places as fractions and in pixels, the UTC time, the timings with the
end-to-end latency); `--annotate` records the frames with their boxes or points drawn. With
`--changes`, a frame is reported only when the number found differs from the source's last report
(an object came or went; held `--hold` frames), and `--snapshots` keeps its picture. A source
that breaks off is reconnected as for captions. The embedded tiny model's region head was never
trained: asking it is exit 2 before anything is written.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

from app.cli import UsageError
from app.console import StandardOutputError
from app.launcher import stop_requested
from app.prompt_args import region_task


def check_args(args: argparse.Namespace) -> tuple[str, str]:
    """(task, object); what does not go with a region task is a UsageError."""
    task, what = region_task(args)
    for flag, given in (("--sticky", args.sticky is not None),
                        ("--max-inflight", args.max_inflight is not None),
                        ("--deadline-ms", args.deadline_ms is not None), ("--no-draft", args.no_draft)):
        if given:
            raise UsageError(f"{flag} goes with captions and questions, not --{task} (its frames are located "
                             "one at a time, the newest first)")
    return task, what


def run(args: argparse.Namespace, opened: list, labels: list[str], recordings: list[Path] | None,
        task: str, what: str) -> int:
    from engine.models.loader import load_model, model_id
    from engine.region_decoder import RegionDecoder
    from pipelines.changes import AnswerChanges
    from pipelines.locator import LiveLocator, LocateSource, count_change, places_text
    from pipelines.recorder import Recorder
    from pipelines.sinks import json_text
    from pipelines.sources import SourceError

    from app.cli import realtime_dtype
    from app.live import _log_name, _p50, _snapshot, no_frames_line, open_log, start_clock, warm_frame

    loaded = load_model(args.model, device=args.device, dtype=realtime_dtype(args.device, args.dtype))
    decoder = RegionDecoder(loaded)  # an untrained region head: RequestError, exit 2, nothing written yet
    warm = warm_frame(opened, labels)  # before the log: a file with no frame leaves no empty one
    log = open_log(args.output)
    several = len(opened) > 1
    lock = threading.Lock()
    write_error: list[tuple[str, OSError]] = []
    recorders = {label: Recorder(path) for label, path in zip(labels, recordings or [])}
    changes = {label: AnswerChanges(args.hold or 1) for label in labels} if args.changes else None
    snapshots = Path(args.snapshots) if args.snapshots else None
    model = model_id(args.model)

    def show(r) -> None:  # the locator's thread, once per located frame
        if r.label in recorders:
            recorders[r.label].add(r.drawn())
        with lock:
            if write_error:
                return
            change = None if changes is None else count_change(changes[r.label], r.label, len(r.places), r.frame.pts, r)
            if changes is not None and change is None:
                return  # as many found as at the last report
            first = (change.pop("kept") if change else None) or r  # where the new count began (--hold N: N-1 back)
            try:
                if snapshots is not None:
                    try:
                        change["snapshot"] = str(_snapshot(snapshots, r.label if several else "", first.drawn().frame))
                    except OSError as e:
                        write_error.append((f"a snapshot in {snapshots}", e))
                        return
                if log is not None:
                    log.write(json_text({**r.records()[0], **(change or {}), "model": model}) + "\n")
                    log.flush()
                if not args.json and log is not sys.stdout:
                    was = "" if not change or change["previous"] is None else f"  (was {change['previous']} found)"
                    print(f"{r.label + '  ' if several else ''}{r.frame.pts:9.3f}  {r.end_to_end_ms:6.1f} ms  "
                          f"{what}: {places_text(r.pixels, task)}{was}", flush=True)
            except OSError as e:  # a full disk, a closed pipe: the run stops and says so
                on_stdout = isinstance(e, (BrokenPipeError, StandardOutputError))
                write_error.append(("standard output" if on_stdout else _log_name(args.output), e))

    def say(line: str) -> None:
        with lock:
            print(f"vlmstream: warning: {line}", file=sys.stderr, flush=True)

    decoder.locate(warm, what, task)  # warm-up: one-time costs a live stream should not see
    for live, label in zip(opened, labels):
        if live.connection is not None:
            live.connection.on_event = lambda line, label=label: say(f"{label + ': ' if several else ''}{line}")
    t0 = start_clock(opened, args.duration)
    sources = [LocateSource(label, live.frames, realtime=live.paced, loop=args.duration is not None and live.loops,
                            connection=live.connection) for live, label in zip(opened, labels)]
    locator = LiveLocator(lambda rgb: decoder.locate(rgb, what, task), sources, what, task, fps=args.fps,
                          on_result=show, locate_many=lambda rgbs: decoder.locate_batch(rgbs, what, task))
    interrupted = False
    try:
        while (locator.running and not write_error and not any(rec.error for rec in recorders.values())
               and (args.duration is None or time.perf_counter() - t0 < args.duration)):
            time.sleep(0.05)
            if stop_requested():  # a SIGTERM whose KeyboardInterrupt was lost (in a finalizer)
                raise KeyboardInterrupt
    except KeyboardInterrupt:
        interrupted = True
    finally:
        # the run ended because its sources did (before --duration): on an error, it failed
        # As live's: a source that had sent frames and failed for good fails the run, others or not
        failed = [label for label, e in locator.exceptions().items() if isinstance(e, SourceError)]
        read = {label: st["frames_in"] for label, st in locator.stats().items()}
        gave_up = bool(failed) and (not locator.running or any(read.get(label) for label in failed))
        locator.close()
        for rec in recorders.values():
            rec.close()
        if log is not None and log is not sys.stdout:
            try:
                log.close()
            except OSError as e:  # its last flush: said already if a write had failed
                if not write_error:
                    write_error.append((_log_name(args.output), e))
    locator.check()  # the decoder failed: its error, as any other
    stats = locator.stats()
    failed = locator.exceptions()
    if failed and len(failed) == len(labels) and not any(s["frames_in"] for s in stats.values()):
        raise next(iter(failed.values()))  # nothing was ever read: a plain error
    for label, error in locator.errors().items():
        print(f"vlmstream: warning: {label + ': ' if several else ''}{error}", file=sys.stderr)
    for problem in (p for live in opened for p in live.problems):  # a file's, which names it
        print(f"vlmstream: warning: {problem}", file=sys.stderr)
    for label, rec in recorders.items():
        stats[label]["recording"] = {"path": str(rec.path), "frames": rec.written, "skipped": rec.skipped}
        if rec.error is not None and not write_error:
            write_error.append((str(rec.path), rec.error))
    if write_error:
        what_failed, e = write_error[0]
        if isinstance(e, BrokenPipeError):  # piped into `head`: stop quietly
            import os

            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 0
        print(f"vlmstream: error: cannot write {what_failed}: {getattr(e, 'strerror', None) or e}", file=sys.stderr)
        return 1
    summary = stats[labels[0]] if not several else {
        "frames_in": sum(s["frames_in"] for s in stats.values()),
        "completed": sum(s["completed"] for s in stats.values()),
        "achieved_fps": sum(s["achieved_fps"] for s in stats.values()), "sources": stats}
    if changes is not None:  # reports of a new number found, per source
        for label, s in stats.items():
            s["changes"] = changes[label].count
        if several:
            summary["changes"] = sum(c.count for c in changes.values())
    summary.update({task: what, "model": args.model})
    if args.json:
        print(json.dumps(summary))
    else:
        for label, s in stats.items():
            print(f"vlmstream: {label + ': ' if several else ''}{s['completed']} of {s['frames_in']} frames located, "
                  f"{s['achieved_fps']:.1f} fps, {s['overwritten']} passed over" + _p50(s)
                  + (f", {s['changes']} changes" if "changes" in s else ""), file=sys.stderr)
    if interrupted:
        return 130
    if not any(s["frames_in"] for s in stats.values()):  # a dead camera must not look like a quiet one
        print(no_frames_line(opened, several, args.duration), file=sys.stderr)
        return 1
    if gave_up:
        return 1  # a camera gone for good (--max-outage) must not end a supervised run as a success
    return 0
