"""How steady and how right live captions are with sticky answers (SamplingParams.sticky).

Every frame of each sample video, in order, is captioned ("normal") once per margin through the
engine, each margin's request drafting from that margin's previous answer (a live session with
one frame in flight; after a scene cut, no draft, as there). Per video and margin, printed as
JSON: how often the caption changed from one frame to the next, and, against the video's
ground-truth sidecar, the share of objects whose colour and shape the caption names and the
mentions of objects that are not there. With `--shape S`, the question "Is there a S?"
constrained to yes/no instead, scored per frame.

    python scripts/steady_captions.py [--margins 0,1,2,3] [--shape star] [VIDEO.mp4 ...]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import cv2
import torch
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine import Choice, Engine, EngineConfig, SamplingParams  # noqa: E402
from pipelines.cuts import CutDetector  # noqa: E402
from tinyvlm.evaluate import named  # noqa: E402


def measure(engine: Engine, video: Path, margins: list[float], shape: str | None = None) -> list[dict]:
    truth = json.loads(video.with_suffix(".json").read_text())["frames"]
    cap = cv2.VideoCapture(str(video))
    last: dict[float, list[int] | None] = dict.fromkeys(margins)
    last_text: dict[float, str | None] = dict.fromkeys(margins)
    rows = {m: {"video": video.name, "sticky": m, "frames": 0, "changes": 0, "objects": 0, "named": 0,
                "absent_named": 0, "right": 0} for m in margins}
    prompt = ({"question": f"Is there a {shape}?", "constraint": Choice(["yes", "no"])} if shape
              else {"caption": "normal"})
    cuts = CutDetector()
    t0 = time.perf_counter()
    for frame in tqdm(truth, desc=video.name, unit="frame", file=sys.stderr):
        ok, bgr = cap.read()
        if not ok:
            break
        rgb = cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB)
        cut = cuts.is_cut(rgb)
        ref = engine.encode_image(rgb)
        handles = {m: engine.submit(ref, **prompt, draft=None if cut else last[m],
                                    params=SamplingParams(max_tokens=64, sticky=m)) for m in margins}
        ref.release()
        objects = {(o["color"], o["shape"]) for o in frame["objects"]}
        for m, h in handles.items():
            out = h.result(timeout=120)
            r = rows[m]
            r["changes"] += last_text[m] is not None and out.text != last_text[m]
            last[m], last_text[m] = out.token_ids, out.text
            r["right"] += (out.text == "yes") == any(o["shape"] == shape for o in frame["objects"])
            said = named(out.text)
            r["frames"] += 1
            r["objects"] += len(objects)
            r["named"] += len(objects & said)
            r["absent_named"] += len(said - objects)
    seconds = round(time.perf_counter() - t0, 1)
    for r in rows.values():
        r["seconds"] = seconds
        if shape:
            r.update(question=prompt["question"], accuracy=round(r.pop("right") / max(r["frames"], 1), 4))
            for k in ("objects", "named", "absent_named"):
                del r[k]
            continue
        del r["right"]
        r["named_share"] = round(r["named"] / max(r["objects"], 1), 4)
    return list(rows.values())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("videos", nargs="*", type=Path, help="MP4s with a ground-truth JSON sidecar (default: the samples)")
    p.add_argument("--margins", default="0,1,2,3", help="sticky margins to compare (default 0,1,2,3)")
    p.add_argument("--shape", choices=["circle", "square", "triangle", "star"],
                   help='ask "Is there a SHAPE?" (yes or no) instead of captioning')
    p.add_argument("--model", default="tiny")
    args = p.parse_args()
    torch.set_num_threads(1)
    videos = args.videos or sorted(v for v in (ROOT / "sample_videos").glob("*.mp4") if v.with_suffix(".json").exists())
    margins = [float(m) for m in args.margins.split(",")]
    with Engine(EngineConfig(model=args.model)) as engine:
        for video in videos:
            for row in measure(engine, video, margins, args.shape):
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
