"""Answer changes of a live session: what a camera watcher wants to hear about ("the door is now
open"), rather than the same answer sixty times a second.

Each prompt's answer is followed on its own. A new answer counts once it has come `hold` frames
in a row (completed frames; stale ones never complete), so one misread frame does not make two
events; it then dates from the first of those frames. The first answer of a session is a change
from nothing (`previous` None).
"""

from __future__ import annotations

from dataclasses import dataclass

from .live import LiveResult


@dataclass(frozen=True)
class Change:
    prompt: int  # index among the session's prompts
    text: str
    previous: str | None
    since_pts: float  # the first frame that gave the new answer
    previous_since_pts: float | None


class AnswerChanges:
    """Feed it a session's results in order; `update` returns the answers that changed."""

    def __init__(self, hold: int = 1):
        if hold < 1:
            raise ValueError("hold must be >= 1")
        self.hold = hold
        self._current: dict[int, tuple[str, float]] = {}  # prompt -> (answer, since pts)
        self._pending: dict[int, tuple[str, float, int]] = {}  # prompt -> (new answer, first pts, frames seen)
        self.count = 0

    def update(self, result: LiveResult) -> list[Change]:
        changes = []
        for i, out in enumerate(result.outputs):
            text, pts = out.text.strip(), result.frame.pts
            current = self._current.get(i)
            if current is not None and current[0] == text:
                self._pending.pop(i, None)  # a flicker that did not hold
                continue
            seen = self._pending.get(i)
            first, n = (seen[1], seen[2] + 1) if seen and seen[0] == text else (pts, 1)
            if n < self.hold:
                self._pending[i] = (text, first, n)
                continue
            self._pending.pop(i, None)
            self._current[i] = (text, first)
            changes.append(Change(i, text, current[0] if current else None, first, current[1] if current else None))
        self.count += len(changes)
        return changes

    @staticmethod
    def records(result: LiveResult, changes: list[Change]) -> list[dict]:
        """The log lines of the changed answers: `LiveResult.records()`' fields plus `previous`
        (the answer it replaced, null for the first) and `since` (the pts it first came at)."""
        rows = result.records()
        return [{**rows[c.prompt], "previous": c.previous, "since": round(c.since_pts, 6)} for c in changes]
