"""`video --resume` of a long file stopped near its end: the time it takes, reading from the keyframe before the last recorded frame (as shipped) and from the
file's start (the frames before passed over, as before), alternately in one process. One JSON
line.

    OMP_NUM_THREADS=1 python scripts/bench_resume.py [--minutes 10] [--height 720] [--fps 1] [--done 0.9]

The file is the cuts sample joined end to end to --minutes of 30 fps video at --height (H.264,
a keyframe every 2 s, written once to a temporary folder); the JSONL is a full --fps run's, cut
to its first --done.
"""
import argparse
import json
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

import pipelines.sources
from app.cli import main

torch.set_num_threads(1)
ap = argparse.ArgumentParser()
ap.add_argument("--minutes", type=float, default=10.0)
ap.add_argument("--height", type=int, default=720)
ap.add_argument("--fps", type=float, default=1.0)
ap.add_argument("--done", type=float, default=0.9)
ap.add_argument("--repeats", type=int, default=3)
args = ap.parse_args()

sample = Path(__file__).resolve().parents[1] / "sample_videos" / "cuts_640x360_30fps.mp4"
work = Path(tempfile.mkdtemp(prefix="bench-resume-"))
try:
    clip, out = work / "long.mp4", work / "out.jsonl"
    subprocess.run([shutil.which("ffmpeg"), "-loglevel", "error", "-stream_loop", "-1", "-i", str(sample),
                    "-t", str(args.minutes * 60), "-vf", f"scale=-2:{args.height}", "-c:v", "libx264", "-preset",
                    "veryfast", "-g", "60", str(clip)], check=True)
    cmd = ["video", str(clip), "--fps", str(args.fps), "-o", str(out)]
    assert main(cmd) == 0
    lines = out.read_text().splitlines()
    kept = lines[:int(len(lines) * args.done)]
    seek = pipelines.sources.FileSource._seek
    times: dict[str, list[float]] = {"seek": [], "from_start": []}
    for _ in range(args.repeats):
        for mode in times:
            out.write_text("\n".join(kept) + "\n")
            pipelines.sources.FileSource._seek = seek if mode == "seek" else (lambda self, seconds: False)
            t0 = time.perf_counter()
            assert main(cmd + ["--resume"]) == 0
            times[mode].append(time.perf_counter() - t0)
            assert out.read_text().count("\n") == len(lines)
    report = {
        "video_minutes": args.minutes, "height": args.height, "fps": args.fps, "answers": len(lines),
        "answers_done": len(kept),
        "resume_s": {m: round(statistics.median(t), 2) for m, t in times.items()},
        "speedup": round(statistics.median(times["from_start"]) / statistics.median(times["seek"]), 2),
    }
    print(json.dumps(report))
finally:
    shutil.rmtree(work, ignore_errors=True)
