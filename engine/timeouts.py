"""The caller's waiting limits (`result(timeout)`, `wait(stall)`, `stream(timeout)`,
`close(timeout)`), checked before they reach `threading`: there `math.inf`, the usual "for
ever", was an OverflowError, "5" a TypeError from inside its comparisons, and NaN waited not at
all (or, in `close`, a ValueError)."""

from __future__ import annotations

import math
import numbers
import threading

from .errors import RequestError


def seconds(value: object, name: str = "timeout") -> float | None:
    """None (no limit) or a number of seconds for threading's waits: past `threading.TIMEOUT_MAX`
    (~292 years), infinity included, it is no limit; below 0, no wait, as threading reads it."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or math.isnan(value):
        raise RequestError(f"{name} must be a number of seconds or None, got {value!r}")
    value = float(value)
    return None if value > threading.TIMEOUT_MAX else value
