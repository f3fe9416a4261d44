"""The engine thread's inbox: messages from any thread, taken in the order they were posted.

Callers post ("image", Image), ("request", Sequence), ("release", Image), ("cancel", id),
("depth", n), ("reset_stats", None); the vision thread posts ("wake", None). New work is refused
once the inbox is closed or the engine failed (`EngineClosedError`); a release or a cancel is
never refused and never waits for room. The engine thread reads with `next` and ends once
`stop_if_quiet` finds no message in the inbox or on its way there.
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from typing import Any

from .errors import EngineClosedError, RequestError

NEW_WORK = ("image", "request", "depth", "reset_stats")
POST_WAIT_S = 10.0  # the longest a post waits for room in a full inbox


class Inbox:
    def __init__(self, maxsize: int):
        self.queue: queue.Queue = queue.Queue(maxsize=maxsize)
        self.owner: threading.Thread | None = None  # the engine thread, which reads this inbox
        # Messages the engine thread posts itself (from done callbacks), behind what the inbox held
        # then: read before the inbox. Engine thread only.
        self._own: deque = deque()
        # Releases and cancels that found the inbox full, read once it is empty (after what was
        # queued before them). Each ImageRef and handle sends one at most, so this stays small;
        # refused after a 10 s wait instead, a release was lost (the image's pages held until
        # close) and a cancel raised, which the API promises never to do.
        self._overflow: deque = deque()
        self._lock = threading.Lock()
        self._posting = 0  # posts past their checks, their message not yet in the inbox
        self._closed = False
        self.error: BaseException | None = None  # what failed the engine
        self.stopped = False  # the engine thread has ended (or failed) and reads no more messages
        self.closed_why = "the engine is closed"  # what a refused new work says

    def post(self, message: tuple) -> None:
        # From the engine thread itself (a done callback) a message goes to a queue of its own,
        # never blocking: put in a full inbox it had waited 10 s on the thread that empties it,
        # then been refused. What the inbox holds goes first, in order: a release had overtaken a
        # request on its image still there (the image freed, then taken back without pages: the
        # engine failed), a cancel the request it cancelled (lost). Not handled here: handling
        # the inbox inside the callback nested a level per message whose callback posted again
        # (300 queued cancels of requests that release their images: RecursionError, 64 handles
        # never finished).
        block = threading.current_thread() is not self.owner
        with self._lock:
            if message[0] in NEW_WORK:  # a release or cancel after a failure or close is moot: not an error
                self.check_open()
            if self.stopped:  # a late release or cancel: the engine thread let everything go
                return
            # Counted until the message is in the inbox: the engine thread does not end (nor
            # fail everything) while a message that passed the checks above is on its way.
            if block:
                self._posting += 1
        if not block:
            while True:
                try:
                    self._own.append(self.queue.get_nowait())
                except queue.Empty:
                    break
            self._own.append(message)
            return
        try:
            if message[0] in ("release", "cancel"):
                try:
                    self.queue.put_nowait(message)
                except queue.Full:
                    with self._lock:
                        self._overflow.append(message)
            else:
                self.queue.put(message, timeout=POST_WAIT_S)
        except queue.Full:
            raise RequestError(f"the engine's queue is full ({self.queue.maxsize} messages)") from None
        finally:
            with self._lock:
                self._posting -= 1

    def post_dropped(self, message: tuple) -> None:
        """A release from an ImageRef's __del__, which runs wherever the collector does, inside
        this inbox's own locked sections too: no lock (a deque's append is atomic), read as an
        overflowed release is, once the inbox is empty. After the engine thread stopped it is
        moot: the images still held were let go then."""
        if not self.stopped:
            self._overflow.append(message)

    def check_open(self) -> None:
        """New work is refused (EngineClosedError) once the engine failed or closed: by `post`, and
        by callers before they prepare it (tokens, crops; in a forked process that work had touched
        locks the fork may have left held)."""
        if self.error is not None:
            raise EngineClosedError(f"the engine failed: {self.error}") from self.error
        if self._closed:
            raise EngineClosedError(self.closed_why)

    def wake(self) -> None:
        """From the vision thread: an encoding is done (a full inbox is being drained anyway)."""
        try:
            self.queue.put_nowait(("wake", None))
        except queue.Full:
            pass

    def close(self) -> None:
        """No new work from now on; releases and cancels still come."""
        with self._lock:
            self._closed = True

    def forked(self, why: str) -> list:
        """In a process forked from the engine's: no engine thread reads this inbox there. New
        work is refused with `why` (taken, it had waited for ever), releases and cancels are moot.
        Returns the requests (Sequences) posted and not yet read, which no thread will read here."""
        self._lock = threading.Lock()  # a thread of the parent may have held it at the fork
        self._closed, self.stopped, self.closed_why = True, True, why
        # The queue's own lock may be held too: read its deque directly (no other thread runs here).
        unread = [m[1] for m in [*self._own, *self.queue.queue] if m[0] == "request"]
        self.queue, self._own = queue.Queue(maxsize=self.queue.maxsize), deque()
        return unread

    def fail(self, error: BaseException) -> None:
        with self._lock:
            self.error = error

    # ------------------------------------------------------------------ engine thread

    def next(self, block: bool) -> tuple[str, Any] | None:
        """The next message, or None: none at once, or (`block`) within 50 ms."""
        if self._own:
            return self._own.popleft()
        try:
            return self.queue.get(timeout=0.05) if block else self.queue.get_nowait()
        except queue.Empty:
            pass
        with self._lock:
            return self._overflow.popleft() if self._overflow else None

    def holds(self) -> bool:
        """Messages wait in the inbox (not counting those still on their way, or overflowed)."""
        return not self.queue.empty() or bool(self._own)

    def stop_if_quiet(self, force: bool = False) -> bool:
        """The engine thread stops reading when no message is in the inbox or on its way there
        (or `force`): from then on a late release or cancel is dropped. Whether it stopped."""
        with self._lock:
            quiet = self._posting == 0 and self.queue.empty() and not self._own and not self._overflow
            self.stopped = quiet or force
            return self.stopped
