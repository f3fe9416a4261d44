"""A video job beside a live view on one engine, as in the web UI: the job's time alone and
beside the live 60 fps sample, and the live view's latency and frames a second alone and during
the job. One JSON line per run.

    OMP_NUM_THREADS=1 python scripts/bench_priority.py turns|strict|fifo [--every N]

turns: live frames first, but the job gets one admission in EngineConfig.lower_turn while live
frames keep waiting (the default); strict: live frames always first (lower_turn 0); fifo: live
frames as batch work, first come first served. --every N: the job captions every N-th frame
(the web UI's "Every n-th frame"); its sticky answers ask a group of ~1 s of video at a time.
"""
import argparse
import json
import tempfile
import threading
import time
from pathlib import Path

import torch

import pipelines.live
from app.launcher import keep_freed_memory
from app.service import SAMPLES_DIR, Service
from app.task import make_task
from engine import Engine, EngineConfig

torch.set_num_threads(1)
keep_freed_memory()

ap = argparse.ArgumentParser()
ap.add_argument("mode", choices=["turns", "strict", "fifo"])
ap.add_argument("--every", type=int, default=1)
args = ap.parse_args()
if args.mode == "fifo":  # live frames as batch work: first come, first served
    pipelines.live.INTERACTIVE = 0
svc = Service()
svc._engine = Engine(EngineConfig(model=svc.settings.model, device=svc.settings.device, dtype=svc.settings.dtype,
                                  lower_turn=0 if args.mode == "strict" else EngineConfig.lower_turn))
clip = str(SAMPLES_DIR / "cuts_640x360_30fps.mp4")


def job() -> tuple[dict, float]:
    t0 = time.perf_counter()
    out = svc.caption_video(clip, make_task("short"), Path(tempfile.mkdtemp()), every_n=args.every)
    return out, time.perf_counter() - t0


job()  # warm-up
out_alone, job_alone = job()
feed = svc.start_live("tab", "shapes_640x360_60fps.mp4", make_task("short"))
time.sleep(8)
alone = feed.session.stats()


def lat(s):
    e = s["latency_ms"]["end_to_end"]
    return [e["p50"], e["p90"]]


for window in feed.session._latency.values():  # percentiles of the frames during the job only
    window.clear()
completed, t0 = feed.session.completed, time.perf_counter()
out: dict = {}
worker = threading.Thread(target=lambda: out.update(result=job()))
worker.start()
worker.join()
wj = time.perf_counter() - t0
during = feed.session.stats()
print(json.dumps({
    "mode": args.mode, "every": args.every, "job_frames": out["result"][0]["frames"],
    "job_alone_s": round(job_alone, 2), "job_beside_live_s": round(out["result"][1], 2),
    "live_alone_p50_p90_ms": lat(alone), "live_during_job_p50_p90_ms": lat(during),
    "live_alone_fps": round(alone["rolling_fps"], 1),
    "live_during_job_fps": round((feed.session.completed - completed) / wj, 1)}))
svc.stop_live("tab")
svc.close()
