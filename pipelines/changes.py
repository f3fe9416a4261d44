"""Answer changes: what a camera watcher wants to hear about ("the door is now open"), rather than
the same answer sixty times a second; for `live --changes` and `video --changes`.

Each prompt's answer is followed on its own (and each source's, in `video`). A new answer counts
once it has come `hold` frames in a row (completed frames; stale ones never complete; in `video`,
the frames processed), so one misread frame does not make two events; it then dates from the
first of those frames. The first answer is a change from nothing (`previous` None). An answer
that only names the same things in another order (or in another case, or with other end
punctuation) is the same answer (`answer_key`): a caption that lists three objects in a new order
is not an event, one that gives two of them each other's colours is. A constrained answer (a
regex, a JSON schema: a format the user chose) keeps its order: `1,2` then `2,1` is a change.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Collection, Hashable

import numpy as np

from .live_result import LiveResult
from .prompts import prompt_key
from .sinks import FrameResult, JsonlSink, save_snapshot


_PARTS = re.compile(r"[,;]|\band\b")


def answer_key(text: str, in_order: bool = False) -> tuple[tuple[str, ...], ...]:
    """What two answers must share to be the same: per line (one per prompt, when a frame has
    several), the parts between commas, semicolons and "and", lower-cased, their spacing and end
    punctuation normalised, in any order ("black and white" is "white and black"). Conservative:
    any change inside a part still differs, so swapped colours ("a red star and a blue square"
    against "a blue star and a red square") are a change. On the cuts sample, 5 of the 20
    caption changes `video --changes` reported before were reorders. `in_order`: the parts in
    the order they come (a constrained answer's)."""
    lines = []
    for line in text.lower().splitlines() or [""]:
        parts = (" ".join(p.split()).strip(" .!?'\"") for p in _PARTS.split(line))
        kept = [p for p in parts if p]
        lines.append(tuple(kept if in_order else sorted(kept)))
    return tuple(lines)


@dataclass(frozen=True)
class Change:
    prompt: Hashable  # what is followed: in a live session, the index among its prompts
    text: str
    previous: str | None
    since_pts: float  # the first frame that gave the new answer
    previous_since_pts: float | None
    since_kept: object = None  # what `observe` was given to keep with that first frame (its picture)


class AnswerChanges:
    """Feed it answers in order, per key (`observe`) or a live frame's at once (`update`); each
    returns the answers that changed."""

    def __init__(self, hold: int = 1):
        if isinstance(hold, bool) or not isinstance(hold, int) or hold < 1:  # nan acted as 1, inf held for ever
            raise ValueError(f"hold must be an integer >= 1, got {hold!r}")
        self.hold = hold
        # key -> (answer, since pts, its answer_key)
        self._current: dict[Hashable, tuple[str, float, tuple]] = {}
        # key -> (the new answer's answer_key, first pts, frames seen, what was kept with the first)
        self._pending: dict[Hashable, tuple[tuple, float, int, object]] = {}
        self.count = 0

    def observe(self, key: Hashable, text: str, pts: float, keep: object = None,
                in_order: bool = False) -> Change | None:
        """The next answer for `key` (a prompt), from the frame at `pts`; the change it makes, if any
        (with this frame's wording of the new answer). `keep` (a frame, its picture) comes back as
        the change's `since_kept` if this frame is the first of it: the frame the answer began on,
        `hold - 1` frames before the one that makes it a change. `in_order`: a constrained
        answer, compared in its order (`answer_key`)."""
        text = text.strip()
        current = self._current.get(key)
        same = current[2] if current is not None and current[0] == text else answer_key(text, in_order)  # mostly a repeat
        if current is not None and current[2] == same:
            self._pending.pop(key, None)  # a flicker that did not hold
            return None
        seen = self._pending.get(key)
        first, n, kept = (seen[1], seen[2] + 1, seen[3]) if seen and seen[0] == same else (pts, 1, keep)
        if n < self.hold:
            self._pending[key] = (same, first, n, kept)
            return None
        self._pending.pop(key, None)
        self._current[key] = (text, first, same)
        self.count += 1
        return Change(key, text, current[0] if current else None, first, current[1] if current else None, kept)

    def update(self, result: LiveResult, in_order: Collection[int] = ()) -> list[Change]:
        """A live frame's answers, in prompt order: the changes they make (keyed by prompt index),
        each keeping the frame it began on (`since_kept`). `in_order`: the indices of the
        constrained prompts."""
        changes = [self.observe(i, out.text, result.frame.pts, result.frame, i in in_order)
                   for i, out in enumerate(result.outputs)]
        return [c for c in changes if c is not None]

    @staticmethod
    def records(result: LiveResult, changes: list[Change]) -> list[dict]:
        """The log lines of the changed answers: `LiveResult.records()`' fields plus `previous`
        (the answer it replaced, null for the first) and `since` (the pts it first came at)."""
        rows = result.records()
        return [{**rows[c.prompt], "previous": c.previous, "since": round(c.since_pts, 6)} for c in changes]


class ChangedAnswersSink:
    """`video --changes`: a JSONL sink that gets only the answers that changed, per source and
    prompt, each line `FrameResult`'s fields plus `previous` and `since` (as in `live --changes`);
    with `snapshots`, the frame each new answer began on is saved there as a JPEG (`snapshot` in
    the line), named by source and frame index so that names sort by video, then time. Thread-safe, like the
    JSONL it writes: several files captioned at once may share it."""

    holds_done = True  # never given a resumed run's answers: --changes does not resume

    def __init__(self, sink: JsonlSink, hold: int = 1, snapshots: Path | None = None,
                 in_order: Collection[tuple] = ()):
        self.sink, self.changes, self.snapshots = sink, AnswerChanges(hold), snapshots
        self.in_order = in_order  # the prompt keys of the constrained prompts (`constrained`)
        self.needs_rgb = snapshots is not None
        self._lock = threading.Lock()

    def write_frame(self, results: list[FrameResult], rgb: np.ndarray | None = None) -> None:
        with self._lock:  # one file's frames arrive in order; the lock keeps each file's in order
            records, shots = [], {}
            for r in results:
                key = prompt_key(r.prompt)
                c = self.changes.observe((r.source, key), r.text, r.pts, (r.index, rgb), key in self.in_order)
                if c is None:
                    continue
                records.append({**r.to_dict(), "previous": c.previous, "since": round(c.since_pts, 6)})
                index, first_rgb = c.since_kept
                if self.snapshots is not None and first_rgb is not None:
                    # the frame the answer began on (with --hold N, N-1 frames before this one), as
                    # the web UI's pictures; once for the prompts that changed on it. An OSError
                    # fails this video's outputs
                    if index not in shots:
                        shots[index] = str(save_snapshot(self.snapshots, r.source, index, first_rgb))
                    records[-1]["snapshot"] = shots[index]
            if records:
                self.sink.write_records(records)

    def close(self, end: float | None = None) -> None:
        self.sink.close(end)
