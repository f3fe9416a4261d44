"""`vlmstream live`: see `vlmstream live --help` and the README."""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

from app.cli import UsageError, check_changes_args, reading_arg, realtime_dtype, sticky_arg
from app.launcher import stop_requested
from app.prompt_args import check_constraints, prompt_tasks
from app.outputs import check_not_inputs, check_writable, folder_arg

WAIT_NOTICE_S = 2.0  # at the end of a run, a wait for the frames in flight is said after this long


def run(args: argparse.Namespace) -> int:
    from engine.types import SamplingParams
    from pipelines.changes import AnswerChanges
    from pipelines.feed import LiveFeed
    from pipelines.prompts import prompt_label
    from pipelines.live import DEFAULT_MAX_INFLIGHT
    from pipelines.recorder import Recorder
    from pipelines.sources import SourceError, open_live, redact

    inf = float("inf")
    if (not 0 < args.fps < inf or args.max_inflight is not None and args.max_inflight < 1  # NaN fails too
            or args.duration is not None and not 0 < args.duration < inf
            or args.max_outage is not None and not 0 < args.max_outage < inf
            or args.deadline_ms is not None and not 0 < args.deadline_ms < inf):
        raise UsageError("--fps, --duration, --max-outage and --deadline-ms must be finite numbers > 0, "
                         "--max-inflight >= 1")
    sticky = sticky_arg(args)
    check_changes_args(args)
    snapshots = Path(args.snapshots) if args.snapshots else None
    if snapshots:
        check_writable([snapshots], [])
    tasks = prompt_tasks(args)
    # a file however its path is spelt (`clip.mp4`, `./clip.mp4`): it was watched twice over
    if len({os.path.realpath(s) if os.path.isfile(s) else s for s in args.sources}) != len(args.sources):
        raise UsageError("a source is listed twice")
    if args.output == "-" and args.json:
        raise UsageError("--json and -o - would both write to standard output")
    if args.output not in (None, "-") and not args.output.lower().endswith(".jsonl"):
        # `-o log.srt` wrote JSON lines into what its name called a subtitle file
        raise UsageError("-o must end in .jsonl (one JSON line per frame), or be - for standard output")
    region = None
    if args.detect is not None or args.point is not None:
        from app.live_locate import check_args

        region = check_args(args)
    # Every mistake fails here, before torch loads (~3 s): a missing file or camera is said at once.
    # Opening connects to no stream (StreamSource connects when its frames are first asked).
    reading = reading_arg(args)
    opened = [open_live(source, max_outage=args.max_outage, reading=reading) for source in args.sources]
    labels = [redact(source) for source in args.sources]
    if len(set(labels)) != len(labels):  # URLs that differ only in their credentials
        labels = [f"{label} ({i + 1})" for i, label in enumerate(labels)]
    recordings = _recording_paths(args.annotate, args.sources, labels)
    check_not_inputs([*([Path(args.output)] if args.output not in (None, "-") else []), *(recordings or [])],
                     args.sources)
    if region is not None:
        from app.live_locate import run as run_locate

        return run_locate(args, opened, labels, recordings, *region)
    from engine import Engine, EngineConfig
    from engine.models.loader import model_id
    from pipelines.sinks import json_text

    warm = warm_frame(opened, labels)  # before the log: a file with no frame leaves no empty one
    log = open_log(args.output)
    # The engine's total in flight is what sets latency: four sources of four frames each made the
    # frames a second one frame each did, at 3-4x the latency (BENCHMARKS.md).
    inflight = args.max_inflight or max(1, DEFAULT_MAX_INFLIGHT // len(opened))
    several = len(opened) > 1
    params = SamplingParams(max_tokens=args.max_tokens, sticky=sticky)
    model = model_id(args.model)
    write_error: list[tuple[str, OSError]] = []  # (what, error): the run stops
    print_lock = threading.Lock()

    # --changes: each source's answers are followed, and only the new ones reported
    names = dict(zip(labels, file_names(args.sources, labels)))  # the snapshots' names for the sources
    changes = {label: AnswerChanges(args.hold or 1) for label in labels} if args.changes else None

    recorders: dict = {}  # label -> Recorder, with --annotate (started once the model is up)

    def say(line: str) -> None:
        with print_lock:
            print(f"vlmstream: warning: {line}", file=sys.stderr, flush=True)

    def close_feeds(feeds: list, cancel: bool) -> bool:
        """Stop the feeds, then their frames in flight finish, reported and recorded (with cancel,
        a Ctrl-C, they are cancelled); the run's figures and recordings are taken after. A slow
        model's frames take a while: said after 2 s, and a Ctrl-C meanwhile cancels them. The
        wait had ended after 30 s (Moondream 2 on a CPU: 25-70 s a frame) with a false warning,
        a summary short of the frames still to come, and recordings closed before them. True if
        a Ctrl-C came meanwhile."""
        waiting = sum(f.session.in_flight for f in feeds)

        def notice() -> None:
            with print_lock:
                print(f"vlmstream: waiting for the {waiting} frame{'s' * (waiting != 1)} in flight "
                      "(Ctrl-C cancels them)", file=sys.stderr, flush=True)

        timer = threading.Timer(WAIT_NOTICE_S, notice)
        timer.daemon = True
        if waiting and not cancel:
            timer.start()
        try:
            if cancel:
                for feed in feeds:
                    feed.close(cancel=True, timeout=30.0)
            else:
                _wait_closed(feeds)
            return False
        except KeyboardInterrupt:
            for feed in feeds:
                feed.close(cancel=True, timeout=30.0)
            return True
        finally:
            timer.cancel()

    def show(label: str, r) -> None:
        if label in recorders:
            recorders[label].add(r)  # every completed frame, whether its answers changed or not
        with print_lock:  # several feeds' threads report here
            new, shots = None, []  # with --changes: the answers that changed, the snapshot of each
            if changes is None:
                lines = r.text.splitlines() or [""]  # one line per prompt
            else:
                new = changes[label].update(r)
                if not new:
                    return
                if snapshots is not None and not write_error:
                    try:  # the frame each answer began on (--hold N: N-1 frames back), once a frame
                        saved: dict = {}
                        for c in new:
                            first = c.since_kept or r.frame
                            if first.index not in saved:
                                saved[first.index] = str(_snapshot(snapshots, names[label] if several else "", first))
                            shots.append(saved[first.index])
                    except OSError as e:  # a run that cannot keep its pictures stops and says so (the
                        write_error.append((f"a snapshot in {snapshots}", e))  # change is still logged)
                lines = [(f"{prompt_label(r.prompts[c.prompt])}: " if len(r.prompts) > 1 else "") + c.text
                         + ("" if c.previous is None else f"  (was: {c.previous})") for c in new]
            if log is not None and not any(what == args.output for what, _ in write_error):
                records = r.records() if new is None else AnswerChanges.records(r, new)
                for x in records:
                    x["model"] = model  # as in video's lines: a log restarted with another model tells them apart
                if snapshots is not None:
                    for i, x in enumerate(records):
                        x["snapshot"] = shots[i] if i < len(shots) else None
                try:
                    log.write("".join(json_text(x) + "\n" for x in records))
                    log.flush()
                except OSError as e:  # disk full, a closed pipe: the run stops and says so
                    write_error.append((_log_name(args.output), e))
            if not args.json and log is not sys.stdout and not write_error:
                prefix = f"{label}  " if several else ""
                try:
                    for line in lines:
                        print(f"{prefix}{r.frame.pts:9.3f}  {r.end_to_end_ms:6.1f} ms  {line}", flush=True)
                except OSError as e:  # `head` closed the pipe, or the disk under a redirect is full: stop
                    write_error.append(("standard output", e))

    interrupted = False
    config = EngineConfig(model=args.model, device=args.device, dtype=realtime_dtype(args.device, args.dtype),
                          max_batch_size=max(4, inflight * len(opened) * len(tasks)),
                          max_draft=0 if args.no_draft else EngineConfig.max_draft,
                          vision_thread=False if args.no_vision_thread else None)
    with Engine(config) as engine:
        check_constraints(engine, tasks)  # before any frame is asked
        # warm-up: the first step pays one-time costs a live stream should not see
        engine.submit(warm, params=params, **tasks[0]).result(timeout=120)
        recorders.update((label, Recorder(path)) for label, path in zip(labels, recordings or []))
        for live, label in zip(opened, labels):
            if live.connection is not None:  # an outage is said when it happens, not only in the closing figures
                live.connection.on_event = lambda line, label=label: say(f"{label + ': ' if several else ''}{line}")
        t0 = start_clock(opened, args.duration)
        # One engine for every source: their frames share its batches (continuous batching).
        feeds = [LiveFeed(engine, tasks, params, live.frames, realtime=live.paced,
                          loop=args.duration is not None and live.loops, fps=args.fps,
                          max_inflight=inflight, deadline_ms=args.deadline_ms,
                          record_size=0, shots=0,  # the page's keepsakes: -o and --snapshots write them here
                          on_result=lambda r, label=label: show(label, r),
                          connection=live.connection)
                 for live, label in zip(opened, labels)]
        try:
            while (any(f.running for f in feeds) and not write_error
                   and not any(rec.error for rec in recorders.values())
                   and (args.duration is None or time.perf_counter() - t0 < args.duration)):
                time.sleep(0.05)
                if stop_requested():  # a SIGTERM whose KeyboardInterrupt was lost (in a finalizer)
                    raise KeyboardInterrupt
        except KeyboardInterrupt:
            interrupted = True
        finally:
            # The run ended because its sources did (before --duration) on an error, or a source
            # that had sent frames failed for good (--max-outage) while others went on: it failed.
            # (With a second source beside it, a camera gone for good ended the run with 0.)
            gave_up = (not any(f.running for f in feeds) and any(isinstance(f.exception, SourceError) for f in feeds)
                       or any(isinstance(f.exception, SourceError) and f.session.frames_in for f in feeds))
            interrupted = close_feeds(feeds, cancel=interrupted) or interrupted
        never_read = [f for f in feeds if isinstance(f.exception, SourceError) and not f.session.frames_in]
        if never_read and len(never_read) == len(feeds) and not interrupted:  # Ctrl-C: the summary, 130
            raise never_read[0].exception  # nothing was ever read: a plain error
        some_came = any(f.session.frames_in for f in feeds)
        for feed, label, live in zip(feeds, labels, opened):
            # a stream that broke off, or never came beside others that did (when none came, the
            # closing error says so, once), with why it had not where it said (Connection refused)
            why = live.connection.why_nothing() if live.connection else None
            problem = feed.error or (None if feed.session.frames_in or not some_came
                                     else "no frames received" + (f" ({why})" if why else ""))
            if problem:
                print(f"vlmstream: warning: {label + ': ' if several else ''}{problem}", file=sys.stderr)
            for problem in live.problems:  # a file's, which names it
                print(f"vlmstream: warning: {problem}", file=sys.stderr)
        per_source = [f.snapshot().counters for f in feeds]
        for live, s, label in zip(opened, per_source, labels):
            st = live.stream  # how the network (or the pipe) held up: s["stream"], from the feed
            if st is not None and st.catch_ups:
                print(f"vlmstream: warning: {label + ': ' if several else ''}decoding fell behind the stream "
                      f"({st.max_late:.1f} s at most) and skipped ahead to its newest keyframe {st.catch_ups} "
                      "times: a lower resolution or frame rate (a camera's substream) would keep up",
                      file=sys.stderr)
        for label, s in zip(labels, per_source):
            if label in recorders:  # after the feeds: their last frames are in
                rec = recorders[label]
                rec.close()
                # no path where nothing was recorded: no file was made (a stream that sent no keyframe)
                s["recording"] = {"path": str(rec.path) if rec.path.exists() else None, "frames": rec.written,
                                  "skipped": rec.skipped}
                if rec.error is not None and not write_error:
                    write_error.append((str(rec.path), rec.error))
    if log is not None and log is not sys.stdout:
        try:
            log.close()
        except OSError as e:  # its last flush: said already if a write had failed
            if not write_error:
                write_error.append((_log_name(args.output), e))
    if write_error:
        if isinstance(write_error[0][1], BrokenPipeError):  # e.g. piped into `head`: stop quietly
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no flush error at exit
            return 0
        what, e = write_error[0]
        print(f"vlmstream: error: cannot write {what}: {getattr(e, 'strerror', None) or e}", file=sys.stderr)
        return 1
    stats = per_source[0] if not several else {
        **{k: sum(s[k] for s in per_source) for k in _SUMMED},
        "sources": dict(zip(labels, per_source))}
    if changes is not None:  # answers reported as changed, per source
        for s, label in zip(per_source, labels):
            s["changes"] = changes[label].count
        stats["changes"] = sum(c.count for c in changes.values())
    es = engine.stats()
    stats["kv_pages_in_use_after"] = es.kv_pages_in_use
    stats["draft_tokens"] = {"proposed": es.draft_proposed, "accepted": es.draft_accepted}
    stats["sticky"] = sticky
    if args.json:
        print(json.dumps(stats))
    else:
        for label, s in zip(labels, per_source):
            print(f"vlmstream: {label + ': ' if several else ''}{s['completed']} of {s['frames_in']} frames captioned, "
                  f"{s['achieved_fps']:.1f} fps, {s['cancelled_stale']} stale cancelled, "
                  + (f"{s['cancelled_deadline']} past the deadline, " if args.deadline_ms else "")
                  + f"{s['dropped']} dropped" + _p50(s), file=sys.stderr)
    if interrupted:
        return 130
    if not any(s["frames_in"] for s in per_source):  # a dead camera must not look like a quiet one
        print(no_frames_line(opened, several, args.duration), file=sys.stderr)
        return 1
    if gave_up:  # a camera gone for good (--max-outage) must not end a supervised run as a success
        return 1
    return 0


# With several sources, the JSON's totals (each source's own figures, percentiles included, are
# under "sources").
_SUMMED = ("frames_in", "submitted", "completed", "cancelled_stale", "cancelled_deadline", "cancelled_closed",
           "dropped", "achieved_fps")


def _wait_closed(feeds: list) -> None:
    """Close the feeds letting their frames in flight finish, as long as they take, on a thread of
    its own: the main thread polls for a SIGTERM whose KeyboardInterrupt was lost (raised inside a
    finalizer, which Python ignores) and raises it, which cancels those frames, where a wait
    without end would have left the run going after its `kill`."""
    failed: list[BaseException] = []
    stop = threading.Event()  # the main thread cancels: the feeds left are its to close

    def close_all() -> None:
        try:
            for feed in feeds:
                if stop.is_set():
                    return
                feed.close(cancel=False, timeout=None)
        except BaseException as e:  # reaches the caller
            failed.append(e)

    closer = threading.Thread(target=close_all, name="vlmstream-close", daemon=True)
    closer.start()
    try:
        while closer.is_alive():
            closer.join(0.05)
            if stop_requested():
                raise KeyboardInterrupt
    except BaseException:
        stop.set()
        raise
    if failed:
        raise failed[0]


def _snapshot(folder: Path, source: str, frame) -> Path:
    """The frame of a change as a JPEG named by the UTC time it was saved (names sort in time
    order), the source's `file_names` name (with several) and the frame's index."""
    from datetime import datetime, timezone

    from PIL import Image

    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S.%f")[:-3] + "Z"
    path = folder / f"{stamp}{'_' + source if source else ''}_{frame.index}.jpg"
    Image.fromarray(frame.rgb).save(path, quality=90)
    return path


def file_names(sources: list[str], labels: list[str]) -> list[str]:
    """Each source as its recordings and snapshots name it: a file's name without its folder and
    suffix, a stream's address without credentials, made unique. Snapshots had carried a file's
    whole path (_work_clips_door.mp4) where its recording said door."""
    from pipelines.sinks import file_label

    names = [file_label(Path(source).stem if Path(source).is_file() else label) or "source"
             for source, label in zip(sources, labels)]
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


def _recording_paths(annotate: str | None, sources: list[str], labels: list[str]) -> list[Path] | None:
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
    return [folder / f"{stamp}_{name}.mp4" for name in file_names(sources, labels)]


def _p50(s: dict) -> str:
    """The closing line's median latency; none where no frame completed (it said "p50 0.0 ms")."""
    p50 = s["latency_ms"].get("end_to_end", {}).get("p50")
    return "" if p50 is None else f", p50 {p50:.1f} ms"


def start_clock(opened: list, duration: float | None) -> float:
    """The run's start; with --duration, no try to open a stream outlasts the run (Connection.ends_at)."""
    t0 = time.perf_counter()
    for live in opened:
        if live.connection is not None and duration is not None:
            live.connection.ends_at = t0 + duration
    return t0


def warm_frame(opened: list, labels: list[str]):
    """What the first step (which pays one-time costs a live stream should not see) is asked
    about: a file's first frame (a stream's would cost another connection), or a black one. Taken
    before any output is opened: a recording cut off after its header is a SourceError, and left an
    empty log behind."""
    import numpy as np

    from pipelines.sources import SourceError

    first = opened[0]
    frame = next(first.frames(), None) if first.paced else None
    if first.paced and frame is None and len(opened) == 1:
        raise SourceError(f"{labels[0]}: no frame could be decoded")
    return frame.load().rgb if frame is not None else np.zeros((240, 320, 3), np.uint8)


def no_frames_line(opened: list, several: bool, duration: float | None) -> str:
    """The closing error of a run in which no source sent a frame, with why the first that was
    still trying had not (it said "no frames received within 3 s" for a refused connection)."""
    why = next((f"{live.connection.display}: {live.connection.why_nothing()}; still trying when the run ended"
                for live in opened if live.connection and live.connection.why_nothing()), "")
    return ("vlmstream: error: no frames received" + (" from any source" if several else "")
            + (f" within {duration:g} s" if duration else "") + (f" ({why})" if why else ""))


def open_log(output: str | None):
    """The per-frame log: None, standard output ('-'), or a file opened for appending (a
    restarted stream continues its log). A path that cannot be written is a UsageError now."""
    if output is None:
        return None
    if output == "-":
        return sys.stdout
    from pipelines.sinks import cut_partial_line

    try:
        cut_partial_line(output)  # a line the last run's end (a kill, a full disk) cut short
        return open(output, "a", encoding="utf-8")
    except OSError as e:
        raise UsageError(f"cannot write {output}: {e.strerror or e}") from None


def _log_name(output: str | None) -> str:
    """The log as an error names it: `-o -` (or no -o: `--json` lines) is standard output."""
    return "standard output" if output in (None, "-") else output

