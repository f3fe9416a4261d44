"""`vlmstream video`: caption (or ask about) the frames of video files, or of the videos in folders.

See `vlmstream video --help` and the README. Every argument is checked, and every input file
probed, before the model loads (app/video_args.py: a mistake is one line, exit 2);
--detect/--point take a path of their own (app/video_locate.py). Captions: up to CONCURRENT_FILES
files side by side on one engine (app/video_run.py), into one JSONL (-o OUT.jsonl, -o -), a
subtitle file, each video's outputs in a folder (-o FOLDER/ --format), annotated MP4s
(--annotate), or terminal lines; --resume skips the frames already in the JSONL and rebuilds the
other outputs from it. The errors (warnings when some work was done) and one summary line go to
stderr. Exit 0; 1 when some of the work is missing (a file unreadable, cut off, an output
unwritable); 2 when every file failed (the JSONL this run made goes again); 130 when Ctrl-C
stopped it (143 for SIGTERM: app/launcher.py); 0 when the reader of -o - closed it.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time

from app.cli import realtime_dtype, reading_arg
from app.outputs import read_resumed
from app.parser import MAX_TOKENS_FRAMES
from app.prompt_args import check_constraints, or_default
from app.video_args import VideoArgs, check_args
from app.video_run import CONCURRENT_FILES, VideoRun

__all__ = ["CONCURRENT_FILES", "run"]

# A model load longer than this is said: Moondream 2 from a cold disk took 22-30 s on two cores,
# with nothing on the terminal until the progress bar came (the tiny model: well under a second).
LOAD_NOTICE_S = 5.0


def run(args: argparse.Namespace) -> int:
    from engine.types import SamplingParams
    from pipelines.batch import Sampling, merge

    c = check_args(args)
    if c.region:  # places, through the region head: a path of its own (app/video_locate.py)
        from app import video_locate

        return video_locate.run(args, c.paths, c.plans, c.out, c.to_stdout,
                                Sampling(fps=args.fps, every_n=args.every_n), c.skipped, *c.region)
    params = SamplingParams(max_tokens=or_default(args.max_tokens, MAX_TOKENS_FRAMES), sticky=c.sticky)
    sampling = Sampling(fps=args.fps, every_n=args.every_n)
    reading = reading_arg(args)
    done, resumed = _resumed(args, c)
    work = VideoRun(args, c, params, sampling, reading, done, resumed)

    from engine import Engine, EngineConfig  # torch: after every argument is checked

    loading = threading.Timer(LOAD_NOTICE_S, _say, [f"loading the model ({args.model})"])
    loading.daemon = True
    loading.start()
    try:
        engine = Engine(EngineConfig(model=args.model, device=args.device,
                                     dtype=realtime_dtype(args.device, args.dtype),
                                     vision_thread=False if args.no_vision_thread else None))
    finally:
        loading.cancel()
    with engine:
        check_constraints(engine, c.tasks)  # before any output is touched
        made = c.out is not None and c.kind == "jsonl" and not c.out.exists()  # removed again if the run gives nothing
        work.open_shared()
        t0 = time.perf_counter()
        summaries = work.caption(engine)
        wall_s = time.perf_counter() - t0
    work.close()
    summary = merge(summaries)
    summary.seconds = wall_s  # files ran side by side, and more than CONCURRENT_FILES one after another
    return _report(args, c, work, summary, made)


def _resumed(args: argparse.Namespace, c: VideoArgs) -> tuple[dict, dict]:
    """With --resume, the answers already written: those of the shared JSONL, and each file's own."""
    from pipelines.sinks import done_frames

    def warn(message: str) -> None:
        print(f"vlmstream: warning: {message}", file=sys.stderr)

    return read_resumed(lambda p: done_frames(p, c.one_prompt, warn), lambda r: r.model,
                        c.out if c.kind == "jsonl" else None, c.plans, args.model,
                        "answers") if args.resume else ({}, {})


def _say(message: str) -> None:
    try:  # a closed stderr (2>&-) is given up, as elsewhere
        print(f"vlmstream: {message}", file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass


def _report(args: argparse.Namespace, c: VideoArgs, work: VideoRun, summary, made: bool) -> int:
    """The errors and the summary line on stderr; the exit code."""
    interrupted = work.interrupted
    # Nothing answered and nothing to resume from: every file failed (unreadable, no frame). Said
    # as errors, with no "0 frames captioned" summary, and the JSONL this run made goes again.
    failed = (bool(summary.errors) and summary.frames_captioned == 0 and not summary.frames_skipped
              and not interrupted and not work.write_failed.is_set() and not work.pipe_closed.is_set())
    for err in summary.errors:
        print(f"vlmstream: {'error' if failed else 'warning'}: {err}", file=sys.stderr)
    if failed:
        if made and c.out.exists() and c.out.stat().st_size == 0:
            c.out.unlink()
        return 2
    speed = summary.video_seconds / summary.seconds if summary.seconds else 0.0
    n = summary.frames_captioned
    print(f"vlmstream: {n} frame{'' if n == 1 else 's'} captioned, {summary.frames_skipped} skipped (resume), "
          f"{summary.files} file(s)" + (f", {len(c.skipped)} unreadable skipped" if c.skipped else "")
          + (f", {sum(t.count for t in work.trackers)} changes" if args.changes else "")
          + f", {speed_text(speed)}x real time" + pace_text(summary.seconds, summary.frames_captioned)
          + (f", outputs in {c.out_dir}" if c.out_dir else "")
          + (" (interrupted)" if interrupted else ""),
          file=sys.stderr)
    if work.pipe_closed.is_set():
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no flush error at exit
        return 0
    if interrupted:
        return 130
    if work.write_failed.is_set():
        return 1
    # Some of the work is missing (a file unreadable, cut off, or its outputs unwritable), the
    # rest is whole: 1, so that a script (`vlmstream video dir/ && upload`) sees it. With 0, a
    # folder with a broken clip looked done. Damaged packets skipped on the way are a warning.
    return 1 if summary.incomplete or c.skipped else 0


SLOW_FRAME_S = 10.0  # frames that took longer than this each have their pace said


def pace_text(seconds: float, frames: int) -> str:
    """For a slow run, the summary's " (a frame every N s)": Moondream 2 on a CPU at --fps 0.2
    said "0.18x real time", which does not tell what a longer video will take at another --fps
    (23 s a frame), as `live` says "an answer every 27 s". Nothing for a run faster than
    SLOW_FRAME_S a frame (the tiny model: 30 frames a second)."""
    if frames <= 0 or seconds / frames < SLOW_FRAME_S:
        return ""
    return f" (a frame every {seconds / frames:.0f} s)"


def speed_text(speed: float) -> str:
    """The summary's "x real time": below 1, to two significant figures (Moondream 2 on a CPU
    at --fps 0.5 ran at 0.066x, said "0.1x"; 0.04 would have been "0.0x"), never an exponent."""
    import math

    if not 0 < speed < 1:
        return f"{speed:.1f}"
    return f"{speed:.{min(6, 1 - math.floor(math.log10(speed)))}f}"
