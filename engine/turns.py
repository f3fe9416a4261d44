"""Turns between priorities (EngineConfig.lower_turn): while requests of a higher priority keep
waiting, one admission in `lower_turn` goes to the oldest waiting request below the top priority.

`Turns` counts the admissions of the top priority made in a row while a lower one waited
(`count`, as a step launches) and names the request whose turn it is (`lower`, before a step is
planned; the scheduler puts it first where its image can be encoded and its pages are free).
lower_turn 0 is strict priority: no turns. Only the engine thread touches it, as its Batch.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .engine_config import EngineConfig
    from .sequence import Sequence


class Turns:
    def __init__(self, config: EngineConfig):
        self.config = config
        self._higher_run = 0  # admissions of the top priority in a row while a lower one waited

    def lower(self, waiting: deque[Sequence]) -> Sequence | None:
        """The oldest waiting request below the top priority, when it is its turn: after
        `lower_turn` - 1 admissions of the top priority in a row while it waited. With strict
        priority, a live view that always has a frame waiting stopped a video job beside it (its
        frames, a sticky group at a time, queued for seconds: 13x the job's time alone)."""
        n = self.config.lower_turn
        if not n or self._higher_run < n - 1 or not waiting:
            return None
        top = max(s.priority for s in waiting)
        lower = [s for s in waiting if s.priority < top]
        return max(lower, key=lambda s: s.priority) if lower else None  # max: the first, FIFO

    def count(self, admitted: list[Sequence], waited: deque[Sequence]) -> None:
        """`admitted` were just admitted from `waited` (the waiting queue, before they leave it)."""
        if not admitted or not self.config.lower_turn:
            return
        top = max(s.priority for s in waited)
        lower_waited = any(s.priority < top for s in waited)
        for seq in admitted:
            if seq.priority < top:
                self._higher_run = 0
            elif lower_waited:
                self._higher_run += 1
