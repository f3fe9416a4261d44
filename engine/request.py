"""The caller's side of the engine: handles for requests and shared image prefixes.

Handles are thread-safe. A `RequestHandle` receives text deltas and its final `RequestOutput`
from the engine thread; `cancel()` only posts a message, so it is safe at any moment and from
any thread, and idempotent. An `ImageRef` keeps an image prefix alive for further prompts until
`release()` (or the end of its `with` block, or until it is garbage collected).
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any, Callable, Iterator

import numpy as np

from .errors import ImageError, RequestError
from .timeouts import seconds
from .types import RequestOutput

if TYPE_CHECKING:
    from .engine import Engine
    from .sequence import Image


class RequestHandle:
    def __init__(self, engine: "Engine", request_id: int):
        self._engine = engine
        self.id = request_id
        # Every delta, kept: each stream() reads them from the start (bounded by max_tokens).
        self._deltas: list[str] = []
        self._ended = False
        self._cond = threading.Condition()
        self._done = threading.Event()
        self._output: RequestOutput | None = None
        self._cancel_sent = False
        self._callbacks: list = []
        self._cb_lock = threading.Lock()

    # engine side
    def _emit(self, delta: str) -> None:
        with self._cond:
            self._deltas.append(delta)
            self._cond.notify_all()

    def _finish(self, output: RequestOutput) -> None:
        self._output = output
        with self._cb_lock:
            self._done.set()
            # A finished handle needs its engine no more (cancel is then a no-op), and a caller may
            # keep handles long after: a stopped live feed, kept for its Export, had kept the
            # engine it came from, weights and KV pool, alive past a reload.
            self._engine = None
            callbacks, self._callbacks = self._callbacks, []
        with self._cond:
            self._ended = True
            self._cond.notify_all()
        for fn in callbacks:
            self._call(fn, on_engine=True)

    def _end_in_fork(self, output: RequestOutput) -> None:
        """In a child forked while this request was unfinished (open_engines.forked): its locks
        are new, the parent's threads may have held them; its done callbacks are not called (run
        inside the fork, they may wait on locks that no thread here will release)."""
        self._cond, self._cb_lock, self._callbacks = threading.Condition(), threading.Lock(), []
        self._done = threading.Event()  # its own lock too (no thread waits on it here)
        self._finish(output)

    def _call(self, fn, on_engine: bool = False) -> None:
        # A caller's callback that raises is logged, as concurrent.futures does: raised on the
        # engine thread it had been taken for a device failure, failing every request, and a
        # second one killed the thread with requests left waiting for ever. There even a
        # SystemExit (sys.exit in a callback) is logged: it had failed every other request.
        try:
            fn(self)
        except BaseException as e:
            if not on_engine and not isinstance(e, Exception):
                raise
            logging.getLogger("vlmstream").exception("a done callback of request %d raised", self.id)

    def add_done_callback(self, fn: Callable[["RequestHandle"], object]) -> None:
        """Call fn(handle) once the request has finished (at once if it already has). It runs on
        the engine thread: it must be quick and must not wait on the engine. An exception it
        raises is logged (logger "vlmstream"), not raised."""
        if not callable(fn):  # checked here: called later, on the engine thread, it was only logged
            raise RequestError(f"a done callback must be callable, got {type(fn).__name__}")
        with self._cb_lock:
            if not self._done.is_set():
                self._callbacks.append(fn)
                return
        self._call(fn)

    # caller side
    def done(self) -> bool:
        return self._done.is_set()

    def result(self, timeout: float | None = None) -> RequestOutput:
        """The output, waited for at most `timeout` seconds (None or math.inf: no limit)."""
        if not self._done.wait(seconds(timeout)):
            raise TimeoutError(f"request {self.id} not finished after {timeout} s")
        assert self._output is not None
        return self._output

    def wait(self, stall: float = 600.0) -> RequestOutput:
        """The output, waited for as long as the engine makes progress: a TimeoutError only once
        it has run no step for `stall` seconds. A slow model's request can outlast any fixed
        limit (Moondream 2 on a CPU with 32 frames queued: 15 s a step, each with another
        frame's image, and 64 of them to the oldest frame's answer), where result(timeout=600)
        had failed a healthy run."""
        limit = seconds(stall, "stall")
        engine = self._engine  # None once finished: result() returns at once then
        steps = engine.stats().steps if engine is not None else None
        while True:
            try:
                return self.result(timeout=limit)
            except TimeoutError:
                now = engine.stats().steps if engine is not None else None
                if now is None or now == steps:
                    raise TimeoutError(f"request {self.id}: the engine ran no step for {stall:g} s") from None
                steps = now

    def stream(self, timeout: float | None = None) -> Iterator[str]:
        """Text deltas (whole words) as they are committed; ends when the request finishes.

        Each call streams from the first word: a second reader, or a call after the request
        finished, gets the whole text. timeout: the longest wait for the next word (checked
        here, not at the first word: a generator's body runs only then).
        """
        return self._words(seconds(timeout), timeout)

    def _words(self, limit: float | None, timeout: float | None) -> Iterator[str]:
        i = 0
        while True:
            with self._cond:
                if not self._cond.wait_for(lambda: i < len(self._deltas) or self._ended, limit):
                    raise TimeoutError(f"no text from request {self.id} for {timeout} s")
                words, ended = self._deltas[i:], self._ended
            i += len(words)
            yield from words
            if ended:  # nothing is emitted after the end: `words` held the rest
                return

    def cancel(self) -> None:
        engine = self._engine  # read once: _finish may drop it meanwhile (a cancel then finds the request gone)
        if self._cancel_sent or engine is None or self._done.is_set():
            return
        self._cancel_sent = True
        try:
            engine._post(("cancel", self.id))  # never waits for room in the engine's queue
        except BaseException:  # not sent (interrupted): a retry must send it
            self._cancel_sent = False
            raise


class ImageRef:
    def __init__(self, engine: "Engine", image: "Image"):
        self._engine = engine
        self._image = image
        self._released = False
        self._lock = threading.Lock()
        # Submits on this image posting their requests; a release meanwhile is posted by the last
        # of them, after its request. Holding the lock across the post instead made a release in
        # a done callback wait on a submit that waited for the engine thread, itself in the
        # callback: 10 s, then the submit refused.
        self._posting = 0
        self._release_due = False

    @property
    def id(self) -> int:
        return self._image.id

    @property
    def tiling(self) -> tuple[int, int]:
        return self._image.tiling

    def release(self) -> None:
        with self._lock:
            if self._released:
                return
            self._released = True
            if self._posting:
                self._release_due = True
                return
        self._engine._post(("release", self._image))

    def _submitting(self) -> None:
        with self._lock:
            if self._released:
                raise RequestError("that ImageRef was released")
            self._posting += 1

    def _submitted(self) -> bool:
        """True when a release came while this submit posted, and it is the last: it posts it."""
        with self._lock:
            self._posting -= 1
            due = self._release_due and not self._posting
            if due:
                self._release_due = False
            return due

    @property
    def released(self) -> bool:
        return self._released

    def __del__(self) -> None:
        # Dropped unreleased (a forgotten release(), an exception past it): its image had stayed
        # held until close, prefix pages and embeddings, each such ref another in a process
        # that runs for days (1000 of them: +330 MB, and the pool nearly full). No submit is
        # posting on it now (each holds the ref), so its requests are in the inbox before this.
        if not getattr(self, "_released", True):
            self._released = True
            self._engine._inbox.post_dropped(("release", self._image))

    def __enter__(self) -> "ImageRef":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


BEHIND_ALPHA = 128  # what a transparent pixel shows: mid grey


def as_rgb(rgb: Any) -> np.ndarray:
    """A caller's image as a contiguous (H, W, 3) uint8 array: grey ((H, W), (H, W, 1)), grey with
    alpha ((H, W, 2)) and RGBA converted, transparency over mid grey (`flatten_alpha`); a Pillow
    image (what Moondream's own API takes) too."""
    if not isinstance(rgb, np.ndarray):
        from PIL import Image as PILImage

        if not isinstance(rgb, PILImage.Image):
            raise ImageError(f"expected an RGB image as a numpy array or a Pillow image, got {type(rgb).__name__}")
        try:  # Image.open reads pixels only now: a damaged file fails here (RuntimeError: AVIF's decoder)
            rgb.load()
        except (OSError, ValueError, SyntaxError, RuntimeError) as e:
            raise ImageError(f"the Pillow image could not be decoded: {e}") from None
        rgb = pil_to_rgb(rgb)  # an empty one is caught below, as an empty array is
    if rgb.dtype != np.uint8:
        raise ImageError(f"expected a uint8 image, got {rgb.dtype}")
    if rgb.ndim == 3 and rgb.shape[2] in (2, 4):  # grey or RGB, with alpha
        rgb = flatten_alpha(rgb)
    if rgb.ndim == 3 and rgb.shape[2] == 1:  # what OpenCV and PIL give for grey
        rgb = rgb[:, :, 0]
    if rgb.ndim == 2:
        rgb = np.repeat(rgb[:, :, None], 3, axis=2)
    if rgb.ndim != 3 or rgb.shape[2] != 3:
        raise ImageError(f"expected an image array of shape (H, W, 3), got {rgb.shape}")
    if rgb.shape[0] == 0 or rgb.shape[1] == 0:
        raise ImageError(f"the image is empty ({rgb.shape[1]}x{rgb.shape[0]})")
    return np.ascontiguousarray(rgb)


_WIDE_INT_MODES = {"I", "I;16", "I;16B", "I;16L", "I;16N"}


def flatten_alpha(image_HWC: np.ndarray) -> np.ndarray:
    """Colour channels + alpha (uint8) as they show over mid grey. Dropping the alpha, as
    Moondream's reference preprocessing does, showed what an exporter left under transparent
    pixels: black (a logo's background read as "a black circle ..."), or an erased drawing
    (described, and counted). Mid grey: the tiny model's world has no white or black
    backgrounds (they are object colours)."""
    colour, alpha = image_HWC[:, :, :-1], image_HWC[:, :, -1:]
    if alpha.min(initial=255) == 255:
        return colour
    out = np.empty(colour.shape, np.uint8)
    rows = max(1, (1 << 22) // max(1, colour.shape[1] * colour.shape[2]))  # ~4 M values a pass
    for y in range(0, colour.shape[0], rows):  # by bands: a 13000 x 13000 PNG's uint16 copies took 4.7 GB
        a = alpha[y:y + rows].astype(np.uint16)
        out[y:y + rows] = (colour[y:y + rows].astype(np.uint16) * a + BEHIND_ALPHA * (255 - a) + 127) // 255
    return out


def pil_to_rgb(img: Any) -> np.ndarray:
    """A Pillow image as an (H, W, 3) uint8 RGB array, upright by its EXIF orientation (a phone's
    photo held sideways), with grey, palette, CMYK, 16-bit and float images converted, and
    transparency shown over mid grey (`flatten_alpha`)."""
    from PIL import ImageOps

    try:
        img = ImageOps.exif_transpose(img)  # a copy without the tag: applying it twice is once
    except Exception:  # a broken EXIF block must not cost the image
        pass
    mode = img.mode
    if mode in _WIDE_INT_MODES:
        wide = np.asarray(img).astype(np.int64)
        # "I" is 32-bit: a 16-bit file's (older Pillow), or an 8-bit picture's after convert("I"),
        # which read as 16-bit came out black (200 -> 1). Told by the values: no 16-bit picture
        # worth seeing has them all under 256 (at most 0.4 % of full brightness).
        full = 255 if mode == "I" and wide.max(initial=0) <= 255 else 65535
        gray = ((np.clip(wide, 0, full) * 255 + full // 2) // full).astype(np.uint8)
        if isinstance(img.info.get("transparency"), int):  # a PNG's transparent grey level
            gray[wide == img.info["transparency"]] = BEHIND_ALPHA
        return np.repeat(gray[:, :, None], 3, axis=2)
    if mode == "La":  # premultiplied grey + alpha: Pillow converts it to LA only
        img = img.convert("LA")
    if mode == "F":
        f = np.asarray(img, dtype=np.float64)
        finite = f[np.isfinite(f)]
        # 0..1 or 0..255, told by nearly all pixels and the brightest finite one: by the brightest
        # alone, one highlight at 1.05 (or an inf) had read a 0..1 image as 0..255, black; by
        # nearly all alone, a dark 0..255 one with a thin bright line as 0..1.
        scale = 255.0 if finite.size == 0 or (finite.max() <= 2.0 and np.percentile(finite, 99.5) <= 1.0) else 1.0
        gray = np.clip(np.rint(np.nan_to_num(f, nan=0.0, posinf=255.0 / scale, neginf=0.0) * scale), 0, 255)
        gray = gray.astype(np.uint8)
        return np.repeat(gray[:, :, None], 3, axis=2)
    try:
        if "A" in img.getbands() or "a" in img.getbands() or "transparency" in img.info:
            return np.ascontiguousarray(flatten_alpha(np.asarray(img.convert("RGBA"), dtype=np.uint8)))
        if img.mode != "RGB":
            img = img.convert("RGB")
    except ValueError as e:  # a mode Pillow cannot convert ("conversion from X to Y not supported")
        raise ImageError(f"a Pillow image of mode {mode} cannot be read: {e}") from None
    return np.asarray(img, dtype=np.uint8).copy()
