"""`vlmstream live`: see `vlmstream live --help` and the README.

Each source (a file played in real time, a camera, a stream) is a feed of one engine, their frames
sharing its batches. A mistake in the arguments, or a missing file or camera, is exit 2 before
torch loads. Each completed frame is a terminal line, a JSON line (-o) and a recording's frame
(--annotate); with --changes only the answers that changed, --snapshots keeping their frames (by
app/live_run.py). The run ends when its sources do, at --duration, when a write fails, or on
Ctrl-C or SIGTERM, which cancel its frames in flight (else they finish, and a Ctrl-C meanwhile
cancels them); its figures follow. Exit 0; 1 where a write failed, a source sent no frame, or one
that had sent frames failed for good (--max-outage); 130 when interrupted (143 for a SIGTERM:
app/cli.py). --detect and --point: app/live_locate.py, which shares this file's helpers. The
files a run writes (its log, recordings, snapshots) and their names: app/live_files.py.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from app.cli import UsageError, check_changes_args, reading_arg, realtime_dtype, sticky_arg
from app.launcher import stop_requested
from app.live_files import open_log, recording_paths
from app.parser import MAX_TOKENS_FRAMES
from app.prompt_args import check_constraints, or_default, prompt_tasks
from app.outputs import check_not_busy, check_not_inputs, check_writable, folder_arg

if TYPE_CHECKING:
    from engine import Engine, EngineConfig
    from engine.types import SamplingParams
    from pipelines.feed import LiveFeed

    from app.live_run import LiveRun

WAIT_NOTICE_S = 2.0  # at the end of a run, a wait for the frames in flight is said after this long


def run(args: argparse.Namespace) -> int:
    from engine.types import SamplingParams
    from pipelines.live import DEFAULT_MAX_INFLIGHT, FAST_ANSWER_S, SLOW_ANSWER_S

    _listed(args)
    sticky, snapshots, tasks, region = _checked(args)
    opened, labels, recordings = _opened(args)
    if region is not None:
        from app.live_locate import run as run_locate

        return run_locate(args, opened, labels, recordings, *region)
    from engine.models.loader import model_id

    from app.live_run import LiveRun

    warm = warm_frame(opened, labels)  # before the log: a file with no frame leaves no empty one
    log = open_log(args.output)
    # The engine's total in flight is what sets latency: four sources of four frames each made the
    # frames a second one frame each did, at 3-4x the latency (BENCHMARKS.md).
    inflight = args.max_inflight or max(1, DEFAULT_MAX_INFLIGHT // len(opened))
    params = SamplingParams(max_tokens=or_default(args.max_tokens, MAX_TOKENS_FRAMES), sticky=sticky)
    live_run = LiveRun(args, labels, log, snapshots, model_id(args.model),
                       frozenset(i for i, t in enumerate(tasks) if "constraint" in t))
    with _engine(args, max(4, inflight * len(opened) * len(tasks))) as engine:
        check_constraints(engine, tasks)  # before any frame is asked
        # warm-up: the first step pays one-time costs a live stream should not see
        # As long as the engine makes progress: a fixed 120 s had ended a slow model's run (a 720p
        # frame is 9 crops: Moondream 2 in fp32 on a CPU without bf16 takes minutes) with a traceback.
        began = time.perf_counter()
        engine.submit(warm, params=params, **tasks[0]).wait()
        answer_s = time.perf_counter() - began
        if args.max_inflight is None and answer_s > SLOW_ANSWER_S:
            # "until": a GPU's warm-up pays its compiles, and its first answer alone gives the frames back
            print(f"vlmstream: the warm-up's answer took {answer_s:.1f} s: frames are asked one at a time until "
                  f"an answer takes under {FAST_ANSWER_S:g} s (--max-inflight N keeps N in flight)", file=sys.stderr)
        live_run.start(opened, recordings)
        t0 = start_clock(opened, args.duration)
        feeds = _feeds(args, engine, tasks, params, inflight, opened, live_run, answer_s)
        interrupted, gave_up = _watch(args, feeds, live_run, t0, engine.config.max_batch_size // len(tasks))
        per_source = live_run.sources_ended(feeds, opened, interrupted)
    failed = live_run.close_log()
    if failed is not None:
        return failed
    live_run.report(per_source, engine.stats(), sticky)
    if interrupted:
        return 130
    if not any(s["frames_in"] for s in per_source):  # a dead camera must not look like a quiet one
        print(no_frames_line(opened, live_run.several, args.duration), file=sys.stderr)
        return 1
    # A camera gone for good (--max-outage), or one that never sent a frame while others did, must
    # not end a supervised run as a success (as `video` exits 1 when one of its files failed).
    if gave_up or not all(s["frames_in"] for s in per_source):
        return 1
    return 0


def _listed(args: argparse.Namespace) -> None:
    """The sources as given, or chosen by name from --sources (`app.source_list.chosen`);
    `args.source_names` holds each one's name (None for a source given as itself)."""
    from app.source_list import chosen

    args.sources, args.source_names = chosen(args.sources, args.source_file)


