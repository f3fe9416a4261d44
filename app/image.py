"""`vlmstream image`: caption (or ask about) images.

One image named on the command line is answered by the reference decoder, which prints its
answer as it is generated (or one JSON object with --json: the form the model's independent
checks read). Several images, or a folder of them, go through the engine, `IMAGES_IN_FLIGHT` at
a time (its batches and its vision thread: 2.5x the images a second of one after the other on
two CPU cores, the same answers), and print one line per image in order, "IMAGE: answer" (or one
JSON object per line, with an "image" field), with a progress bar on stderr. Named images are
checked before the model loads (exit 2); an image found in a folder that is not readable is
skipped with a warning; one that fails to decode mid-run gets a warning (and a JSON line with
"error") while the others go on; either way the run then exits 1 (not everything was answered).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from app.cli import folder_files, image_dtype
from app.errors import UsageError
from app.parser import LOCATE_BATCH, MAX_TOKENS_IMAGE, TOP_P
from app.prompt_args import or_default, prompt_tasks, region_task

# Enough to fill the engine's batches. A waiting image holds its crops, not its pixels (a few MB
# at most with Moondream 2's), so a folder of large photos stays small in memory.
IMAGES_IN_FLIGHT = 16


def run(args: argparse.Namespace) -> int:
    from engine.types import SamplingParams
    from pipelines.image_file import check_image

    if args.detect is not None or args.point is not None:
        return _locate(args)
    # Validate everything cheap before the model loads (and before torch: a mistake is answered
    # at once).
    params = SamplingParams(or_default(args.temperature, 0.0), or_default(args.top_p, TOP_P),
                            or_default(args.max_tokens, MAX_TOKENS_IMAGE), args.seed)
    task = prompt_tasks(args, default_caption="normal")[0]
    paths, one, skipped = _inputs(args.image, check_image)
    rgb, read_ms = _timed_read(paths[0]) if one else (None, 0.0)  # the single image's every error is a usage error

    dtype = image_dtype(args.model, args.device, args.dtype)
    if not one:
        return _several(args, paths, params, task, dtype, skipped)
    from engine.models.loader import load_model
    from engine.reference import ReferenceDecoder

    t0 = time.perf_counter()
    loaded = load_model(args.model, device=args.device, dtype=dtype)
    load_ms = (time.perf_counter() - t0) * 1000.0
    decoder = ReferenceDecoder(loaded)
    out = sys.stdout
    wrote = False  # words of the answer are on the line

    def on_text(piece: str) -> None:
        nonlocal wrote
        out.write(piece)
        out.flush()
        wrote = True

    asked = _asked(loaded.config, task)

    try:
        result = decoder.generate(rgb, params=params, on_text=None if args.json else on_text, **task)
    except KeyboardInterrupt:
        # Ctrl-C mid-answer: the words so far end their line. On a terminal "vlmstream:
        # interrupted" had been that line's tail ("a blue triangle in the vlmstream: interrupted").
        if wrote:
            try:
                out.write("\n")
                out.flush()
            except OSError:  # a closed pipe, a full disk: the interruption is what is said
                pass
        raise
    if args.json:
        json.dump({**_record(args, result, asked, loaded, load_ms), "read_ms": round(read_ms, 3)}, out)
    out.write("\n")
    out.flush()
    return 0


def _locate(args: argparse.Namespace) -> int:
    """--detect / --point: boxes or points of an object in each image (engine/region_decoder.py),
    as fractions of the image and in pixels; several images are located LOCATE_BATCH at a time
    (the same places as one by one), with a progress bar, results in the images' order."""
    from tqdm import tqdm

    from engine.errors import ImageError
    from engine.models.loader import load_model
    from engine.region_decoder import RegionDecoder
    from pipelines.image_file import check_image, read_image
    from pipelines.locator import batched, pixel_places, places_text
    from pipelines.url import redact

    task, what = region_task(args)
    paths, one, skipped = _inputs(args.image, check_image)
    t0 = time.perf_counter()
    loaded = load_model(args.model, device=args.device, dtype=image_dtype(args.model, args.device, args.dtype))
    load_ms = (time.perf_counter() - t0) * 1000.0
    decoder = RegionDecoder(loaded)  # a model whose region head is untrained: RequestError, exit 2
    key = "objects" if task == "detect" else "points"
    bar = tqdm(total=len(paths), desc="images", unit="image", file=sys.stderr, disable=len(paths) < 2)
    done = failed = 0
    try:  # the bar closed however the run ends
        for chunk in batched(paths, LOCATE_BATCH):
            read = []  # (path, its pixels or why they could not be read: said and left out, as captions do)
            for path in chunk:
                try:
                    read.append((path, read_image(path)))
                except ImageError as e:
                    if one:  # the single image's error is the run's (exit 2)
                        raise
                    read.append((path, e))
            images = [rgb for _, rgb in read if not isinstance(rgb, ImageError)]
            places = iter(decoder.locate_batch(images, what, task) if images else [])
            for path, rgb in read:  # in the images' order, an error line where its image is
                if isinstance(rgb, ImageError):
                    failed += 1
                    tqdm.write(f"vlmstream: warning: {rgb}", file=sys.stderr)
                    if args.json:
                        tqdm.write(json.dumps({"image": redact(str(path)), "error": str(rgb)}), file=sys.stdout)
                    continue
                found = next(places)
                h, w = rgb.shape[:2]
                pixels = pixel_places(found[key], w, h, task)
                name = redact(str(path))
                if args.json:
                    record = {"image": name, task: what,
                              key: [{k: round(v, 4) for k, v in o.items()} for o in found[key]],
                              "pixels": pixels, "width": w, "height": h, "batch": found["batch"],
                              "timings_ms": found["timings_ms"],
                              **_model_fields(args, loaded, load_ms)}
                    line = json.dumps(record)
                else:
                    line = f"{name + ': ' if len(paths) > 1 else ''}{what}: {places_text(pixels, task)}"
                tqdm.write(line, file=sys.stdout)
                done += 1
            sys.stdout.flush()  # lines as soon as they are known, for a reader downstream
            bar.update(len(chunk))
    finally:
        bar.close()
    return 0 if one else _closing(done, failed + skipped, "located")


