"""Detect and point: where things are in an image, through the model's region head.

Moondream 2's protocol, batch 1, greedy, as the reference decoder runs (one contiguous KV
buffer, a host sync a step). The prompt is the detect (or point) template around " <object>";
its last hidden state (before the final LayerNorm) is read by the coordinate decoder for an
object's x centre (argmax over the bins, / bins), which goes back in as the next input through
the coordinate encoder (Fourier features) in place of a token embedding; then y the same way;
for detect, the size decoder reads width and height bins (size = 2 ** (bin / (bins - 1) * 10 -
10), a fraction of the image) and the size encoder feeds them back. The next step's token says
whether another object follows (anything but EOS) or not. Coordinates are fractions of the
image's width and height, 0..1.

The embedded tiny model's region head was never trained (its config says `region.trained:
false`): asking it is a RequestError, not boxes drawn at random.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from .errors import RequestError
from .models.loader import LoadedModel
from .reference import ContiguousKV, EncodedImage, ReferenceDecoder

MAX_OBJECTS = 50  # Moondream's default: a prompt's objects stop here if EOS never comes
LOCATE_TASKS = ("detect", "point")


class RegionDecoder:
    def __init__(self, loaded: LoadedModel):
        if not loaded.config.region.trained:
            raise RequestError("this model's region head was not trained (the embedded tiny model's is not): "
                               "detect and point need Moondream 2 weights (--model DIR)")
        self.loaded, self.reference = loaded, ReferenceDecoder(loaded)
        self.model, self.config, self.device = loaded.model, loaded.config, loaded.model.device

    @torch.inference_mode()
    def locate(self, image: np.ndarray | EncodedImage, what: str, task: str = "detect",
               max_objects: int = MAX_OBJECTS) -> dict:
        """{"objects": [{"x_min", "y_min", "x_max", "y_max"}, ...]} for detect, {"points": [{"x",
        "y"}, ...]} for point, fractions of the image, with "timings_ms"."""
        if task not in LOCATE_TASKS:
            raise RequestError(f"task must be one of {', '.join(LOCATE_TASKS)}, got {task!r}")
        if not isinstance(what, str) or not what.strip():
            raise RequestError(f"say what to {task}: the object is empty")
        if not 1 <= max_objects <= MAX_OBJECTS:
            raise RequestError(f"max_objects must be 1..{MAX_OBJECTS}, got {max_objects}")
        t0 = time.perf_counter()
        encoded = image if isinstance(image, EncodedImage) else self.reference.encode_image(image)
        template = getattr(self.config.tokenizer.templates, task)
        ids = list(template.prefix) + self.loaded.tokenizer.encode(" " + what.strip()) + list(template.suffix)
        text, region, cfg = self.model.text, self.model.region, self.config
        pos = cfg.prefix_len
        if pos + len(ids) >= cfg.text.max_context:
            raise RequestError(f"the prompt ({len(ids)} tokens) does not fit in the context")
        kv = ContiguousKV(encoded, cfg.text.max_context, cfg.prefix_len, self.reference.exact)

        def step(x_1TC: torch.Tensor) -> torch.Tensor:
            nonlocal pos
            n = x_1TC.shape[1]
            h = text(x_1TC, torch.arange(pos, pos + n, device=self.device)[None], kv.attender(pos, n))
            pos += n
            return h[:, -1]  # (1, C), before the final LayerNorm: what the region decoders read

        hidden = step(text.embed(torch.tensor([ids], device=self.device)))
        more = int(text.logits(hidden).argmax(-1)) != cfg.tokenizer.eos_id
        found: list[dict] = []
        dtype = hidden.dtype
        per_object = 3 if task == "detect" else 2  # positions: x fed, y fed (, size fed)
        while more and len(found) < max_objects and pos + per_object <= cfg.text.max_context:
            x = self._coordinate(hidden)
            hidden = step(region.encode_coordinate(x.to(dtype))[None])
            y = self._coordinate(hidden)
            fed = region.encode_coordinate(y.to(dtype))[None]
            if task == "detect":
                hidden = step(fed)
                bins_2K = region.decode_size(hidden)[0]
                size = torch.pow(2.0, bins_2K.argmax(-1).float() / (bins_2K.shape[-1] - 1) * 10.0 - 10.0)
                fed = region.encode_size(size.to(dtype))[None, None]
                cx, cy, w, h = float(x), float(y), float(size[0]), float(size[1])
                found.append({"x_min": cx - w / 2, "y_min": cy - h / 2, "x_max": cx + w / 2, "y_max": cy + h / 2})
            else:
                found.append({"x": float(x), "y": float(y)})
            hidden = step(fed)
            more = int(text.logits(hidden).argmax(-1)) != cfg.tokenizer.eos_id
        ms = (time.perf_counter() - t0) * 1000.0
        return {"objects" if task == "detect" else "points": found, "timings_ms": {"total": round(ms, 2)}}

    def _coordinate(self, hidden_1C: torch.Tensor) -> torch.Tensor:
        """(1, 1): the argmax bin over the bins, a fraction of the image."""
        logits_1K = self.model.region.decode_coordinate(hidden_1C).float()
        return (logits_1K.argmax(-1, keepdim=True) / logits_1K.shape[-1])
