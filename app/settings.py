"""The web UI's settings (its Settings tab): the model, device and precision the engine loads,
and how every request samples. One set for the server, changed by `Service.apply`, which takes
them only as `checked` gives them back: numbers in range, whole where they count."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from app.errors import UIError


@dataclass(frozen=True)
class Settings:
    model: str = "tiny"
    device: str = "cpu"
    dtype: str | None = None
    temperature: float = 0.0
    max_tokens: int = 64  # the tiny model's long captions take up to 44 tokens (32 cut them mid-sentence)
    pipelined: bool = True
    sticky: float = 2.0  # answers keep the previous frame's (pipelines.live.LIVE_STICKY); 0 = off
    # A new answer gets a picture in the live tabs' Changes once it has held this many frames in a
    # row: at 60 fps a small object's shape read one way for a frame or two is a line of the log,
    # not one of the 16 pictures.
    hold: int = 3


def checked(settings: Settings) -> Settings:
    """The settings with their whole numbers as int and the others as float; a UIError for a
    number out of range, not finite, or not a number."""
    numbers = (settings.max_tokens, settings.temperature, settings.sticky, settings.hold)
    if (not all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in numbers)
            or settings.max_tokens != int(settings.max_tokens) or settings.hold != int(settings.hold)
            or settings.max_tokens < 1 or not 0.0 <= settings.temperature <= 2.0
            or not 0.0 <= settings.sticky <= 10.0 or not 1 <= settings.hold <= 600):
        raise UIError("max tokens must be a whole number >= 1, temperature within 0..2, steadiness within "
                      "0..10 and frames a change holds a whole number within 1..600")
    return replace(settings, max_tokens=int(settings.max_tokens), hold=int(settings.hold),
                   temperature=float(settings.temperature), sticky=float(settings.sticky))
