"""Detect and point: where things are in an image, through the model's region head.

Moondream 2's protocol, greedy, as the reference decoder runs (a contiguous KV buffer, a host
sync a step), for one image or several in step (`locate_batch`: the same prompt on every
image). The prompt is the detect (or point) template around " <object>";
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

    def locate(self, image: np.ndarray | EncodedImage, what: str, task: str = "detect",
               max_objects: int = MAX_OBJECTS) -> dict:
        """{"objects": [{"x_min", "y_min", "x_max", "y_max"}, ...]} for detect, {"points": [{"x",
        "y"}, ...]} for point, fractions of the image, with "timings_ms"."""
        return self.locate_batch([image], what, task, max_objects)[0]

    @torch.inference_mode()
    def locate_batch(self, images: list[np.ndarray | EncodedImage], what: str, task: str = "detect",
                     max_objects: int = MAX_OBJECTS) -> list[dict]:
        """`locate` for several images at once, one result each, the same as each alone. The same
        prompt keeps every image's sequence in step (prompt, x, y, size, "another?"), so one
        forward serves them all; an image whose objects end leaves the batch. Each result's
        "timings_ms" holds "total", the batch's time (what each image waited); "batch" is the
        number of images in it (a count: kept out of the timings, which are all milliseconds)."""
        if task not in LOCATE_TASKS:
            raise RequestError(f"task must be one of {', '.join(LOCATE_TASKS)}, got {task!r}")
        if not isinstance(what, str) or not what.strip():
            raise RequestError(f"say what to {task}: the object is empty")
        if not 1 <= max_objects <= MAX_OBJECTS:
            raise RequestError(f"max_objects must be 1..{MAX_OBJECTS}, got {max_objects}")
        if not images:
            return []
        t0 = time.perf_counter()
        encoded = [im if isinstance(im, EncodedImage) else self.reference.encode_image(im) for im in images]
        template = getattr(self.config.tokenizer.templates, task)
        ids = list(template.prefix) + self.loaded.tokenizer.encode(" " + what.strip()) + list(template.suffix)
        text, region, cfg = self.model.text, self.model.region, self.config
        pos = cfg.prefix_len
        per_object = 3 if task == "detect" else 2  # positions: x fed, y fed (, size fed)
        # Without room for one object the model is never asked where: "none found" would be untrue.
        if pos + len(ids) + per_object > cfg.text.max_context:
            raise RequestError(f"the prompt ({len(ids)} tokens) does not fit in the context with room for one object")
        kv = BatchKV(encoded, cfg.text.max_context, cfg.prefix_len, self.reference.exact)
        rows = torch.arange(len(encoded))  # the images still in the batch, in the batch's order

        def step(x_BTC: torch.Tensor) -> torch.Tensor:
            nonlocal pos
            n = x_BTC.shape[1]
            h = text(x_BTC, torch.arange(pos, pos + n, device=self.device)[None], kv.attender(pos, n))
            pos += n
            return h[:, -1]  # (B, C), before the final LayerNorm: what the region decoders read

        def another(hidden_BC: torch.Tensor) -> torch.Tensor:
            return text.logits(hidden_BC).argmax(-1).cpu() != cfg.tokenizer.eos_id

        hidden = step(text.embed(torch.tensor([ids] * len(encoded), device=self.device)))
        found: list[list[dict]] = [[] for _ in encoded]
        dtype = hidden.dtype
        more = another(hidden)
        n_found = 0  # objects found so far by each image in the batch (all the same: in step)
        while True:
            if not bool(more.all()):  # those whose objects ended leave
                keep = more.nonzero().flatten()
                rows, hidden = rows[keep], hidden[keep.to(self.device)]
                kv.keep(keep.to(self.device))
            if not len(rows) or n_found >= max_objects or pos + per_object > cfg.text.max_context:
                break
            x = self._coordinate(hidden)
            hidden = step(region.encode_coordinate(x.to(dtype))[:, None])
            y = self._coordinate(hidden)
            fed = region.encode_coordinate(y.to(dtype))[:, None]
            xs, ys = x[:, 0].tolist(), y[:, 0].tolist()
            if task == "detect":
                hidden = step(fed)
                bins_B2K = region.decode_size(hidden)
                size_B2 = torch.pow(2.0, bins_B2K.argmax(-1).float() / (bins_B2K.shape[-1] - 1) * 10.0 - 10.0)
                fed = region.encode_size(size_B2.to(dtype))[:, None]
                for i, cx, cy, (w, h) in zip(rows.tolist(), xs, ys, size_B2.tolist()):
                    found[i].append({"x_min": cx - w / 2, "y_min": cy - h / 2, "x_max": cx + w / 2,
                                     "y_max": cy + h / 2})
            else:
                for i, cx, cy in zip(rows.tolist(), xs, ys):
                    found[i].append({"x": cx, "y": cy})
            n_found += 1
            hidden = step(fed)
            more = another(hidden)
        ms = round((time.perf_counter() - t0) * 1000.0, 2)
        key = "objects" if task == "detect" else "points"
        return [{key: places, "batch": len(encoded), "timings_ms": {"total": ms}} for places in found]

    def _coordinate(self, hidden_BC: torch.Tensor) -> torch.Tensor:
        """(B, 1): the argmax bin over the bins, a fraction of the image."""
        logits_BK = self.model.region.decode_coordinate(hidden_BC).float()
        return (logits_BK.argmax(-1, keepdim=True) / logits_BK.shape[-1])


class BatchKV(ContiguousKV):
    """Several sequences' keys and values, in step (the same positions), in one buffer of
    max_context positions under one mask, as `ContiguousKV` holds one (its `attender` serves)."""

    def __init__(self, prefixes: list[EncodedImage], capacity: int, prefix_len: int, exact: bool):
        super().__init__(prefixes[0], capacity, prefix_len, exact)
        if len(prefixes) > 1:  # one buffer for all (a copy of each alone, then a join, doubles the peak)
            n_layers, _, h, self.capacity, d = self.k.shape
            self.k = self.k.new_zeros((n_layers, len(prefixes), h, self.capacity, d))
            self.v = torch.zeros_like(self.k)
            for i, p in enumerate(prefixes):
                self.k[:, i:i + 1, :, :p.k.shape[3]] = p.k
                self.v[:, i:i + 1, :, :p.v.shape[3]] = p.v

    def keep(self, rows: torch.Tensor) -> None:
        self.k, self.v = self.k[:, rows], self.v[:, rows]