def _checked(args: argparse.Namespace) -> tuple[float, Path | None, list[dict], tuple[str, str] | None]:
    """(sticky, the --snapshots folder, the prompts' tasks, --detect/--point's (task, object));
    a mistake is a UsageError."""
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
    keys = [os.path.realpath(s) if os.path.isfile(s) else s for s in args.sources]
    if len(set(keys)) != len(keys):
        # --sources: two names of one camera (`live --sources cams.txt` plays all) were "a source
        # is listed twice", with no word of which: said by their names (never the URL)
        first = next(key for key in keys if keys.count(key) > 1)
        twice = [k for k, key in enumerate(keys) if key == first]
        names = [args.source_names[k] for k in twice]
        if any(names):
            from pipelines.sources import redact

            shown = " and ".join(dict.fromkeys(n or redact(args.sources[k]) for k, n in zip(twice, names)))
            raise UsageError(f"a source is listed twice: {shown} are the same source")
        raise UsageError("a source is listed twice")
    if args.output == "-" and args.json:
        raise UsageError("--json and -o - would both write to standard output")
    if args.output not in (None, "-") and not args.output.lower().endswith(".jsonl"):
        # `-o log.srt` wrote JSON lines into what its name called a subtitle file
        raise UsageError("-o must end in .jsonl (one JSON line per frame), or be - for standard output")
    if args.output not in (None, "-"):  # a folder, no such folder, no permission: said before torch loads
        check_writable([], [Path(args.output)])
    region = None
    if args.detect is not None or args.point is not None:
        from app.live_locate import check_args

        region = check_args(args)
    return sticky, snapshots, tasks, region


def _opened(args: argparse.Namespace) -> tuple[list, list[str], list[Path] | None]:
    """(the sources opened, their labels, the --annotate recordings' paths)."""
    from pipelines.sources import redact

    from app.source_list import open_listed

    # Every mistake fails here, before torch loads (~3 s): a missing file or camera is said at once.
    # Opening connects to no stream (StreamSource connects when its frames are first asked).
    reading = reading_arg(args)
    opened = [open_listed(source, name, max_outage=args.max_outage, reading=reading)
              for source, name in zip(args.sources, args.source_names)]
    labels = [name or redact(source) for source, name in zip(args.sources, args.source_names)]
    if len(set(labels)) != len(labels):  # URLs that differ only in their credentials
        labels = [f"{label} ({i + 1})" for i, label in enumerate(labels)]
    recordings = recording_paths(args.annotate, args.sources, labels, args.source_names)
    check_not_inputs([*([Path(args.output)] if args.output not in (None, "-") else []), *(recordings or [])],
                     args.sources)
    # Said now, as a busy log is: the recorder opens its file at the first frame, so a second run
    # into the same --annotate loaded the model and logged and saved snapshots before it failed (exit 1).
    check_not_busy(recordings or [])
    if recordings and folder_arg(args.annotate) is None and recordings[0].is_file() and recordings[0].stat().st_size:
        # A restarted camera job continues its -o log, but started its OUT.mp4 afresh: the earlier
        # run's recording was lost without a word (FOLDER/ names each run's file by its start).
        print(f"vlmstream: warning: {recordings[0]} exists and is replaced by this run's recording "
              "(--annotate FOLDER/ keeps each run's)", file=sys.stderr)
    return opened, labels, recordings


