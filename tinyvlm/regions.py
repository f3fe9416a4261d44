"""Detect and point in training: Moondream 2's region protocol on the world's scenes.

A region block is a detect (or point) prompt for an object phrase, then one group of region
positions per matching object, left to right: the x centre and the y centre fed back through
the coordinate encoder, and for detect the size (width, height) through the size encoder. What
each position is trained to give is what `engine.region_decoder` reads there:

- the last prompt position and the last position of each object: the token, `coord_id` when
  another object follows, EOS when none does; and with one following, its x (coordinate decoder);
- an x position: the y (coordinate decoder);
- a y position: for detect the size (size decoder); for point the token and next x as above.

Phrases: a shape ("star"), a colour and a shape ("red star"), a colour ("red"), or "shape" for
every object; half of the shape and colour-shape phrases name something absent (EOS at once).
Boxes are the drawn pixels' tight box (a circle's or a polygon's), fractions of the frame.
In training (`with_regions`, `region_loss`), each region position's input replaces its placeholder
embedding, and the coordinate and size decoders are scored on Gaussian soft targets over bins.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from engine.config import ModelConfig
from engine.models.moondream import MoondreamModel
from engine.models.tokenizer import Tokenizer

from .world import COLORS, SHAPES, Obj, Scene

ALL = "shape"  # the phrase that names every object


@dataclass
class RegionBlock:
    prompt: list[int]
    answer: list[int]  # placeholder ids for the region positions, then EOS
    coord_in: list[tuple[int, float]]  # (offset in the block, coordinate fed there)
    size_in: list[tuple[int, tuple[float, float]]]  # (offset, (width, height) fed there)
    no_token: list[int]  # offsets whose next-token target is dropped (they predict a coordinate or a size)
    coord_target: list[tuple[int, int]]  # (offset, bin)
    size_target: list[tuple[int, tuple[int, int]]]  # (offset, (width bin, height bin))


def tight_box(o: Obj, width: int, height: int) -> tuple[float, float, float, float]:
    """(x_min, y_min, x_max, y_max) of the drawn object, fractions of the frame, clipped to it."""
    if o.shape == "circle":
        r = o.extent / 2  # as drawn (data._draw_objects, world.render)
        xs, ys = (o.cx - r, o.cx + r), (o.cy - r, o.cy + r)
    else:
        pts = o.polygon()
        xs, ys = [p[0] for p in pts], [p[1] for p in pts]
    return (max(0.0, min(xs) / width), max(0.0, min(ys) / height),
            min(1.0, max(xs) / width), min(1.0, max(ys) / height))


def matches(phrase: str, o: Obj) -> bool:
    words = phrase.split()
    if words == [ALL]:
        return True
    if len(words) == 1:
        return o.shape == words[0] or o.color == words[0]
    return o.color == words[0] and o.shape == words[1]


def sample_phrase(scene: Scene, rng: np.random.Generator) -> str:
    objs, kind = scene.objects, rng.random()
    o = objs[int(rng.integers(len(objs)))]
    present = rng.random() < 0.5
    if kind < 0.35:
        return o.shape if present else SHAPES[int(rng.integers(len(SHAPES)))]
    if kind < 0.7:
        if present:
            return f"{o.color} {o.shape}"
        return f"{list(COLORS)[int(rng.integers(len(COLORS)))]} {SHAPES[int(rng.integers(len(SHAPES)))]}"
    if kind < 0.9:
        return o.color
    return ALL


def located(scene: Scene, phrase: str) -> list[tuple[float, float, float, float]]:
    """The tight boxes of the objects the phrase names, left to right (the order trained)."""
    boxes = [tight_box(o, scene.width, scene.height) for o in scene.objects if matches(phrase, o)]
    return sorted(boxes, key=lambda b: (b[0] + b[2], b[1] + b[3]))


def coord_bin(v: float, bins: int) -> int:
    """The decoder reads a coordinate as bin / bins."""
    return min(bins - 1, max(0, int(round(v * bins))))


def size_bin(v: float, bins: int) -> int:
    """The decoder reads a size as 2 ** (bin / (bins - 1) * 10 - 10), a fraction of the frame."""
    return min(bins - 1, max(0, int(round((math.log2(max(v, 2 ** -10)) + 10) / 10 * (bins - 1)))))


def region_block(scene: Scene, task: str, phrase: str, config: ModelConfig, tokenizer: Tokenizer) -> RegionBlock:
    tk, rc = config.tokenizer, config.region
    template = getattr(tk.templates, task)
    prompt = list(template.prefix) + tokenizer.encode(" " + phrase) + list(template.suffix)
    bins, size_bins = rc.coord_out_dim, rc.size_out_dim // 2
    answer: list[int] = []
    b = RegionBlock(prompt, answer, [], [], [], [], [])
    decide = len(prompt) - 1  # the position whose token says whether an object follows
    for x0, y0, x1, y1 in located(scene, phrase):
        cx, cy = coord_bin((x0 + x1) / 2, bins), coord_bin((y0 + y1) / 2, bins)
        b.coord_target.append((decide, cx))
        at = len(prompt) + len(answer)
        b.coord_in.append((at, cx / bins))  # fed as the decoder reads it back
        b.coord_target.append((at, cy))
        b.no_token.append(at)
        b.coord_in.append((at + 1, cy / bins))
        answer += [tk.coord_id, tk.coord_id]
        if task == "detect":
            w, h = size_bin(x1 - x0, size_bins), size_bin(y1 - y0, size_bins)
            b.size_target.append((at + 1, (w, h)))
            b.no_token.append(at + 1)
            b.size_in.append((at + 2, tuple(2.0 ** (k / (size_bins - 1) * 10 - 10) for k in (w, h))))
            answer.append(tk.size_id)
        decide = len(prompt) + len(answer) - 1
    answer.append(tk.eos_id)
    return b


def region_blocks(scene: Scene, rng: np.random.Generator, config: ModelConfig, tokenizer: Tokenizer,
                  k: int) -> list[RegionBlock]:
    """k blocks, detect and point in turn."""
    return [region_block(scene, ("detect", "point")[i % 2], sample_phrase(scene, rng), config, tokenizer)
            for i in range(k)]


def with_regions(model: MoondreamModel, text_BTC: torch.Tensor, batch) -> torch.Tensor:
    """The text embeddings with each region position's input put in place of its placeholder token:
    the coordinate or size encoder's, as the region decoder feeds them."""
    if batch.coord_in_idx is None or not (len(batch.coord_in_idx) or len(batch.size_in_idx)):
        return text_BTC
    text_BTC = text_BTC.clone()
    region = model.region
    for idx, fed in ((batch.coord_in_idx, region.encode_coordinate(batch.coord_in) if len(batch.coord_in) else None),
                     (batch.size_in_idx, region.encode_size(batch.size_in) if len(batch.size_in) else None)):
        if fed is not None:
            text_BTC[idx[:, 0], idx[:, 1]] = fed.to(text_BTC.dtype)
    return text_BTC


