"""A local camera read through OpenCV (`webcam:N`, or a Linux device such as /dev/video0), its
frames timed by the wall clock; `parse_webcam` tells a camera's name from any other source's.
Opening a camera that is not there, or one that never sends a frame, is a `SourceError`."""

from __future__ import annotations

import time
from typing import Iterator

from .connection import Connection
from .frame import Frame, SourceError, SourceSilent


class WebcamSource:
    """A local camera through OpenCV (`webcam:N`). Frames are timed by the wall clock.

    A camera that stops (unplugged, its driver reset) is opened again as `connection` says: for
    ever once it has sent frames, unless `max_outage` is given; one that never sends a frame is
    an error after `read_timeout` seconds."""

    def __init__(self, index: int, source_id: str | None = None, read_timeout: float = 3.0,
                 max_outage: float | None = None):
        import cv2

        # No driver chatter for a missing camera ("[ WARN:0@2.5] global cap_v4l.cpp..." above the
        # one-line error). Not OPENCV_LOG_LEVEL: it is read once, and cv2 is often imported already.
        cv2.utils.logging.setLogLevel(cv2.utils.logging.LOG_LEVEL_ERROR)
        self._cv2 = cv2
        self.index, self.source_id = index, source_id or f"webcam:{index}"
        self.read_timeout = read_timeout
        self.connection = Connection(f"webcam:{index}", read_timeout, max_outage)
        self._cap = cv2.VideoCapture(index)
        if not self._cap.isOpened():
            self._cap.release()
            raise SourceError(f"no camera at webcam:{index} (is it connected, and not used by another program?)")

    def frames(self) -> Iterator[Frame]:
        connection = self.connection
        t0 = last_ok = time.perf_counter()
        index = 0
        try:
            while True:
                ok, bgr = self._cap.read() if self._cap is not None else (False, None)
                now = time.perf_counter()
                if ok and bgr is not None:
                    connection.frame()
                    last_ok = connection.last_frame
                    yield Frame(self.source_id, index, last_ok - t0, self._cv2.cvtColor(bgr, self._cv2.COLOR_BGR2RGB))
                    index += 1
                    continue
                # Failed reads within read_timeout are a camera warming up, unless --max-outage comes
                # first: a frozen camera with --max-outage 1 was given up after the 3 s read timeout
                left = None if connection.last_frame is None else connection.give_up_in(t0)
                if now - last_ok <= self.read_timeout and self._cap is not None and (left is None or left > 0):
                    time.sleep(0.01)
                    continue
                if connection.last_frame is None:  # a camera that is off or busy: exit 1, as a silent stream
                    raise SourceSilent(f"webcam:{self.index} sent no frame in {self.read_timeout:g} s")
                connection.lost("it stopped sending frames")
                if self._cap is not None:
                    self._cap.release()
                    self._cap = None
                if not connection.retry("it stopped sending frames", t0):  # waits; raises past max_outage
                    return
                self._cap = self._cv2.VideoCapture(self.index)  # the same device, plugged in again
                if not self._cap.isOpened():
                    self._cap.release()
                    self._cap = None
                last_ok = time.perf_counter()  # a reopened camera gets read_timeout to send its first frame
        except SourceError:
            connection.set("failed")
            raise
        finally:
            if self._cap is not None:
                self._cap.release()


def parse_webcam(source: str) -> int | None:
    """The camera index of 'webcam:N' or of a Linux camera device (/dev/videoN, or a link to one such
    as /dev/v4l/by-id/usb-...-video-index0), None for anything else; a bad N is a SourceError."""
    import os
    import re

    if "\0" in source:
        raise SourceError("a source name cannot hold a NUL character")
    try:
        os.fsencode(source)  # a name from the command line is (undecodable bytes are escaped); one typed may not be
    except UnicodeEncodeError as e:
        raise SourceError(f"the source name is not valid text: {e.reason} at character {e.start}") from None
    if not source.startswith("webcam:"):
        device = re.fullmatch(r"/dev/video(\d+)", os.path.realpath(source)) if "://" not in source else None
        return int(device.group(1)) if device else None
    try:
        index = int(source.removeprefix("webcam:"))
    except ValueError:
        raise SourceError(f"a webcam is written webcam:N with N a number, got {source!r}") from None
    if not 0 <= index < 2**31:  # OpenCV's C int: a larger one was its "Overload resolution failed" traceback
        raise SourceError(f"webcam index must be from 0 to {2**31 - 1}, got {index}")
    return index