def _engine(args: argparse.Namespace, max_batch_size: int) -> Engine:
    """The run's engine. Its batch is --max-inflight frames of each source and prompt: a KV cache
    too large for memory was said in the engine's terms ("lower max_batch_size or kv_pages",
    which `live` has no flags for); it is said as the flag that set it."""
    from engine import Engine
    from engine.errors import ConfigError

    try:
        return Engine(_config(args, max_batch_size))
    except ConfigError as e:
        if args.max_inflight is None or "max_batch_size" not in str(e):
            raise
        # its max_batch_size (each source's and prompt's frames together) named as what it counts
        said = re.sub(r"max_batch_size=(\d+)", r"\1 frames in flight", str(e).split(";")[0])
        raise UsageError(f"--max-inflight {args.max_inflight}: {said}; lower --max-inflight "
                         f"(frames in flight of each source and prompt)") from None


def _config(args: argparse.Namespace, max_batch_size: int) -> EngineConfig:
    from engine import EngineConfig

    return EngineConfig(model=args.model, device=args.device, dtype=realtime_dtype(args.device, args.dtype),
                        max_batch_size=max_batch_size, max_draft=0 if args.no_draft else EngineConfig.max_draft,
                        vision_thread=False if args.no_vision_thread else None)


def _feeds(args: argparse.Namespace, engine: Engine, tasks: list[dict], params: SamplingParams, inflight: int,
           opened: list, live_run: LiveRun, answer_s: float) -> list[LiveFeed]:
    """A feed per source, each completed frame shown by live_run; answer_s: the warm-up's (an
    explicit --max-inflight is kept however slow answers are)."""
    from pipelines.feed import LiveFeed

    # One engine for every source: their frames share its batches (continuous batching).
    return [LiveFeed(engine, tasks, params, live.frames, realtime=live.paced,
                     loop=args.duration is not None and live.loops, fps=args.fps,
                     max_inflight=inflight, deadline_ms=args.deadline_ms,
                     record_size=0, shots=0,  # the page's keepsakes: -o and --snapshots write them here
                     on_result=lambda r, label=label: live_run.show(label, r),
                     connection=live.connection, adapt=args.max_inflight is None, answer_s=answer_s)
            for live, label in zip(opened, live_run.labels)]


def _watch(args: argparse.Namespace, feeds: list[LiveFeed], live_run: LiveRun, t0: float,
           frames_room: int) -> tuple[bool, bool]:
    """The feeds' loop, until they end, --duration is up, a write fails, or a Ctrl-C or SIGTERM
    comes; then the feeds closed (live_run.close_feeds). (interrupted, gave up: a source failed).
    frames_room: the frames of all sources the engine's batch holds at once."""
    from pipelines.sources import SourceError

    interrupted, running = False, len(feeds)
    try:
        while (any(f.running for f in feeds) and not live_run.stopped
               and (args.duration is None or time.perf_counter() - t0 < args.duration)):
            time.sleep(0.05)
            if args.max_inflight is None and (now := sum(f.running for f in feeds)) < running:
                running = now
                _share_out([f for f in feeds if f.running], frames_room)
            live_run.say_failed(feeds)
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
        live_run.ended_early(feeds)  # before close_feeds stops the others
        interrupted = live_run.close_feeds(feeds, cancel=interrupted) or interrupted
    return interrupted, gave_up


def _share_out(feeds: list[LiveFeed], frames_room: int) -> None:
    """The default frames in flight shared out again among the sources still running, as the web
    UI does when a viewer leaves: a clip that ended (played once) or a camera given up had kept its
    share, and the source left alone ran on 2 of the 4 (frames dropped at intake on a loaded machine).
    Within the engine's batch, which was sized for the first sharing."""
    from pipelines.live import DEFAULT_MAX_INFLIGHT

    if feeds:
        share = max(1, min(DEFAULT_MAX_INFLIGHT // len(feeds), frames_room // len(feeds)))
        for feed in feeds:
            if feed.session is not None:
                feed.session.set_max_inflight(share)


def rate_text(fps: float) -> str:
    """The closing line's frames a second. Below 0.1, with a figure that is not 0 and the time
    between answers: Moondream 2 on a CPU answers every ~27 s, and "0.0 fps" read as nothing done."""
    if fps <= 0 or fps >= 0.1:
        return f"{fps:.1f} fps"
    return f"{fps:.2g} fps (an answer every {1 / fps:.0f} s)"


def p50_text(s: dict) -> str:
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
