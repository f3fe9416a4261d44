"""One video file captioned (or an object located in it) for the web UI: the outputs a user
downloads (JSONL, SRT, WebVTT, annotated MP4), the rows the page shows, and the job's figures.
Errors a user can cause are UIError."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Callable

import numpy as np

from app.errors import UIError
from pipelines.frame import AS_SHOWN, Reading


def run_video_job(engine, params, path: str, task: dict | list[dict], out_dir: Path, every_n: int = 1,
                  on_progress: Callable[[int, int | None], None] | None = None,
                  stop: threading.Event | None = None, changes: bool = False,
                  reading: Reading = AS_SHOWN, name: str | None = None) -> dict:
    """Caption a file into out_dir: captions.jsonl/.srt/.vtt and annotated.mp4; returns the rows
    shown (index, pts, text, ms), the paths and the job's figures. Setting `stop` ends the job at
    its next frame with what is done ("cancelled": True); with `changes`, the rows and the JSONL
    hold only the answers that changed (`video --changes`). `name`: the JSONL's "source" (an
    upload's own name; else the path)."""
    from engine.errors import EngineClosedError
    from pipelines.batch import BatchSummary, Sampling, caption_file
    from pipelines.changes import AnswerChanges, ChangedAnswersSink
    from pipelines.prompts import constrained, prompt_key, prompt_label
    from pipelines.annotated import AnnotatedVideoSink
    from pipelines.sinks import JsonlSink, SubtitleSink, close_all
    from pipelines.sources import FileSource

    out_dir.mkdir(parents=True, exist_ok=True)
    with FileSource(path) as src:  # its stream's fields cannot be read once it is closed (av >= 19)
        total, fps = src.frame_count, src.fps
        first = next(src.frames(), None)
    if first is None:
        raise UIError("the video has no frames")
    duration = every_n / (fps or 30.0)
    paths = {"jsonl": out_dir / "captions.jsonl", "srt": out_dir / "captions.srt",
             "vtt": out_dir / "captions.vtt", "mp4": out_dir / "annotated.mp4"}
    paths["jsonl"].unlink(missing_ok=True)
    jsonl = JsonlSink(paths["jsonl"])
    in_order = constrained(task if isinstance(task, list) else [task])  # --changes keeps their answers' order
    sinks = [ChangedAnswersSink(jsonl, in_order=in_order) if changes else jsonl, SubtitleSink(paths["srt"], "srt", duration),
             SubtitleSink(paths["vtt"], "vtt", duration),
             AnnotatedVideoSink(paths["mp4"], first.rgb.shape[1], first.rgb.shape[0], frame_duration=duration)]
    rows: list[dict] = []
    several = isinstance(task, list)
    tracker = AnswerChanges() if changes else None
    answers = [0]

    def on_frame(r) -> None:
        asked = f"{prompt_label(r.prompt)}: " if several else ""
        answers[0] += 1
        if tracker is None:
            rows.append({"index": r.index, "pts": r.pts, "text": asked + r.text.strip(),
                         "ms": round(r.timings_ms.get("total", 0.0), 1)})
        elif (c := tracker.observe(key := prompt_key(r.prompt), r.text, r.pts, in_order=key in in_order)) is not None:
            was = "" if c.previous is None else f"  (was: {c.previous})"
            rows.append({"index": r.index, "pts": r.pts, "text": asked + c.text + was,
                         "ms": round(r.timings_ms.get("total", 0.0), 1)})
        if on_progress:
            on_progress(answers[0] // (len(task) if several else 1) * every_n, total)

    summary = BatchSummary()
    src = FileSource(path, source_id=name, reading=reading)
    cancelled = False
    try:
        caption_file(engine, src, sinks, task, params, Sampling(every_n=every_n),
                     on_frame=on_frame, summary=summary, stop=stop)
    except KeyboardInterrupt:  # stopped: the outputs keep every frame finished so far
        cancelled = True
    except EngineClosedError:  # Settings loaded another model meanwhile (or the server stops)
        cancelled = True
        summary.errors.append(reloaded(summary.frames_captioned))
    finally:
        src.close()
        close_all(sinks, src.end)
    speed = summary.video_seconds / summary.seconds if summary.seconds else 0.0
    return {"rows": rows, "paths": {k: str(v) for k, v in paths.items()},
            "frames": summary.frames_captioned, "seconds": round(summary.seconds, 2),
            "x_real_time": round(speed, 2), "warnings": summary.errors, "cancelled": cancelled}


def reloaded(frames: int) -> str:
    """A job cut short by another page's Settings (a new model): it had been an error, and the
    frames it had done, written and closed in its files, were not handed over."""
    if not frames:
        return "the engine was reloaded (Settings) before a frame was done: run the job again"
    return f"the engine was reloaded (Settings) after {frames} frames: run the job again for the rest"


def run_locate_job(locate: Callable[[list[np.ndarray]], list[dict]], path: str, task: str, what: str,
                   out_dir: Path, every_n: int = 1, on_progress: Callable[[int, int | None], None] | None = None,
                   stop: threading.Event | None = None, changes: bool = False,
                   reading: Reading = AS_SHOWN, name: str | None = None) -> dict:
    """`video --detect` (or `--point`) for the web UI: the places of `what` in every n-th frame
    through `locate` (the region decoder's `locate_batch`, LOCATE_BATCH frames a call) into
    out_dir: places.jsonl (the lines of `video --detect -o`), places.srt/.vtt (the number found, a
    cue while it stays the same) and annotated.mp4 with the places drawn; the rows shown give the
    places in pixels. With `changes`, the rows and the JSONL hold the frames where the count found
    changes. Setting `stop` ends the job at its next frame with what is done (the frames of a
    batch not yet located are dropped). `name`: the JSONL's "source", as for `run_video_job`."""
    import time

    from app.parser import LOCATE_BATCH
    from engine.errors import EngineClosedError
    from pipelines.changes import AnswerChanges
    from pipelines.locator import batched, count_change, draw, found_text, pixel_places, place_record, places_text
    from pipelines.annotated import AnnotatedVideoSink
    from pipelines.sinks import JsonlSink, SubtitleSink, close_all
    from pipelines.sources import FileSource

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"jsonl": out_dir / "places.jsonl", "srt": out_dir / "places.srt", "vtt": out_dir / "places.vtt",
             "mp4": out_dir / "annotated.mp4"}
    key = "objects" if task == "detect" else "points"
    rows: list[dict] = []
    tracker = AnswerChanges() if changes else None
    frames, cancelled, started, warnings = 0, False, time.perf_counter(), []
    src = FileSource(path, source_id=name, reading=reading)
    total = src.frame_count
    lines, video = JsonlSink(paths["jsonl"], append=False), None
    duration = every_n / (src.fps or 30.0)  # what a frame's count stands for
    subs = [SubtitleSink(paths["srt"], "srt", duration), SubtitleSink(paths["vtt"], "vtt", duration)]
    try:
        for batch in batched(src.frames(pick=lambda index, pts: index % every_n == 0), LOCATE_BATCH):
            if stop is not None and stop.is_set():
                cancelled = True
                break
            for frame, result in zip(batch, locate([f.rgb for f in batch])):
                h, w = frame.rgb.shape[:2]
                pixels = pixel_places(result[key], w, h, task)
                frames += 1
                found = found_text(what, len(pixels))
                for sub in subs:  # every frame's count, as captions' subtitles hold every answer
                    sub.write_text(frame.pts, found)
                if tracker is None or count_change(tracker, 0, len(pixels), frame.pts) is not None:
                    lines.write_records([place_record(src.source_id, frame, task, what, result[key], pixels,
                                                      result["timings_ms"], result.get("batch"))])
                    rows.append({"index": frame.index, "pts": frame.pts,
                                 "text": f"{what}: {places_text(pixels, task)}",
                                 "ms": round(result["timings_ms"].get("total", 0.0), 1)})
                if video is None:
                    video = AnnotatedVideoSink(paths["mp4"], w, h, frame_duration=duration)
                video.write_image(draw(frame.rgb, pixels, task), found, f"#{frame.index} {frame.pts:.3f}s",
                                  frame.pts)
            if on_progress:
                on_progress(src.decoded, total)
    except EngineClosedError:  # `locate` found the model reloaded (Settings): as a caption job
        cancelled = True
        warnings.append(reloaded(frames))
    finally:
        src.close()
        close_all([lines, *subs, video], src.end)
    if frames == 0 and not cancelled:
        raise UIError(src.error or "the video has no frames")
    seconds = time.perf_counter() - started
    return {"rows": rows, "paths": {k: str(v) for k, v in paths.items()}, "frames": frames,
            "seconds": round(seconds, 2), "x_real_time": round(src.seconds / seconds, 2) if seconds else 0.0,
            "warnings": ([src.error] if src.error else []) + warnings, "cancelled": cancelled}