# Bins are ordered: a target spread over its neighbours (a Gaussian of this many bins) rewards a
# near miss over a far one, where a one-bin target scores every miss alike. A one-bin target left
# the coordinate and size losses near chance for the first thousand steps (thirty-third session).
REGION_TARGET_SIGMA_BINS = 2.0


def _soft(bins_N: torch.Tensor, k: int) -> torch.Tensor:
    """(N, k): a Gaussian about each target bin, summing to 1."""
    d = torch.arange(k, dtype=torch.float32)[None] - bins_N.float()[:, None]
    return torch.softmax(-0.5 * (d / REGION_TARGET_SIGMA_BINS) ** 2, dim=-1)


def region_loss(model: MoondreamModel, h_BLC: torch.Tensor, batch) -> torch.Tensor:
    """Cross-entropy of the coordinate bins and the size bins where the region blocks want them,
    against targets spread over the neighbouring bins."""
    loss = h_BLC.new_zeros((), dtype=torch.float32)
    if batch.coord_target_idx is None:
        return loss
    idx = batch.coord_target_idx
    if len(idx):
        logits = model.region.decode_coordinate(h_BLC[idx[:, 0], idx[:, 1]]).float()
        loss = loss + F.cross_entropy(logits, _soft(batch.coord_target, logits.shape[-1]))
    idx = batch.size_target_idx
    if len(idx):
        logits = model.region.decode_size(h_BLC[idx[:, 0], idx[:, 1]]).float().flatten(0, 1)
        loss = loss + F.cross_entropy(logits, _soft(batch.size_target.flatten(), logits.shape[-1]))
    return loss
