"""`live --detect` on several sources: each pass's frames one after the other against one batch
(`LiveLocator(locate_many=...)`), alternated in one process. Per mode: frames located a second
over all sources, the end-to-end latency (capture to places): the sources' mean p50, their
largest p99. One JSON object.

    OMP_NUM_THREADS=1 python scripts/bench_live_locate.py [--model DIR] [--sources 3] [--seconds 8]

The default model is the tiny one with its config marked trained (a temporary copy), as in
scripts/bench_locate.py: the cost of a frame is the protocol's, what it finds is not meaningful.
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

torch.set_num_threads(1)
ap = argparse.ArgumentParser()
ap.add_argument("--model", default=None)
ap.add_argument("--sources", type=int, default=3)
ap.add_argument("--seconds", type=float, default=8.0)
ap.add_argument("--repeats", type=int, default=2)
args = ap.parse_args()
clip = str(Path(__file__).resolve().parents[1] / "sample_videos" / "shapes_640x360_60fps.mp4")

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
decoder.locate(next(FileSource(clip).frames()).rgb, "shape")  # warm-up


def run(batched: bool) -> dict:
    sources = [LocateSource(f"s{i}", FileSource(clip).frames, realtime=True) for i in range(args.sources)]
    loc = LiveLocator(lambda rgb: decoder.locate(rgb, "shape"), sources, "shape",
                      locate_many=(lambda rgbs: decoder.locate_batch(rgbs, "shape")) if batched else None)
    time.sleep(args.seconds)
    stats = loc.stats()
    loc.close()
    loc.check()
    e2e = [s["latency_ms"]["end_to_end"] for s in stats.values()]
    return {"fps": sum(s["achieved_fps"] for s in stats.values()),
            "p50": statistics.mean(x["p50"] for x in e2e), "p99": max(x["p99"] for x in e2e)}


out = {"one_after_another": [], "one_batch": []}
for _ in range(args.repeats):
    for name, batched in (("one_after_another", False), ("one_batch", True)):
        out[name].append({k: round(v, 1) for k, v in run(batched).items()})
print(json.dumps({"model": args.model or "tiny (region head marked trained)", "sources": args.sources,
                  "seconds": args.seconds, **out}))
if tmp is not None:
    shutil.rmtree(tmp.parent)
