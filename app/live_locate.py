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

app/live.py opens the sources and calls `check_args` (before torch loads), then `run`; the run's
outputs and the state they share are app/live_locate_run.py's. The run ends when its sources do, at
--duration, when a write fails, or on Ctrl-C or SIGTERM; its figures follow (--json: one JSON
object on standard output, else a line per source on standard error). Exit 0; 1 where a write
failed (a closed pipe, as into `head`: 0, quietly), a source sent no frame, or one that had sent
frames failed for good (--max-outage); 130 when interrupted (143 for a SIGTERM: app/cli.py). The
decoder's error, or a run in which no source could be read, is raised.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from app.cli import UsageError
from app.launcher import stop_requested
from app.prompt_args import region_task

if TYPE_CHECKING:
    from engine.region_decoder import RegionDecoder
    from pipelines.locator import LiveLocator

    from app.live_locate_run import LiveLocateRun


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
    """The run of app/live.py's opened sources (`labels` name them) once its arguments are checked
    (`check_args`); its exit code."""
    from engine.models.loader import load_model, model_id
    from engine.region_decoder import RegionDecoder

    from app.cli import realtime_dtype
    from app.live import no_frames_line, start_clock, warm_frame
    from app.live_files import open_log
    from app.live_locate_run import LiveLocateRun

    loaded = load_model(args.model, device=args.device, dtype=realtime_dtype(args.device, args.dtype))
    decoder = RegionDecoder(loaded)  # an untrained region head: RequestError, exit 2, nothing written yet
    warm = warm_frame(opened, labels)  # before the log: a file with no frame leaves no empty one
    log = open_log(args.output)
    locate_run = LiveLocateRun(args, labels, log, recordings, task, what, model_id(args.model))  # recordings begin
    decoder.locate(warm, what, task)  # warm-up: one-time costs a live stream should not see
    locate_run.start(opened)
    t0 = start_clock(opened, args.duration)
    locator = _locator(args, decoder, opened, locate_run)
    interrupted, gave_up = _watch(args, locator, locate_run, t0)
    stats = locate_run.sources_ended(locator, opened)
    failed = locate_run.write_failed()
    if failed is not None:
        return failed
    locate_run.report(stats)
    if interrupted:
        return 130
    if not any(s["frames_in"] for s in stats.values()):  # a dead camera must not look like a quiet one
        print(no_frames_line(opened, locate_run.several, args.duration), file=sys.stderr)
        return 1
    if gave_up or not all(s["frames_in"] for s in stats.values()):
        return 1  # a camera gone for good (--max-outage), or one that never sent a frame: as live's
    return 0


def _locator(args: argparse.Namespace, decoder: RegionDecoder, opened: list, locate_run: LiveLocateRun) -> LiveLocator:
    """The locator of every source's newest frame, in one batch, each located frame shown by
    locate_run (it starts at once)."""
    from pipelines.locator import LiveLocator, LocateSource

    what, task = locate_run.what, locate_run.task
    sources = [LocateSource(label, live.frames, realtime=live.paced, loop=args.duration is not None and live.loops,
                            connection=live.connection) for live, label in zip(opened, locate_run.labels)]
    return LiveLocator(lambda rgb: decoder.locate(rgb, what, task), sources, what, task, fps=args.fps,
                       on_result=locate_run.show, locate_many=lambda rgbs: decoder.locate_batch(rgbs, what, task))


def _watch(args: argparse.Namespace, locator: LiveLocator, locate_run: LiveLocateRun, t0: float) -> tuple[bool, bool]:
    """The locator's loop, until its sources end, --duration is up, a write fails, or a Ctrl-C or
    SIGTERM comes; then the run's outputs closed (locate_run.close). (interrupted, gave up: a
    source failed for good)."""
    interrupted = False
    try:
        while (locator.running and not locate_run.stopped
               and (args.duration is None or time.perf_counter() - t0 < args.duration)):
            time.sleep(0.05)
            locate_run.say_failed(locator)
            if stop_requested():  # a SIGTERM whose KeyboardInterrupt was lost (in a finalizer)
                raise KeyboardInterrupt
    except KeyboardInterrupt:
        interrupted = True
    finally:
        gave_up = locate_run.close(locator)
    return interrupted, gave_up