def _timed_read(path):
    """The image's pixels, and the milliseconds it took to decode them (`read_ms`)."""
    from pipelines.image_file import read_image

    t0 = time.perf_counter()
    rgb = read_image(path)
    return rgb, (time.perf_counter() - t0) * 1000.0


def _asked(config, task: dict) -> dict:
    """What the model was asked, where its config rewords the question (the tiny model's does):
    {"question": ...}, or {"caption": length} for a question that asks for a description."""
    from engine.models.prompt import asked_prompt

    return {} if "question" not in task else {"asked": asked_prompt(config, task["question"])}


def _record(args: argparse.Namespace, result, asked: dict, loaded, load_ms: float) -> dict:
    return {"text": result.text, "token_ids": result.token_ids, "finish_reason": result.finish_reason,
            **asked, "timings_ms": result.timings.as_dict(), **_model_fields(args, loaded, load_ms),
            "seed": result.seed}


def _model_fields(args: argparse.Namespace, loaded, load_ms: float) -> dict:
    return {"model": args.model, "device": str(loaded.device), "dtype": str(loaded.dtype).removeprefix("torch."),
            "load_ms": round(load_ms, 3)}


def _several(args: argparse.Namespace, paths: list[str | Path], params, task: dict, dtype: str | None,
             skipped: int = 0) -> int:
    """Each image through the engine, answers written in the images' order."""
    from collections import deque

    from tqdm import tqdm

    from engine import Engine, EngineConfig
    from engine.errors import EngineClosedError, ImageError
    from pipelines.sinks import json_text
    from pipelines.url import redact

    out = sys.stdout
    done = failed = 0
    t0 = time.perf_counter()
    with Engine(EngineConfig(model=args.model, device=args.device, dtype=dtype)) as engine:
        load_ms = (time.perf_counter() - t0) * 1000.0
        asked = _asked(engine.loaded.config, task)
        bar = tqdm(total=len(paths), desc="images", unit="image", file=sys.stderr)
        pending: deque = deque()  # (path, its request or why it could not be read), in order

        def finish() -> None:
            nonlocal done, failed
            path, item = pending.popleft()
            if isinstance(item, ImageError):
                failed += 1
                tqdm.write(f"vlmstream: warning: {item}", file=sys.stderr)
                if args.json:
                    tqdm.write(json.dumps({"image": redact(str(path)), "error": str(item)}), file=out)
            else:
                handle, read_ms = item
                result = handle.wait()  # as long as the engine makes progress (a slow model's)
                if result.finish_reason not in ("stop", "length"):  # the engine failed under it
                    # Each had been printed as an empty answer, and the run said "answered", exit 0.
                    raise EngineClosedError(f"{redact(str(path))}: not answered: "
                                            + (f"the engine failed ({engine.error})" if engine.error is not None
                                               else f"the request was {result.finish_reason}"))
                # Through tqdm: on a terminal a line written beside the bar had been glued onto it
                # ("images:  25%|...| 1/4 [...]a.png: a red circle"), as every answer after the first.
                if args.json:
                    record = {**_record(args, result, asked, engine.loaded, load_ms), "read_ms": round(read_ms, 3)}
                    tqdm.write(json_text({"image": redact(str(path)), **record}), file=out)
                else:
                    tqdm.write(f"{redact(str(path))}: {result.text}", file=out)
                done += 1
            out.flush()
            bar.update(1)

        try:  # the bar closed however the run ends: an error's line came glued to it
            for path in paths:
                try:
                    rgb, read_ms = _timed_read(path)
                    pending.append((path, (engine.submit(rgb, params=params, **task), read_ms)))
                except ImageError as e:  # unreadable, or it failed to decode
                    pending.append((path, e))
                while len(pending) > IMAGES_IN_FLIGHT:
                    finish()
            while pending:
                finish()
        except KeyboardInterrupt:  # said with what is done, as eval-tiny's and bench's are: its lines are kept
            raise KeyboardInterrupt(f"{done} of {len(paths)} images answered") from None
        finally:
            bar.close()
    return _closing(done, failed + skipped, "answered")


