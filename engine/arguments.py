"""A caller's arguments to the Engine, checked where the Engine takes them (engine/engine.py).

Each check raises RequestError with the message the caller sees, in the caller's thread and
before anything is posted to the engine thread; the `checked_` ones return the value as the
engine keeps it. Images are checked by `as_rgb` (engine/request.py), timeouts by `seconds`
(engine/timeouts.py), constraints as they compile (engine/constraint_cache.py).
"""

from __future__ import annotations

import numbers
from typing import Any

import numpy as np

from .errors import RequestError


def checked_priority(priority: Any) -> int:
    if not isinstance(priority, numbers.Integral) or isinstance(priority, bool):
        raise RequestError(f"priority must be an integer, got {priority!r}")
    return int(priority)


def checked_draft(draft: Any, vocab: int) -> list[int]:
    """A request's draft as a list of token ids, each in [0, vocab)."""
    try:  # whole numbers only: 1.7 and "5" had passed as 1 and 5
        draft = [int(t) if isinstance(t, numbers.Integral) and not isinstance(t, bool) else None
                 for t in draft]
    except TypeError:  # not a sequence
        draft = [None]
    if None in draft:
        raise RequestError("draft must be a list of token ids (whole numbers)")
    if any(not 0 <= t < vocab for t in draft):
        raise RequestError(f"draft token ids must be in [0, {vocab})")
    return draft


def check_depth(depth: Any) -> None:
    """Engine.set_pipeline_depth's: 1 or 2."""
    if isinstance(depth, bool) or not isinstance(depth, numbers.Integral) or depth not in (1, 2):
        raise RequestError(f"pipeline depth must be 1 or 2, got {depth!r}")


def check_cancel(cancel: Any) -> None:
    """Engine.close's cancel flag: True or False, nothing that merely reads as one."""
    if not isinstance(cancel, (bool, np.bool_)):  # "no" or "false" from a setting had cancelled every request
        raise RequestError(f"cancel must be True or False, got {cancel!r}")
