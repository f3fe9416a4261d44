"""The engine thread's inbox alone: order, overflow of releases and cancels, refusals."""

import threading

import pytest

from engine.errors import EngineClosedError
from engine.inbox import Inbox


def _drain(inbox):
    out = []
    while (m := inbox.next(block=False)) is not None:
        out.append(m)
    return out


def test_releases_and_cancels_that_find_it_full_wait_their_turn_and_keep_the_engine_reading():
    inbox = Inbox(maxsize=1)
    inbox.post(("request", 1))
    inbox.post(("cancel", 1))  # full: kept aside, never refused, never waiting for room
    inbox.post(("release", "img"))
    inbox.post_dropped(("release", "dropped"))  # an ImageRef collected unreleased
    assert inbox.next(block=False) == ("request", 1)
    assert not inbox.stop_if_quiet()  # what was kept aside is still to be read
    assert _drain(inbox) == [("cancel", 1), ("release", "img"), ("release", "dropped")]
    assert inbox.stop_if_quiet() and inbox.stopped
    inbox.post(("cancel", 2))  # after the end: moot, not an error
    inbox.post_dropped(("release", "late"))
    assert _drain(inbox) == []


def test_new_work_is_refused_once_closed_but_releases_and_cancels_still_come():
    inbox = Inbox(maxsize=4)
    inbox.close()
    for kind in ("request", "image", "depth", "reset_stats"):
        with pytest.raises(EngineClosedError):
            inbox.post((kind, None))
    inbox.post(("cancel", 1))
    inbox.post(("release", "img"))
    assert _drain(inbox) == [("cancel", 1), ("release", "img")]
    inbox.fail(RuntimeError("device lost"))
    with pytest.raises(EngineClosedError, match="device lost"):
        inbox.post(("request", 2))


def test_what_the_engine_thread_posts_goes_behind_what_the_inbox_held():
    inbox = Inbox(maxsize=2)
    inbox.post(("request", 1))
    inbox.post(("request", 2))  # full now
    inbox.owner = threading.current_thread()  # a done callback on the engine thread
    inbox.post(("cancel", 9))  # never blocks on the full inbox
    inbox.post(("release", "img"))
    assert _drain(inbox) == [("request", 1), ("request", 2), ("cancel", 9), ("release", "img")]
    # read in the order posted, before what other threads post after it
    inbox.owner = None
    inbox.post(("request", 3))
    inbox.post(("request", 4))
    inbox.owner = threading.current_thread()
    inbox.post(("cancel", 3))
    assert inbox.next(block=False) == ("request", 3)
    inbox.owner = None
    inbox.post(("request", 5))
    assert _drain(inbox) == [("request", 4), ("cancel", 3), ("request", 5)]