def _closing(done: int, unread: int, verb: str) -> int:
    """The closing count of a run of several images, and its exit code."""
    print(f"vlmstream: {done} image{'' if done == 1 else 's'} {verb}"
          + (f", {unread} could not be read" if unread else ""), file=sys.stderr)
    if not done:  # a closing count alone did not say the run failed
        print("vlmstream: error: none of the images could be read", file=sys.stderr)
        return 2
    return 1 if unread else 0  # 1: the others are done, not all (a script sees it); as `video` does


def _inputs(names: list[str], check) -> tuple[list[str | Path], bool, int]:
    """The images to read (a folder: every image under it, by extension), whether the run is the
    one-image form (a single named file), and how many found in folders were skipped (unreadable)."""
    from engine.errors import ImageError
    from pipelines.image_file import IMAGE_EXTENSIONS
    from pipelines.sources import is_remote

    twice = next((n for i, n in enumerate(names) if n in names[:i]), None)
    if twice is not None:
        raise UsageError(f"{twice} is listed twice")
    paths: list[str | Path] = []
    skipped = 0
    for name in names:
        p = Path(name)
        if not p.is_dir():
            check(name)  # a named image must be there and be an image: exit 2 before anything runs
            paths.append(name)  # as typed: Path() made "https://h/x" "https:/h/x", and "./-a.png" "-a.png"
            continue
        found, unlisted = folder_files(p, IMAGE_EXTENSIONS)
        skipped += len(unlisted)
        if not found:
            raise UsageError(f"no image files in {p} (looked for .jpg, .png, .webp and other image extensions, "
                             "in subfolders too)")
        for f in found:
            if Path(f).is_fifo():  # a camera script's `mkfifo frame.jpg`: opened, it was waited on for 15 s
                skipped += 1
                print(f"vlmstream: warning: skipped: {f} is a named pipe, not an image file (name it to read "
                      "an image from it)", file=sys.stderr)
                continue
            try:
                check(f)
                paths.append(f)
            except ImageError as e:
                skipped += 1
                print(f"vlmstream: warning: skipped: {e}", file=sys.stderr)
    # One answer a file, however it was reached (a.png, ./a.png, sub/../a.png, or in a folder
    # named too), under the name it was first given.
    seen: set = set()
    paths = [p for p in paths if not ((k := p if is_remote(str(p)) else Path(p).resolve()) in seen or seen.add(k))]
    if not paths:
        raise UsageError("none of the image files found can be read")
    return paths, len(names) == 1 and not Path(names[0]).is_dir(), skipped
