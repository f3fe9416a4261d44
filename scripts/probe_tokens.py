"""How much colour and shape a tiny model's image tokens hold; prints one JSON object.

    .venv/bin/python scripts/probe_tokens.py [--model tiny|DIR] [--fit 3000] [--test 800]

For every object of a scene, the image token of the grid cell under its centre (the tokens the
decoder attends to) is read off the vision encoder. A linear classifier is fitted on those tokens
for scenes of a seed range used by neither training nor the eval, and scored on the held-out
scenes of `vlmstream eval-tiny`: shape (all, small and large objects) and colour. It separates
what the vision side sees from what the decoder makes of it: a token that holds an object's shape
poorly cannot be answered about well (EVAL.md, eighth session).
"""

import argparse
import json
import sys
import time

import numpy as np
import torch

from engine.errors import VlmstreamError
from engine.models.loader import load_model
from tinyvlm.data import HELDOUT_SEED, centre_cell
from tinyvlm.world import COLORS, SHAPES, render, sample_scene

FIT_SEED = 777  # neither training's seeds ([0, i]) nor the held-out ones


def centre_tokens(model, seed: int, n: int) -> dict[str, torch.Tensor]:
    grid = model.config.vision.grid
    rows = {"x": [], "shape": [], "colour": [], "small": []}
    for i in range(n):
        scene = sample_scene(np.random.default_rng([seed, i]))
        crops, tiling = model.preprocess(render(scene))
        tokens = model.image_tokens(crops, tiling).float().reshape(grid, grid, -1)
        for o in scene.objects:
            rows["x"].append(tokens[centre_cell(scene, o, grid)])
            rows["shape"].append(SHAPES.index(o.shape))
            rows["colour"].append(list(COLORS).index(o.color))
            rows["small"].append(o.size == "small")
    return {"x": torch.stack(rows["x"]), "shape": torch.tensor(rows["shape"]),
            "colour": torch.tensor(rows["colour"]), "small": torch.tensor(rows["small"])}


def linear_probe(x_fit: torch.Tensor, y_fit: torch.Tensor, x_test: torch.Tensor, classes: int,
                 steps: int = 1500) -> torch.Tensor:
    """Predicted classes of x_test from a standardised linear classifier fitted on (x_fit, y_fit)."""
    torch.manual_seed(0)
    mu, sd = x_fit.mean(0), x_fit.std(0) + 1e-5
    head = torch.nn.Linear(x_fit.shape[1], classes)
    opt = torch.optim.AdamW(head.parameters(), 3e-3, weight_decay=1e-2)
    xs = (x_fit - mu) / sd
    for _ in range(steps):
        loss = torch.nn.functional.cross_entropy(head(xs), y_fit)
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        return head((x_test - mu) / sd).argmax(-1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--fit", type=int, default=3000, help="scenes to fit the probe on")
    ap.add_argument("--test", type=int, default=800, help="held-out scenes to score it on")
    args = ap.parse_args()
    if args.fit < 1 or args.test < 1:
        ap.error("--fit and --test must be at least 1")
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    try:
        model = load_model(args.model).model.float().eval()
    except VlmstreamError as e:
        print(f"probe_tokens: {e}", file=sys.stderr)
        sys.exit(2)
    fit, test = centre_tokens(model, FIT_SEED, args.fit), centre_tokens(model, HELDOUT_SEED, args.test)
    shape_ok = linear_probe(fit["x"], fit["shape"], test["x"], len(SHAPES)) == test["shape"]
    colour_ok = linear_probe(fit["x"], fit["colour"], test["x"], len(COLORS)) == test["colour"]
    small = test["small"]
    print(json.dumps({
        "model": args.model, "fit_objects": len(fit["shape"]), "test_objects": len(test["shape"]),
        "shape": round(shape_ok.float().mean().item(), 4),
        "shape_small": round(shape_ok[small].float().mean().item(), 4),
        "shape_large": round(shape_ok[~small].float().mean().item(), 4),
        "colour": round(colour_ok.float().mean().item(), 4),
        "seconds": round(time.perf_counter() - t0, 1),
    }))


if __name__ == "__main__":
    main()
