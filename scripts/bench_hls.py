"""How far behind its encoder a live HLS stream is read, and how evenly its frames come: joined
two segments from the playlist's end (vlmstream's `LIVE_START_INDEX`), three (FFmpeg's and the
HLS spec's default) and one (its last segment), alternated in one run, over loopback.

An ffmpeg encoder writes a live playlist in real time (`-re`, testsrc at 30 fps, 2 s segments,
six kept) into a temporary folder served over HTTP; once it has a few segments, `StreamSource`
reads it paced, as `live` does, for `--frames` frames. "behind" is the wall time a frame is given
minus the time the encoder made it (its stream time from the encoder's start); "bursts" counts the
frames that came under 5 ms after the one before (a segment that was not there yet, then all at
once: the latest-frame grabber keeps only the last of such a burst). Prints one JSON object.

    OMP_NUM_THREADS=1 python scripts/bench_hls.py [--repeats 2] [--frames 600]
"""

from __future__ import annotations

import argparse
import functools
import http.server
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

import pipelines.schemes as schemes  # noqa: E402
import pipelines.stream as stream  # noqa: E402

SEGMENT_S, WARM_S = 2, 12  # segment length; the encoder's lead before a read starts
MUX_DELAY_S = 1.4  # FFmpeg's MPEG-TS muxer starts its timestamps this late


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


def one_read(start_index: int, frames: int) -> dict:
    with tempfile.TemporaryDirectory() as root:
        encoder = subprocess.Popen(
            ["ffmpeg", "-loglevel", "error", "-re", "-f", "lavfi", "-i", "testsrc=size=160x120:rate=30",
             "-c:v", "libx264", "-g", str(30 * SEGMENT_S), "-f", "hls", "-hls_time", str(SEGMENT_S),
             "-hls_list_size", "6", "-hls_flags", "delete_segments", f"{root}/index.m3u8"])
        began = time.time()
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Quiet, directory=root))
        threading.Thread(target=server.serve_forever, daemon=True).start()
        given: list[tuple[float, float]] = []  # (wall time, stream time) of each frame given
        real = stream.pixels

        def spy(frame, *args, **kwargs):
            given.append((time.time(), frame.time))
            return real(frame, *args, **kwargs)

        stream.pixels = spy
        try:
            time.sleep(WARM_S)
            src = stream.StreamSource(f"http://127.0.0.1:{server.server_address[1]}/index.m3u8")
            src._options["live_start_index"] = str(start_index)
            for i, _ in enumerate(src.frames()):
                if i + 1 == frames:
                    break
            src.connection.stop()
        finally:
            stream.pixels = real
            encoder.kill()
            encoder.wait()
            server.shutdown()
    behind = [wall - (began + t - MUX_DELAY_S) for wall, t in given]
    gaps = [b[0] - a[0] for a, b in zip(given, given[1:])]
    return {"behind_s": statistics.median(behind), "max_behind_s": max(behind),
            "bursts": sum(g < 0.005 for g in gaps), "longest_gap_s": max(gaps)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--frames", type=int, default=600)
    args = ap.parse_args()
    joins = {"vlmstream": schemes.LIVE_START_INDEX, "ffmpeg_default": -3, "last_segment": -1}
    runs: dict[str, list[dict]] = {k: [] for k in joins}
    with tqdm(total=args.repeats * len(joins), desc="hls reads", file=sys.stderr) as bar:
        for _ in range(args.repeats):  # alternated: the machine's noise falls on each alike
            for name, index in joins.items():
                runs[name].append(one_read(index, args.frames))
                bar.update()
    out = {"segment_s": SEGMENT_S, "frames": args.frames, "repeats": args.repeats}
    for name, index in joins.items():
        out[name] = {"live_start_index": index, **{k: round(statistics.median(r[k] for r in runs[name]), 2)
                                                   for k in runs[name][0]}}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
