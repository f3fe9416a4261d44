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
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from app.cli import UsageError, reading_arg
from app.outputs import Rebuilds, read_resumed


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


def run(args: argparse.Namespace, paths: list, plans: dict, out: Path | None, to_stdout: bool,
        sampling, skipped: list[str], task: str, what: str) -> int:
    from tqdm import tqdm

    from engine.models.loader import load_model, model_id
    from engine.region_decoder import RegionDecoder
    from pipelines.changes import AnswerChanges
    from pipelines.locator import count_change, draw, found_text, pixel_places, place_record, places_text
    from pipelines.annotated import AnnotatedVideoSink
    from pipelines.resume import resumed_frames
    from pipelines.sinks import JsonlSink, SubtitleSink, close_all, save_snapshot, source_key
    from pipelines.sources import FileSource, SourceError, file_name

    from app.cli import realtime_dtype

    resume = bool(args.resume)
    done, resumed = read_resumed(lambda p: done_places(p, task, what), lambda r: r.get("model"), out, plans,
                                 args.model, "places") if resume else ({}, {})
    model = model_id(args.model)
    t0 = time.perf_counter()
    loaded = load_model(args.model, device=args.device, dtype=realtime_dtype(args.device, args.dtype))
    load_ms = round((time.perf_counter() - t0) * 1000.0, 1)
    decoder = RegionDecoder(loaded)  # an untrained region head: RequestError, exit 2, nothing written yet
    key = "objects" if task == "detect" else "points"
    jsonl_out = out if out is not None and out.suffix.lower() == ".jsonl" else None  # not -o OUT.srt
    made = jsonl_out is not None and not jsonl_out.exists()  # removed again if the run gives nothing
    shared = JsonlSink(sys.stdout) if to_stdout else (JsonlSink(out, append=resume) if jsonl_out else None)
    on_terminal = out is None and not to_stdout and all(not p.jsonl and not p.subtitles for p in plans.values())
    changes = AnswerChanges(args.hold or 1) if args.changes else None  # per file: keyed by source
    snapshots = Path(args.snapshots) if args.snapshots else None
    frames = found_total = incomplete = replayed = 0
    interrupted, errors, write_error = False, [], None
    started = time.perf_counter()
    try:
        for path, count, _ in paths:
            plan = plans[path]
            try:
                src = FileSource(path, reading=reading_arg(args))
            except SourceError as e:  # changed since it was probed
                errors.append(str(e))
                incomplete += 1
                continue
            # Its first frame before any output of its own: a file with none (cut off after its
            # header) left empty outputs behind that looked like a run that found nothing.
            with src:
                first = next(src.frames(lazy=True), None)
            if first is None:
                errors.append(src.error or f"{path}: no frame could be decoded")
                incomplete += 1
                continue
            src = FileSource(path, reading=reading_arg(args))
            own = None
            ann = None
            subs: list = []
            rebuilt = Rebuilds(resume)  # replaced once the new ones hold as far as the old
            finished = broken = False
            written, had_last = [-1], -1  # the last frame index written; the last the outputs had
            source = src.source_id
            done_key = source_key(source)  # as done_places keys its lines
            try:
                if plan.jsonl:
                    plan.jsonl.parent.mkdir(parents=True, exist_ok=True)
                    # its own JSONL: its lines are this video's, whatever path they name
                    done.update({(done_key, k[1]): r for k, r in resumed.pop(path, {}).items()})
                    own = JsonlSink(plan.jsonl, append=resume)
                had_last = max((k[1] for k in done if k[0] == done_key), default=-1)
                lines = own or shared
                for sub_path, fmt in plan.subtitles:
                    sub_path.parent.mkdir(parents=True, exist_ok=True)
                    subs.append(SubtitleSink(rebuilt.path(sub_path), fmt, sampling.period(src.fps)))
                bar = tqdm(total=count, desc=file_name(path), unit="frame", file=sys.stderr)
                shown = 0
                # a frame done before needs its pixels only to be drawn again
                need_rgb = None if plan.annotate else (lambda i: (done_key, i) not in done)
                pending: list = []  # frames waiting for their batch, in frame order

                def annotate(frame, pixels: list, info: str) -> None:
                    nonlocal ann
                    if ann is None:
                        plan.annotate.parent.mkdir(parents=True, exist_ok=True)
                        h, w = frame.rgb.shape[:2]
                        ann = AnnotatedVideoSink(rebuilt.path(plan.annotate), w, h)
                    ann.write_image(draw(frame.rgb, pixels, task), found_text(what, len(pixels)), info, frame.pts)

                def locate_pending() -> None:
                    nonlocal frames, found_total
                    results = decoder.locate_batch([f.rgb for f in pending], what, task) if pending else []
                    for frame, result in zip(pending, results):
                        h, w = frame.rgb.shape[:2]
                        places = result[key]
                        pixels = pixel_places(places, w, h, task)
                        frames += 1
                        found_total += len(places)
                        for sub in subs:
                            sub.write_text(frame.pts, found_text(what, len(places)))
                        change = (None if changes is None else
                                  count_change(changes, source, len(places), frame.pts, (frame, pixels)))
                        if changes is not None and change is None:
                            pass  # the same number as the last report: no line
                        elif lines is not None:
                            record = place_record(source, frame, task, what, places, pixels, result["timings_ms"])
                            kept = change.pop("kept", None) if change else None
                            if snapshots is not None:  # the frame the new count began on (--hold N: N-1 back)
                                first, first_pixels = kept or (frame, pixels)
                                change["snapshot"] = str(save_snapshot(snapshots, source, first.index,
                                                                       draw(first.rgb, first_pixels, task)))
                            lines.write_records([{**record, **(change or {}), "model": model, "load_ms": load_ms}])
                        elif on_terminal:
                            prefix = f"{file_name(path)}  " if len(paths) > 1 else ""
                            was = "" if not change or change["previous"] is None else f"  (was {change['previous']} found)"
                            tqdm.write(f"{prefix}{frame.pts:9.3f}  {what}: {places_text(pixels, task)}{was}")
                        if plan.annotate:
                            ms = result["timings_ms"].get("total", 0.0)
                            annotate(frame, pixels, f"#{frame.index} {frame.pts:.3f}s  {ms:.0f} ms")
                        written[0] = frame.index
                    pending.clear()

                # Resumed: the frames done are replayed from their lines, and the file is read from
                # the keyframe before the last of them (an --annotate MP4 draws them again: read all)
                recorded = {} if plan.annotate else {k[1]: float(r["pts"]) for k, r in done.items() if k[0] == done_key}
                for frame in resumed_frames(src, sampling, recorded, need_rgb=need_rgb):
                    prior = done.get((done_key, frame.index))
                    if prior is None:
                        pending.append(frame)
                        if len(pending) >= args.batch:
                            locate_pending()
                    else:  # --resume: written before; drawn again into a new --annotate (after those before it)
                        locate_pending()
                        replayed += 1
                        for sub in subs:
                            sub.write_text(frame.pts, found_text(what, len(prior["pixels"])))
                        if plan.annotate:
                            annotate(frame, prior["pixels"], f"#{frame.index} {frame.pts:.3f}s")
                        written[0] = frame.index
                    bar.update(src.decoded - shown)
                    shown = src.decoded
                locate_pending()
                bar.update(src.decoded - shown)
                bar.close()
                if src.error:
                    errors.append(src.error)
                incomplete += src.incomplete
                finished = True
            except OSError:
                broken = True
                raise
            finally:
                src.close()
                try:
                    close_all((own, ann, *subs), src.end)
                except OSError:
                    broken = True
                    raise
                finally:  # stopped past the last frame they had: the rebuilt outputs go as far, and further
                    rebuilt.finish(not broken and (finished or written[0] >= had_last))
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: what was written stays whole
        interrupted = True
    except BrokenPipeError:  # -o - into a reader that has had enough
        return 0
    except OSError as e:  # a full disk, a folder gone: what was written stays, and the run says so
        write_error = e
    finally:
        if shared is not None:
            shared.close()
    # Nothing located and nothing to resume from: every file failed. Said as errors, with no
    # "0 frames" summary, and the JSONL this run made goes again.
    failed = frames == 0 and not replayed and bool(errors) and not interrupted and write_error is None
    for err in errors:
        print(f"vlmstream: {'error' if failed else 'warning'}: {err}", file=sys.stderr)
    if failed:
        if made and jsonl_out.exists() and jsonl_out.stat().st_size == 0:
            jsonl_out.unlink()
        return 2
    seconds = time.perf_counter() - started
    print(f"vlmstream: {frames} frames, {found_total} {key} found ({what}), {len(paths)} file(s)"
          + (f", {replayed} done before (resume)" if resume else "")
          + (f", {len(skipped)} unreadable skipped" if skipped else "")
          + (f", {changes.count} changes" if changes is not None else "")
          + f", {frames / seconds if seconds else 0.0:.2f} frames/s" + (" (interrupted)" if interrupted else ""),
          file=sys.stderr)
    if write_error is not None:
        print(f"vlmstream: error: cannot write {write_error.filename or 'the output'}: "
              f"{write_error.strerror or write_error}", file=sys.stderr)
        return 1
    if interrupted:
        return 130
    return 1 if incomplete or skipped else 0
