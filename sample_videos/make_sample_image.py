"""Draw the bundled sample image, `scene.png`: a red circle, a blue square and a yellow star on a
gradient. The scene world and the sample videos with ground truth build on this later.

Run: python sample_videos/make_sample_image.py   (deterministic)
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

OUT = Path(__file__).with_name("scene.png")


def main() -> None:
    w, h = 640, 360
    y = np.linspace(0.0, 1.0, h)[:, None, None]
    bg = (1 - y) * np.array([200, 215, 230]) + y * np.array([120, 140, 160])
    img = Image.fromarray(np.broadcast_to(bg, (h, w, 3)).astype(np.uint8))
    d = ImageDraw.Draw(img)
    d.ellipse((60, 50, 190, 180), fill=(220, 40, 40))
    d.rectangle((400, 200, 520, 320), fill=(40, 80, 220))
    cx, cy, r = 300, 250, 60
    star = [(cx + (r if i % 2 == 0 else r * 0.45) * math.sin(i * math.pi / 5),
             cy - (r if i % 2 == 0 else r * 0.45) * math.cos(i * math.pi / 5)) for i in range(10)]
    d.polygon(star, fill=(235, 210, 40))
    img.save(OUT, optimize=True)
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
