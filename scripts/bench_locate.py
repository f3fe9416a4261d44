"""Detect through the region head, several frames in step against one at a time, measured
alternately in one process; one JSON object.

    OMP_NUM_THREADS=1 python scripts/bench_locate.py frames [--model DIR] [--frames 24] [--batches 1,2,4,8]
    OMP_NUM_THREADS=1 python scripts/bench_locate.py live [--model DIR] [--sources 3] [--seconds 8]

frames: video frames through `RegionDecoder.locate_batch` at each batch size: frames a second,
the ratio to batch 1, and whether every frame got the same places (vision encoding included).
live: several copies of the 60 fps sample played in real time through `LiveLocator`, each pass's
frames one after another against one batch (`locate_many`): frames located a second over all
sources, the sources' mean end-to-end p50 and their largest p99 (ms).

The default model is the tiny one with its config marked trained (a temporary copy): its region
head was never trained, so what it finds is not meaningful, but the work a frame costs is the
protocol's (prompt, then x, y, size and a token per object); --max-objects caps that work.
"""
import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from engine.models.loader import TINY_DIR, load_model
from engine.region_decoder import RegionDecoder
from pipelines.locator import LiveLocator, LocateSource
from pipelines.sources import FileSource

SAMPLE = str(Path(__file__).resolve().parents[1] / "sample_videos" / "shapes_640x360_60fps.mp4")


def frames_mode(decoder: RegionDecoder, args) -> dict:
    with FileSource(args.video) as src:
        frames = [f.rgb for f, _ in zip(src.frames(), range(args.frames))]
    batches = [int(b) for b in args.batches.split(",")]

    def run(batch: int) -> tuple[float, list]:
        t0 = time.perf_counter()
        out = []
        for i in range(0, len(frames), batch):
            out += decoder.locate_batch(frames[i:i + batch], "shape", "detect", max_objects=args.max_objects)
        return time.perf_counter() - t0, [r["objects"] for r in out]

    run(batches[0])  # warm-up
    times, places = {b: [] for b in batches}, {}
    for _ in range(args.repeats):
        for b in batches:  # alternately, so that the machine's load falls on every size alike
            seconds, places[b] = run(b)
            times[b].append(seconds)
    fps = {b: len(frames) / statistics.median(times[b]) for b in batches}
    return {"frames": len(frames), "max_objects": args.max_objects,
            "objects_per_frame": sum(map(len, places[batches[0]])) / len(frames),
            "frames_per_s": {str(b): round(fps[b], 2) for b in batches},
            "ratio_to_one": {str(b): round(fps[b] / fps[batches[0]], 2) for b in batches},
            "same_places": all(places[b] == places[batches[0]] for b in batches)}


def live_mode(decoder: RegionDecoder, args) -> dict:
    decoder.locate(next(FileSource(args.video).frames()).rgb, "shape")  # warm-up

    def run(batched: bool) -> dict:
        sources = [LocateSource(f"s{i}", FileSource(args.video).frames, realtime=True) for i in range(args.sources)]
        many = (lambda rgbs: decoder.locate_batch(rgbs, "shape", max_objects=args.max_objects)) if batched else None
        loc = LiveLocator(lambda rgb: decoder.locate(rgb, "shape", max_objects=args.max_objects), sources, "shape",
                          locate_many=many)
        time.sleep(args.seconds)
        stats = loc.stats()
        loc.close()
        loc.check()
        e2e = [s["latency_ms"]["end_to_end"] for s in stats.values()]
        return {"fps": round(sum(s["achieved_fps"] for s in stats.values()), 1),
                "p50": round(statistics.mean(x["p50"] for x in e2e), 1), "p99": round(max(x["p99"] for x in e2e), 1)}

    out = {"sources": args.sources, "seconds": args.seconds, "max_objects": args.max_objects,
           "one_after_another": [], "one_batch": []}
    for _ in range(args.repeats):
        out["one_after_another"].append(run(False))
        out["one_batch"].append(run(True))
    return out


def main() -> None:
    torch.set_num_threads(1)
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["frames", "live"])
    ap.add_argument("--model", default=None, help="a folder with a trained region head (default: tiny, marked)")
    ap.add_argument("--max-objects", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--video", default=SAMPLE)
    ap.add_argument("--frames", type=int, default=24, help="frames: how many")
    ap.add_argument("--batches", default="1,2,4,8", help="frames: the batch sizes")
    ap.add_argument("--sources", type=int, default=3, help="live: copies of the video played at once")
    ap.add_argument("--seconds", type=float, default=8.0, help="live: each run's length")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            model = str(Path(tmp) / "tiny")
            shutil.copytree(TINY_DIR, model)
            config = json.loads((Path(model) / "config.json").read_text())
            config["region"]["trained"] = True
            (Path(model) / "config.json").write_text(json.dumps(config))
        decoder = RegionDecoder(load_model(model, device="cpu", dtype="float32"))
        report = (frames_mode if args.mode == "frames" else live_mode)(decoder, args)
    print(json.dumps({"mode": args.mode, "model": args.model or "tiny (region head marked trained)", **report,
                      "torch_threads": torch.get_num_threads()}))


if __name__ == "__main__":
    main()
