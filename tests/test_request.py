"""The caller's handles alone, on a fake engine that records what they post."""

from engine.request import ImageRef, RequestHandle
from engine.sequence import Image
from engine.types import RequestOutput


class _Engine:
    def __init__(self):
        self.posted = []

    def _post(self, message):
        self.posted.append(message)


def test_cancel_posts_once_and_nothing_after_the_end():
    """Each handle sends one cancel at most: the engine's overflow queue of cancels that found its
    inbox full relies on it to stay small."""
    eng = _Engine()
    h = RequestHandle(eng, 7)
    h.cancel()
    h.cancel()
    h.cancel()
    assert eng.posted == [("cancel", 7)]
    done = RequestHandle(eng, 8)
    done._finish(RequestOutput("", [], "stop"))
    done.cancel()
    assert eng.posted == [("cancel", 7)] and done.result().finish_reason == "stop"
    assert done._engine is None  # a finished handle keeps no engine (weights, KV pool) alive


def test_a_release_during_a_submit_is_posted_after_its_request_by_the_last_submit():
    eng = _Engine()
    img = Image(id=3, crops=None, tiling=(1, 1))
    ref = ImageRef(eng, img)
    ref._submitting()
    ref._submitting()
    ref.release()  # two submits are posting their requests: the release must come after both
    ref.release()
    assert eng.posted == [] and ref.released
    assert ref._submitted() is False  # one still posting
    assert ref._submitted() is True  # the last one posts the release
    plain = ImageRef(eng, img)
    plain.release()
    plain.release()
    assert eng.posted == [("release", img)]  # once


def test_waits_take_infinity_for_no_limit_and_refuse_what_is_not_a_number_of_seconds():
    """math.inf (the usual "for ever", and asyncio.to_thread(h.result, timeout)'s) was an
    OverflowError from inside threading, "5" a TypeError from its comparisons, NaN no wait."""
    import math
    import threading

    import pytest

    from engine.errors import RequestError

    h = RequestHandle(_Engine(), 1)
    threading.Timer(0.2, h._finish, (RequestOutput("a star", [3], "stop"),)).start()
    assert h.result(math.inf).text == "a star"
    assert h.result(10**20).text == "a star" and list(h.stream(math.inf)) == []
    assert h.result(10**400).text == "a star" and h.result(-10**400).text == "a star"  # past a float's range
    for bad in ("5", float("nan"), True, [1]):
        with pytest.raises(RequestError, match="timeout must be a number of seconds or None"):
            h.result(bad)
        with pytest.raises(RequestError, match="timeout must be a number of seconds or None"):
            h.stream(bad)  # when called: as a generator it had raised only at the first next()
        with pytest.raises(RequestError, match="stall must be a number of seconds or None"):
            h.wait(bad)


def test_a_done_callback_that_cannot_be_called_is_refused_at_once():
    """Taken, then called on the engine thread, a non-callable was only logged there."""
    import pytest

    from engine.errors import RequestError

    h = RequestHandle(_Engine(), 1)
    with pytest.raises(RequestError, match="a done callback must be callable, got NoneType"):
        h.add_done_callback(None)
    h._finish(RequestOutput("", [], "stop"))
    with pytest.raises(RequestError, match="got str"):
        h.add_done_callback("print")


def test_a_32_bit_grey_picture_of_8_bit_values_reads_as_the_8_bit_one():
    """Pillow's convert("I") of an 8-bit picture (a caller's own pipeline) was read as 16-bit:
    nearly black (200 -> 1). A 16-bit picture keeps its scale, however dark."""
    import numpy as np
    from PIL import Image

    from engine.request import pil_to_rgb

    grey = Image.fromarray(np.arange(256, dtype=np.uint8).reshape(16, 16))
    assert np.array_equal(pil_to_rgb(grey.convert("I")), pil_to_rgb(grey))
    wide = Image.fromarray(np.array([[0, 65535]], np.int32), "I")  # values past 255: a 16-bit range
    assert pil_to_rgb(wide)[0, :, 0].tolist() == [0, 255]
    dark16 = Image.fromarray(np.full((2, 2), 200, np.uint16))  # "I;16": stays as dark as it is
    assert dark16.mode == "I;16" and pil_to_rgb(dark16).max() == 1
