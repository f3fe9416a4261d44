"""The shipped tiny model: it loads, it sees, and its held-out accuracy does not regress.

Floors sit about 15 points under the accuracy measured on 1000 held-out scenes (EVAL.md) so
that sampling noise on 100 scenes does not trip them; a regression of the weights or of the
model code falls through them.
"""

import numpy as np
import pytest

from engine.models.loader import load_model
from engine.reference import ReferenceDecoder
from engine.types import SamplingParams
from tinyvlm.evaluate import evaluate
from tinyvlm.world import render, sample_scene

FLOORS = {
    "answer_color": 0.82, "answer_count": 0.82, "answer_position": 0.81, "answer_shape": 0.77,
    "answer_shape_large": 0.82, "answer_yesno_shape": 0.78, "answer_yesno_color_shape": 0.82,
    "caption_long_count": 0.82, "caption_normal_objects_1-2": 0.77, "caption_normal_objects_3-4": 0.73,
}
# The same scenes drawn by the second renderer (anti-aliased, other proportions and backgrounds).
FLOORS_SECOND = {
    "answer_color": 0.83, "answer_count": 0.81, "answer_position": 0.80, "answer_shape": 0.79,
    "answer_yesno_shape": 0.77, "answer_yesno_color_shape": 0.82, "caption_long_count": 0.80,
    "caption_normal_objects_1-2": 0.77, "caption_normal_objects_3-4": 0.75,
}


def test_known_greedy_caption_for_a_fixed_frame():
    scene = sample_scene(np.random.default_rng([777, 6]), 640, 360, n_objects=1, proportions=False)
    (obj,) = scene.objects
    assert (obj.color, obj.shape, obj.position(640, 360)) == ("yellow", "triangle", "top center")
    out = ReferenceDecoder(load_model("tiny")).generate(render(scene), caption="normal",
                                                         params=SamplingParams(max_tokens=40))
    assert out.text == "a yellow triangle in the top center" and out.finish_reason == "stop"


def test_heldout_accuracy_stays_above_the_floors():
    report = evaluate("tiny", n=100)
    acc = report["accuracy"]
    low = {k: (acc.get(k), floor) for k, floor in FLOORS.items() if acc.get(k, 0.0) < floor}
    assert not low, low
    n = report["counts"]  # the size split covers every asked object and every captioned one
    assert n["answer_shape_small"] + n["answer_shape_large"] == n["answer_shape"]
    assert n["caption_normal_objects_small"] + n["caption_normal_objects_large"] == \
        n["caption_normal_objects_1-2"] + n["caption_normal_objects_3-4"]
    # every object a normal caption misses is counted once, under one kind of miss
    objects = n["caption_normal_objects_1-2"] + n["caption_normal_objects_3-4"]
    named = acc["caption_normal_objects_1-2"] * n["caption_normal_objects_1-2"] + \
        acc["caption_normal_objects_3-4"] * n["caption_normal_objects_3-4"]
    assert sum(report["caption_normal_misses"].values()) * objects == pytest.approx(objects - named, abs=0.5)


def test_accuracy_carries_over_to_a_second_renderer():
    report = evaluate("tiny", n=100, renderer="second")
    assert report["renderer"] == "second"
    acc = report["accuracy"]
    low = {k: (acc.get(k), floor) for k, floor in FLOORS_SECOND.items() if acc.get(k, 0.0) < floor}
    assert not low, low
