"""How long a live stream takes to give its first frame: with vlmstream's open options, and with
FFmpeg's defaults (only the transport options kept), alternated in one run, over loopback.

Sources: an RTSP camera (tests/rtsp_camera.py) sending H.264, H.265 or MJPEG at 15 fps with a
key frame a second, and MPEG-TS over UDP at 30 fps with one every half second
(tests/stream_sender.py). The time runs from `StreamSource.frames()` being asked for a frame to
the frame decoded: the open, FFmpeg's probe and the wait for a key frame. Prints one JSON object.

    OMP_NUM_THREADS=1 python scripts/bench_open.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from pipelines.sources import StreamSource  # noqa: E402
from rtsp_camera import RtspCamera  # noqa: E402

KEPT = ("rtsp_flags", "fifo_size", "overrun_nonfatal")  # how to reach the stream, not how to probe it


def first_frame_s(url: str, ffmpeg_defaults: bool) -> float:
    src = StreamSource(url, open_timeout=10, read_timeout=5, max_wait=20)
    if ffmpeg_defaults:
        src._options = {k: v for k, v in src._options.items() if k in KEPT}
    frames = src.frames()
    t0 = time.perf_counter()
    next(frames)
    took = time.perf_counter() - t0
    frames.close()
    return took


def measure(url: str, repeats: int, bar: tqdm) -> dict:
    times: dict[str, list[float]] = {"ours": [], "ffmpeg_defaults": []}
    for _ in range(repeats):
        for name in times:
            times[name].append(first_frame_s(url, name == "ffmpeg_defaults"))
            bar.update()
    ours, theirs = statistics.median(times["ours"]), statistics.median(times["ffmpeg_defaults"])
    return {"first_frame_s": {k: [round(t, 3) for t in v] for k, v in times.items()},
            "median_s": {"ours": round(ours, 3), "ffmpeg_defaults": round(theirs, 3)},
            "faster": round(theirs / ours, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    out = {}
    with tqdm(total=4 * 2 * args.repeats, desc="first frames", file=sys.stderr) as bar:
        for codec in ("h264", "hevc", "mjpeg"):
            with RtspCamera(codec=codec) as cam:
                time.sleep(1.0)  # the encoder under way, as a camera's is
                out[f"rtsp_{codec}_320x240_15fps"] = measure(cam.url, args.repeats, bar)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.bind(("127.0.0.1", 0))
            url = f"udp://127.0.0.1:{s.getsockname()[1]}"
        sender = subprocess.Popen([sys.executable, str(ROOT / "tests" / "stream_sender.py"), url + "?pkt_size=1316",
                                   "3600"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            time.sleep(1.0)
            out["udp_mpegts_h264_160x120_30fps"] = measure(url, args.repeats, bar)
        finally:
            sender.kill()
            sender.wait(10)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
