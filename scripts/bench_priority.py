"""Live latency in the web UI's service while a video job runs on the same engine, with live
frames' priority (the default) or without it (`fifo`): one line per run.

    OMP_NUM_THREADS=1 python scripts/bench_priority.py priority|fifo
"""
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

import pipelines.live
from app.service import SAMPLES_DIR, Service
from app.task import make_task
from app.launcher import keep_freed_memory

torch.set_num_threads(1)
keep_freed_memory()

mode = sys.argv[1] if len(sys.argv) > 1 else ""
if mode not in ("priority", "fifo"):
    sys.exit("usage: bench_priority.py priority|fifo")
if mode == "fifo":  # live frames as batch work: first come, first served
    pipelines.live.INTERACTIVE = 0
svc = Service()
feed = svc.start_live("tab", "shapes_640x360_60fps.mp4", make_task("short"))
time.sleep(8)
alone = feed.session.stats()


def lat(s):
    return s["latency_ms"]["end_to_end"]["p50"], s["latency_ms"]["end_to_end"]["p90"]


out = {}
job = threading.Thread(target=lambda: out.update(svc.caption_video(
    str(SAMPLES_DIR / "cuts_640x360_30fps.mp4"), make_task("short"), Path(tempfile.mkdtemp()))))
for window in feed.session._latency.values():  # percentiles of the frames during the job only
    window.clear()
completed, t0 = feed.session.completed, time.perf_counter()
job.start()
job.join()
wj = time.perf_counter() - t0
during = feed.session.stats()
fps_during = (feed.session.completed - completed) / wj
print(mode, "live alone p50/p90", lat(alone), "| during the video job p50/p90", lat(during),
      "live fps during", round(fps_during, 1), "| video job", out["frames"], "frames in", round(wj, 1), "s")
svc.stop_live("tab")
svc.close()
