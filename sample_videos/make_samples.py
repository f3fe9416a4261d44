"""Render the bundled sample clips and image from the scene world, with ground truth.

    python sample_videos/make_samples.py        # rewrites every file below, bit for bit

- shapes_640x360_60fps.mp4   12 s, 60 fps, three shapes drifting across a gradient
- shapes_1280x720_30fps.mp4  15 s, 30 fps, shapes entering and leaving the frame
- cuts_640x360_30fps.mp4     16 s, 30 fps, a scene cut every 4 s with 1 to 4 shapes
- scene.png                  a still scene (the CLI's sample image)

Each clip has `<name>.json` beside it: per frame its index, pts (seconds), whether a cut starts
there, and every visible object (centre inside the frame) with shape, colour, size, bounding
box, position cell and motion (pixels per frame). Video is H.264 yuv420p in MP4 (faststart),
encoded single-threaded so that the output is reproducible.
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tinyvlm.world import Effects, Scene, render, sample_scene  # noqa: E402

OUT = Path(__file__).resolve().parent
CLIPS = [
    {"name": "shapes_640x360_60fps", "size": (640, 360), "fps": 60, "seconds": 12, "cut_every": None,
     "seed": 11, "objects": 3, "speed": 1.2, "wrap": False},
    {"name": "shapes_1280x720_30fps", "size": (1280, 720), "fps": 30, "seconds": 15, "cut_every": None,
     "seed": 12, "objects": 3, "speed": 5.0, "wrap": True},
    {"name": "cuts_640x360_30fps", "size": (640, 360), "fps": 30, "seconds": 16, "cut_every": 4,
     "seed": 13, "objects": None, "speed": 1.5, "wrap": False},
]
STILL = OUT / "scene.png"


def _video_scene(rng: np.random.Generator, w: int, h: int, n: int | None, speed: float) -> Scene:
    scene = sample_scene(rng, w, h, n_objects=n, proportions=False)
    moving = []
    for o in scene.objects:
        angle = rng.uniform(0, 2 * np.pi)
        v = speed * rng.uniform(0.5, 1.5) * min(w, h) / 360
        moving.append(replace(o, vx=float(v * np.cos(angle)), vy=float(v * np.sin(angle))))
    # No per-frame sensor noise or JPEG: a video codec does that part. The clips keep the first
    # look of each background kind (world.VARIANTS) and the first proportions, so they stay the
    # files they were.
    return replace(scene, objects=tuple(moving), effects=Effects(blur=0.0, brightness=1.0),
                   background=replace(scene.background, variant=""))


def _step(scene: Scene, wrap: bool) -> Scene:
    """Advance one frame. Without wrap, shapes bounce off the edges; with wrap they leave the
    frame and come back in on the other side (entering and leaving)."""
    w, h = scene.width, scene.height
    objs = []
    for o in scene.objects:
        cx, cy, vx, vy = o.cx + o.vx, o.cy + o.vy, o.vx, o.vy
        r = o.radius
        if wrap:
            if cx < -r:
                cx += w + 2 * r
            elif cx > w + r:
                cx -= w + 2 * r
            if cy < -r:
                cy += h + 2 * r
            elif cy > h + r:
                cy -= h + 2 * r
        else:
            if not r <= cx <= w - r:
                vx = -vx
                cx = min(max(cx, r), w - r)
            if not r <= cy <= h - r:
                vy = -vy
                cy = min(max(cy, r), h - r)
        objs.append(replace(o, cx=cx, cy=cy, vx=vx, vy=vy))
    return replace(scene, objects=tuple(objs))


def _visible(scene: Scene) -> dict:
    truth = scene.truth()
    inside = [0 <= o.cx < scene.width and 0 <= o.cy < scene.height for o in scene.objects]
    truth["objects"] = [t for t, keep in zip(truth["objects"], inside) if keep]
    return truth


def make_clip(spec: dict) -> None:
    import av

    w, h = spec["size"]
    fps, n_frames = spec["fps"], spec["fps"] * spec["seconds"]
    rng = np.random.default_rng(spec["seed"])
    path = OUT / f"{spec['name']}.mp4"
    frames_truth = []
    with av.open(str(path), mode="w", options={"movflags": "+faststart"}) as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = w, h, "yuv420p"
        stream.options = {"crf": "27", "preset": "medium", "threads": "1", "x264-params": "threads=1"}
        scene = None
        for i in range(n_frames):
            cut = scene is None or (spec["cut_every"] and i % (spec["cut_every"] * fps) == 0)
            if cut:
                scene = _video_scene(rng, w, h, spec["objects"], spec["speed"])
            else:
                scene = _step(scene, spec["wrap"])
            frame = av.VideoFrame.from_ndarray(render(scene), format="rgb24")
            frame.pts = i
            for packet in stream.encode(frame):
                container.mux(packet)
            t = _visible(scene)
            frames_truth.append({"index": i, "pts": round(i / fps, 6), "cut": bool(cut),
                                 "background": t["background"], "objects": t["objects"]})
        for packet in stream.encode():
            container.mux(packet)
    (OUT / f"{spec['name']}.json").write_text(json.dumps(
        {"file": path.name, "width": w, "height": h, "fps": fps, "frames": frames_truth}, separators=(",", ":")))
    print(f"wrote {path.name} ({path.stat().st_size / 1e6:.2f} MB, {n_frames} frames)")


def make_still() -> None:
    from PIL import Image

    scene = sample_scene(np.random.default_rng(7), 640, 360, n_objects=3, proportions=False)
    scene = replace(scene, effects=Effects(), background=replace(scene.background, variant=""))
    Image.fromarray(render(scene)).save(STILL, optimize=True)
    (OUT / "scene.json").write_text(json.dumps(scene.truth(), indent=1))
    print(f"wrote {STILL.name}")


if __name__ == "__main__":
    import argparse

    # --help answers without rewriting the samples (it had rendered them all)
    argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog="Rewrites every sample beside this script, "
                            "bit for bit.").parse_args()
    make_still()
    for clip in CLIPS:
        make_clip(clip)
