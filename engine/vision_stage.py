"""The vision stage (CPU): image encodings computed on a worker thread of their own, beside the
device thread, so that on a CPU the vision encoder of frame t+1 runs on one core while the text
model runs frame t's prefix, prompt and answer on the other.

On one device thread a live frame's vision encoder and projection took ~40 % of its device time
(BENCHMARKS.md); both threads run TorchScript without the GIL, single-threaded inside.

The engine thread owns the stage: `feed` hands the worker the oldest images not yet encoded, of
the highest priority first (at most `depth` at once: nothing queues up unbounded), `collect`
takes finished ones in order and sets their `embeds` (the prefix embeddings, P x C); the
planner admits an image's requests only then, and its prefix step runs the embeddings through the decoder into KV pages as before. The
worker wakes the engine thread when an encoding is done. An error in the worker is raised by
`collect` on the engine thread, which fails every request as it does for a device error. An
encoding is the same whichever thread computes it (the encoder is batch invariant), so answers
do not change (tested against the reference decoder).
"""

from __future__ import annotations

from collections import deque
from typing import Callable

import torch

from .executor import Executor, Pending
from .sequence import Image


def vision_thread_mode(flag: bool | None, device: torch.device) -> bool:
    """Resolve EngineConfig.vision_thread: on CPU unless turned off; CUDA encodes in its steps."""
    if flag and device.type != "cpu":
        from .errors import ConfigError

        raise ConfigError("vision_thread=True needs the CPU device (CUDA encodes images in its steps)")
    return device.type == "cpu" if flag is None else bool(flag)


class VisionStage:
    def __init__(self, encode: Callable, wake: Callable[[], None], device: torch.device, depth: int = 2):
        """encode(crops, tiling) -> (P, C) embeddings (Runner.vision_prefix); wake() is called on
        the worker after each encoding."""
        self._encode, self._wake, self.depth = encode, wake, depth
        self._executor = Executor(device, queue_size=depth, name="vlmstream-vision")
        self._jobs: deque[tuple[Image, Pending]] = deque()

    def feed(self, pending_images: list[Image], first: Image | None = None) -> None:
        """Start the oldest images of the highest priority that still need an encoding, up to
        `depth` in the worker; `first` (the image of a lower priority whose turn it is) before them."""
        if len(self._jobs) >= self.depth:  # the common case in the engine loop: nothing to sort
            return
        order = sorted(pending_images, key=lambda i: -i.priority)  # stable: FIFO within a priority
        if first is not None and first in order:
            order.remove(first)
            order.insert(0, first)
        for img in order:
            if len(self._jobs) >= self.depth:
                return
            if img.encoding or img.embeds is not None or img.holders == 0 or not img.staged:
                continue
            img.encoding = True
            job = self._executor.launch(lambda c=img.crops, t=img.tiling: self._encode(c, t), on_done=self._wake)
            self._jobs.append((img, job))

    def collect(self) -> None:
        """Finished encodings, in order, onto their images (an image released meanwhile is just
        dropped with its result). Raises the worker's error."""
        while self._jobs and self._jobs[0][1].done():
            img, pending = self._jobs.popleft()
            img.embeds = pending.wait(0)
            img.crops = None
            img.timings.vision = pending.busy_s * 1000.0

    def busy_seconds(self) -> float:
        return self._executor.busy_seconds()

    def close(self) -> None:
        """The engine has ended every request: encodings still queued are for none of them (a
        cancelled run waited for each, 6-8 s an image with Moondream 2 on a CPU)."""
        self._jobs.clear()
        self._executor.close(drop_queued=True)
