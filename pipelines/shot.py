"""A picture of the frame where a live feed's answers changed: `Shot`, and `jpeg_bytes` that makes it.

Each is kept twice: at most SHOT_WIDTH wide for a page's gallery, and at its own size (JPEG
quality SHOT_QUALITY) for a download.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

SHOT_WIDTH = 320
SHOT_QUALITY = 90  # the full-size picture's: what `live --snapshots` saves


@dataclass(frozen=True)
class Shot:
    """The frame where a run of identical answers began, as a JPEG at most SHOT_WIDTH wide (for
    the page) and at its own size (for a download)."""

    number: int  # 1 for the feed's first answer, counting the changes on
    wall: float
    pts: float
    index: int
    text: str
    jpeg: bytes
    full: bytes = b""


def jpeg_bytes(rgb: np.ndarray, width: int | None, quality: int = 80) -> bytes:
    """An RGB frame as a JPEG, scaled down to `width` if it is wider (None: as it is)."""
    import cv2

    h, w = rgb.shape[:2]
    if width is not None and w > width:
        rgb = cv2.resize(rgb, (width, max(1, round(h * width / w))), interpolation=cv2.INTER_AREA)
    ok, buf = cv2.imencode(".jpg", np.ascontiguousarray(rgb[..., ::-1]), [cv2.IMWRITE_JPEG_QUALITY, quality])
    if not ok:
        raise ValueError("cannot encode a frame as JPEG")
    return buf.tobytes()
