"""Dataclasses shared across the engine and its callers."""

from __future__ import annotations

import math
import numbers
import secrets
from dataclasses import dataclass, field, replace

from .errors import RequestError

FINISH_REASONS = ("stop", "length", "cancelled", "error")
MIN_TEMPERATURE, MAX_TEMPERATURE = 1e-6, 1e6


def _real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _integer(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _boolean(x) -> bool:
    return isinstance(x, bool) or type(x).__name__ == "bool_"  # numpy's, read from an array


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 is greedy (our default: captions of a video should not flicker). With
    temperature > 0, top-p sampling; `seed` makes it reproducible, None draws a fresh seed.
    With `ignore_eos`, EOS is kept as an ordinary token and only max_tokens stops.

    `sticky` (greedy only): while the answer repeats the request's draft (e.g. the previous
    video frame's answer), the draft's next token is kept unless the best token's logit is more
    than `sticky` above it (the draft's token is at least exp(-sticky) times as likely). A caption
    then changes when the model reads the frame differently, not when two readings are a coin
    toss apart. 0 (default): plain greedy, the draft never changes the answer."""

    temperature: float = 0.0
    top_p: float = 0.3
    max_tokens: int = 768
    seed: int | None = None
    ignore_eos: bool = False  # keep generating through EOS (benchmarks want fixed lengths)
    sticky: float = 0.0

    def __post_init__(self) -> None:
        # numpy scalars are numbers too (a value read from an array); kept as plain Python ones.
        t, p, n, s, k = (self.temperature, self.top_p, self.max_tokens, self.seed, self.sticky)
        if not _real(t) or not math.isfinite(t) or not (t == 0 or MIN_TEMPERATURE <= t <= MAX_TEMPERATURE):
            # Past these the float32 division by it gives 0 or inf, and the sampler nothing sane.
            raise RequestError(f"temperature must be 0 (greedy) or between {MIN_TEMPERATURE:g} and "
                               f"{MAX_TEMPERATURE:g}, got {t!r}")
        if not _real(p) or not 0 < p <= 1:
            raise RequestError(f"top_p must be in (0, 1], got {p!r}")
        if not _integer(n) or n < 1:
            raise RequestError(f"max_tokens must be an integer >= 1, got {n!r}")
        if s is not None and (not _integer(s) or not 0 <= s < 2**63):
            raise RequestError(f"seed must be an integer in [0, 2**63), got {s!r}")
        if not _real(k) or not math.isfinite(k) or k < 0:
            raise RequestError(f"sticky must be a finite number >= 0, got {k!r}")
        if not _boolean(self.ignore_eos):  # "no" would have meant yes
            raise RequestError(f"ignore_eos must be True or False, got {self.ignore_eos!r}")
        if k > 0 and t > 0:
            raise RequestError("sticky needs greedy decoding (temperature 0)")
        for name, value in (("temperature", float(t)), ("top_p", float(p)), ("max_tokens", int(n)),
                            ("seed", None if s is None else int(s)), ("sticky", float(k)),
                            ("ignore_eos", bool(self.ignore_eos))):
            object.__setattr__(self, name, value)

    def with_seed(self) -> "SamplingParams":
        """A copy whose seed is concrete, so that the run can be repeated."""
        return self if self.seed is not None else replace(self, seed=secrets.randbits(63))


@dataclass
class StageTimings:
    """Milliseconds per stage of one request. preprocess + queue + vision + prefill + decode =
    total: `queue` is the wait from submit to admission and `prefill` from admission to the
    first token, each less the image encoding this request waited for in it (`vision`; see
    Sequence.output). `queue` and `first_token` (submit to the first answer token, not a stage)
    are measured by the engine only."""

    preprocess: float = 0.0
    vision: float = 0.0
    prefill: float = 0.0
    decode: float = 0.0
    total: float = 0.0
    queue: float | None = None
    first_token: float | None = None

    def as_dict(self) -> dict[str, float]:
        return {k: round(v, 3) for k, v in self.__dict__.items() if v is not None}


@dataclass
class RequestOutput:
    text: str
    token_ids: list[int]
    finish_reason: str
    timings: StageTimings = field(default_factory=StageTimings)
    seed: int | None = None

    @property
    def timings_ms(self) -> dict[str, float]:
        return self.timings.as_dict()


@dataclass(frozen=True)
class EngineStats:
    kv_pages_total: int
    kv_pages_free: int
    kv_pages_in_use: int
    running: int
    waiting: int
    images: int
    steps: int
    tokens: int
    device_busy_fraction: float
    tokens_per_s: float
    busy_seconds: float = 0.0  # device busy time and wall time behind the two ratios above, so a
    wall_seconds: float = 0.0  # monitor can difference two snapshots for current rates
    draft_proposed: int = 0  # draft tokens verified, and those that became answer tokens
    draft_accepted: int = 0
    vision_queue: int = 0  # images waiting for the vision thread or in it (CPU, engine/vision_stage.py)
    vision_busy_seconds: float = 0.0  # the vision thread's time encoding (not in busy_seconds)
    # image prefixes that gave their pages back to let a waiting request in, to be encoded again
    # (more ImageRefs or queued prompts than the pool holds; often: a pool too small for the load)
    prefixes_dropped: int = 0
