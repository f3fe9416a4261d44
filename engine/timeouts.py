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
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise RequestError(f"{name} must be a number of seconds or None, got {value!r}")
    try:
        limit = float(value)
    except OverflowError:  # an int past a float's range (10**400): it had been an OverflowError here
        return None if value > 0 else 0.0
    if math.isnan(limit):
        raise RequestError(f"{name} must be a number of seconds or None, got {value!r}")
    return None if limit > threading.TIMEOUT_MAX else limit
