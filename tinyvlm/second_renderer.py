"""A second renderer of the world's scenes, written apart from `world.render`.

Issue 4 is checked on frames drawn by a separate renderer that follows the same vocabulary.
This one stands in for it: the same `Scene` (objects, colours, positions, so the same ground
truth), drawn with OpenCV instead of PIL, with anti-aliased edges, its own shape geometry (a
star of inner radius 0.38; squares and triangles always sized by their side, which the world
does for half of them), its own backgrounds (vertical and radial gradients, mosaic blocks,
checks, grain, dots) and its own camera effects (sensor noise, Gaussian blur, JPEG through
libjpeg-turbo's encoder in OpenCV, brightness). `vlmstream eval-tiny --renderer second` runs the
held-out eval on these frames. Deterministic for a scene (everything random comes from the
scene's background and effect seeds).
"""

from __future__ import annotations

import math

import cv2
import numpy as np

from .world import Obj, Scene, circumradius

BACKGROUNDS = ("solid", "vertical", "radial", "mosaic", "checks", "grain", "dots")
STAR_INNER = 0.38
SUBPIXEL = 4  # OpenCV's fixed-point shift: coordinates in 1/16 px


def outline(o: Obj) -> np.ndarray:
    """Vertices (k, 2) of a polygonal object. The scene's extent is read as this renderer's size:
    the side of a square, the side of a triangle, the outer diameter of a star."""
    a0 = math.radians(o.angle)
    if o.shape == "square":
        n, start, radii = 4, a0 + math.pi / 4, [circumradius("square", o.extent, by_side=True)] * 4
    elif o.shape == "triangle":
        n, start, radii = 3, a0 - math.pi / 2, [circumradius("triangle", o.extent, by_side=True)] * 3
    elif o.shape == "star":
        r = o.extent / 2
        n, start, radii = 10, a0 - math.pi / 2, [r if k % 2 == 0 else STAR_INNER * r for k in range(10)]
    else:
        raise ValueError(f"not a polygon: {o.shape}")
    angles = start + 2 * math.pi * np.arange(n) / n
    return np.stack([o.cx + np.array(radii) * np.cos(angles), o.cy + np.array(radii) * np.sin(angles)], 1)


def _background(scene: Scene, rng: np.random.Generator) -> np.ndarray:
    w, h = scene.width, scene.height
    a = np.array(scene.background.color_a, np.float32)
    b = np.array(scene.background.color_b, np.float32)
    kind = BACKGROUNDS[int(rng.integers(len(BACKGROUNDS)))]
    cell = max(4, int(min(w, h) * rng.uniform(0.04, 0.09)))
    if kind in ("vertical", "radial", "checks", "dots"):
        yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    if kind == "solid":
        t = np.zeros((h, w, 1), np.float32)
    elif kind == "vertical":
        t = (yy / h)[..., None]
    elif kind == "radial":
        t = (np.hypot(xx / w - 0.5, yy / h - 0.5) / math.hypot(0.5, 0.5))[..., None]
    elif kind == "mosaic":
        grid = rng.normal(0, 12, (-(-h // cell), -(-w // cell), 3)).astype(np.float32)
        blocks = cv2.resize(grid, (grid.shape[1] * cell, grid.shape[0] * cell), interpolation=cv2.INTER_NEAREST)
        return a + blocks[:h, :w]
    elif kind == "checks":
        t = ((xx // cell + yy // cell) % 2)[..., None] * 0.5
    elif kind == "grain":
        return a + rng.normal(0, 14, (h, w, 3)).astype(np.float32)
    else:  # dots
        t = ((((xx % cell) - cell / 2) ** 2 + ((yy % cell) - cell / 2) ** 2) < (cell / 4) ** 2)[..., None] * 0.5
    return a + t * (b - a)


def render_second(scene: Scene, effects: bool = True) -> np.ndarray:
    """RGB uint8 (height, width, 3) of the scene, drawn by this renderer; without `effects`,
    the drawing alone (no brightness change, noise, blur or JPEG)."""
    rng = np.random.default_rng([scene.background.seed, scene.effects.seed, 2])
    img = np.ascontiguousarray(np.clip(_background(scene, rng), 0, 255).astype(np.uint8))
    scale = 1 << SUBPIXEL
    for o in scene.objects:
        colour = tuple(int(c) for c in o.rgb)
        if o.shape == "circle":
            centre = (int(round(o.cx * scale)), int(round(o.cy * scale)))
            cv2.circle(img, centre, int(round(o.extent / 2 * scale)), colour, -1, cv2.LINE_AA, SUBPIXEL)
        else:
            pts = np.round(outline(o) * scale).astype(np.int32)
            cv2.fillPoly(img, [pts], colour, cv2.LINE_AA, SUBPIXEL)
    if not effects:
        return img
    out = img.astype(np.float32) * rng.uniform(0.85, 1.15)
    if rng.random() < 0.5:
        out += rng.normal(0, rng.uniform(2, 8), out.shape).astype(np.float32)
    img = np.clip(out, 0, 255).astype(np.uint8)
    if rng.random() < 0.3:
        img = cv2.GaussianBlur(img, (0, 0), rng.uniform(0.5, 1.0))
    if rng.random() < 0.5:
        ok, data = cv2.imencode(".jpg", img[..., ::-1], [cv2.IMWRITE_JPEG_QUALITY, int(rng.integers(40, 90))])
        img = cv2.imdecode(data, cv2.IMREAD_COLOR)[..., ::-1]
    return np.ascontiguousarray(img)
