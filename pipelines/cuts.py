"""Scene cuts between the frames of a stream, for sticky answers (SamplingParams.sticky).

A sticky answer keeps the previous frame's reading where the new one is close; across a cut the
previous answer describes another scene, so the frame after a cut is asked afresh (no draft).
A cut is a large change of a 32x18 grey thumbnail: on the sample clips the three cuts change it
by 27-51 grey levels on average, moving objects by at most 0.6 (a camera pan or a light switched
on may count as a cut too, which costs one frame its stickiness, nothing else).
"""

from __future__ import annotations

import cv2
import numpy as np

CUT_THRESHOLD = 15.0  # mean absolute change of the thumbnail, in grey levels (0-255)
THUMB_WH = (32, 18)


class CutDetector:
    def __init__(self, threshold: float = CUT_THRESHOLD):
        self.threshold = threshold
        self._prev: np.ndarray | None = None

    def is_cut(self, rgb_HW3: np.ndarray) -> bool:
        """Whether this frame starts another scene than the frame passed before it (the first does not)."""
        grey = cv2.cvtColor(np.ascontiguousarray(rgb_HW3), cv2.COLOR_RGB2GRAY)
        thumb = cv2.resize(grey, THUMB_WH, interpolation=cv2.INTER_AREA).astype(np.float32)
        prev, self._prev = self._prev, thumb
        return prev is not None and float(np.abs(thumb - prev).mean()) > self.threshold
