"""Detect on video frames one at a time against several in step (`RegionDecoder.locate_batch`),
measured alternately in one process: frames a second for each batch size, the ratio to one at a
time, and whether every frame got the same places. One JSON object.

    OMP_NUM_THREADS=1 python scripts/bench_locate.py [--model DIR] [--frames 24] [--batches 1,2,4,8]

The default model is the tiny one with its config marked trained (a temporary copy): its region
head was never trained, so what it finds is not meaningful, but the work a frame costs is the
protocol's (prompt, then x, y, size and a token per object); --max-objects fixes that work.
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
from pipelines.sources import FileSource

torch.set_num_threads(1)
ap = argparse.ArgumentParser()
ap.add_argument("--model", default=None, help="a model folder with a trained region head (default: tiny, marked)")
ap.add_argument("--frames", type=int, default=24)
ap.add_argument("--batches", default="1,2,4,8")
ap.add_argument("--max-objects", type=int, default=4)
ap.add_argument("--repeats", type=int, default=3)
ap.add_argument("--video", default=str(Path(__file__).resolve().parents[1] / "sample_videos" / "shapes_640x360_60fps.mp4"))
args = ap.parse_args()

tmp = None
model = args.model
if model is None:
    tmp = Path(tempfile.mkdtemp()) / "tiny"
    shutil.copytree(TINY_DIR, tmp)
    config = json.loads((tmp / "config.json").read_text())
    config["region"]["trained"] = True
    (tmp / "config.json").write_text(json.dumps(config))
    model = str(tmp)
decoder = RegionDecoder(load_model(model, device="cpu", dtype="float32"))
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
times = {b: [] for b in batches}
places = {}
for _ in range(args.repeats):
    for b in batches:  # alternately, so that the machine's load falls on every size alike
        seconds, places[b] = run(b)
        times[b].append(seconds)
fps = {b: len(frames) / statistics.median(times[b]) for b in batches}
print(json.dumps({
    "model": args.model or "tiny (region head marked trained)", "frames": len(frames),
    "max_objects": args.max_objects, "objects_per_frame": sum(map(len, places[batches[0]])) / len(frames),
    "frames_per_s": {str(b): round(fps[b], 2) for b in batches},
    "ratio_to_one": {str(b): round(fps[b] / fps[batches[0]], 2) for b in batches},
    "same_places": all(places[b] == places[batches[0]] for b in batches),
    "torch_threads": torch.get_num_threads(),
}))
if tmp is not None:
    shutil.rmtree(tmp.parent)
