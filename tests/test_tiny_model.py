"""The shipped tiny model: it loads, it sees, and its held-out accuracy does not regress.

Floors sit about 15 points under the accuracy measured on 1000 held-out scenes (EVAL.md) so
that sampling noise on 100 scenes does not trip them; a regression of the weights or of the
model code falls through them.
"""

import numpy as np
import pytest

from engine import Engine
from engine.models.loader import TINY_DIR, load_model, read_config
from engine.models.prompt import asked_prompt
from engine.reference import ReferenceDecoder
from engine.types import SamplingParams
from tinyvlm.evaluate import REWORDINGS, eval_questions, evaluate, reworded
from tinyvlm.language import CAPTION_REWRITES, QUESTION_REWRITES, questions
from tinyvlm.world import render, sample_scene

FLOORS = {
    "answer_color": 0.82, "answer_count": 0.82, "answer_position": 0.81, "answer_shape": 0.77,
    "answer_shape_large": 0.82, "answer_yesno_shape": 0.78, "answer_yesno_color_shape": 0.82,
    "caption_long_count": 0.82, "caption_normal_objects_1-2": 0.77, "caption_normal_objects_3-4": 0.73,
    "answer_reworded": 0.81,
}
# The same scenes drawn by the second renderer (anti-aliased, other proportions and backgrounds).
FLOORS_SECOND = {
    "answer_color": 0.83, "answer_count": 0.81, "answer_position": 0.80, "answer_shape": 0.79,
    "answer_yesno_shape": 0.77, "answer_yesno_color_shape": 0.82, "caption_long_count": 0.80,
    "caption_normal_objects_1-2": 0.77, "caption_normal_objects_3-4": 0.75, "answer_reworded": 0.81,
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


def test_the_trained_questions_are_asked_as_they_are():
    config = read_config(TINY_DIR)
    tok = config.tokenizer  # the shipped config is train-tiny's
    assert tok.question_rewrites == QUESTION_REWRITES and tok.caption_rewrites == CAPTION_REWRITES
    for i in range(300):
        rng = np.random.default_rng([5, i])
        scene = sample_scene(rng)
        for q, _ in questions(scene, rng, k=20) + list(eval_questions(scene, rng).values()):
            assert asked_prompt(config, q) == {"question": q}


@pytest.mark.parametrize("asked, trained", [
    ("how many shapes", "How many shapes are there?"),
    ("Count the objects in the picture.", "How many shapes are there?"),
    ("How many things are there in this frame?", "How many shapes are there?"),
    ("What colour is the  STAR", "What color is the star?"),
    ("What's the colour of that triangle?", "What color is the triangle?"),
    ("Which shape is purple?", "What shape is the purple object?"),
    ("What is the white one?", "What shape is the white object?"),
    ("Do you see any circles?", "Is there a circle?"),
    ("Can you see an orange square in the image?", "Is there a orange square?"),  # as trained: "a orange"
    ("Are there black stars?", "Is there a black star?"),
    ("Where's the green circle located?", "Where is the green circle?"),
    ("What is the position of the green circle in the picture?", "Where is the green circle?"),
    # rewordings an audit found answered far worse (EVAL.md, thirty-sixth session)
    ("How many shapes can you count?", "How many shapes are there?"),
    ("Please tell me how many shapes are there.", "How many shapes are there?"),
    ("Count the number of shapes.", "How many shapes are there?"),
    ("How many objects does the image contain?", "How many shapes are there?"),
    ("Hey, what color is the star?", "What color is the star?"),
    ("What color is the star, please?", "What color is the star?"),
    ("Could you tell me the color of the star?", "What color is the star?"),
    ("Which colour does the star have?", "What color is the star?"),
    ("What's the purple one?", "What shape is the purple object?"),
    ("The purple object is what shape?", "What shape is the purple object?"),
    ("Is there a triangle, yes or no?", "Is there a triangle?"),
    ("Is there a green star? Answer yes or no.", "Is there a green star?"),
    ("Does the image contain a triangle?", "Is there a triangle?"),
    ("Any green stars?", "Is there a green star?"),
    ("Can you spot a green-colored star?", "Is there a green star?"),
    ("In which part of the image is the green circle?", "Where is the green circle?"),
    ("Where\u2019s the green circle?", "Where is the green circle?"),
    ("Tell me where the green circle is.", "Where is the green circle?"),
    ("Locate the green circle.", "Where is the green circle?"),
    ("Where are the green circles?", "Where is the green circle?"),
    # not the world's questions: asked as given, to the letter
    ("Is there a dog?", "Is there a dog?"),
    ("where is the CIRCLE", "where is the CIRCLE"),
    ("What shape is the red circle?", "What shape is the red circle?"),
    ("Where is the green one?", "Where is the green one?"),
])
def test_rewordings_reach_the_trained_forms(asked, trained):
    assert asked_prompt(read_config(TINY_DIR), asked) == {"question": trained}


@pytest.mark.parametrize("asked, length", [
    ("What is in the image?", "normal"), ("Describe this picture.", "normal"), ("what do you see", "normal"),
    ("What can you see in the frame?", "normal"), ("Give me a caption.", "normal"),
    ("Describe the image in detail.", "long"), ("Describe the scene briefly", "short"),
    ("What shapes are there?", "short"), ("Which objects do you see?", "short"),
    ("What colours are there in the image?", "short"), ("List all the shapes.", "short"),
    ("What is this?", "normal"), ("Describe it.", "normal"), ("Please describe the image.", "normal"),
    ("Can you describe this picture?", "normal"), ("Caption", "normal"), ("What is happening in the image?", "normal"),
    ("Tell me about the image.", "normal"), ("Give a short caption.", "short"), ("describe image in detail", "long"),
])
def test_questions_that_ask_for_a_description_get_a_caption(asked, length):
    assert asked_prompt(read_config(TINY_DIR), asked) == {"caption": length}


def test_every_eval_rewording_reaches_its_trained_question():
    config = read_config(TINY_DIR)
    seen = set()
    for i in range(400):
        rng = np.random.default_rng([6, i])
        asked = eval_questions(sample_scene(rng), rng)
        kind, q, _ = reworded(asked, rng)
        seen.add(kind)
        assert q != asked[kind][0] and asked_prompt(config, q) == {"question": asked[kind][0]}, (kind, q)
    assert seen == set(REWORDINGS)


def test_a_reworded_question_gets_the_trained_answer():
    scene = sample_scene(np.random.default_rng([777, 6]), 640, 360, n_objects=1, proportions=False)
    rgb = render(scene)  # one yellow triangle, top center (test above)
    with Engine(model="tiny") as engine:
        pairs = [("What color is the triangle?", "What colour is the triangle"),
                 ("Is there a triangle?", "do you see any triangles"),
                 ("Where is the yellow triangle?", "Where's the yellow triangle located?")]
        outs = [(engine.submit(rgb, question=a).result(timeout=60), engine.submit(rgb, question=b).result(timeout=60))
                for a, b in pairs]
        described = engine.submit(rgb, question="What do you see?").result(timeout=60)
    assert [a.text for a, _ in outs] == ["yellow", "yes", "top center"]
    assert all(a.token_ids == b.token_ids for a, b in outs)
    assert described.text == "a yellow triangle in the top center"  # the normal caption (test above)
    decoder = ReferenceDecoder(load_model("tiny"))
    assert decoder.generate(rgb, question="what colour is the triangle").text == "yellow"
    assert decoder.generate(rgb, question="Describe the image.").text == "a yellow triangle in the top center"


def _on_a_page(level: int, n: int = 8) -> list:
    """World scenes of large objects redrawn on a plain page of pure white (255) or black (0)."""
    from dataclasses import replace

    from tinyvlm.world import Background, Effects

    page, scenes, i = "white" if level == 255 else "black", [], 0
    while len(scenes) < n:
        scene = sample_scene(np.random.default_rng([4242, level, i]), 640, 360, n_objects=1 + i % 3)
        i += 1
        if all(o.color != page and o.size == "large" for o in scene.objects):
            scenes.append(replace(scene, background=Background("solid", (level,) * 3, (level,) * 3),
                                  effects=Effects()))
    return scenes


def test_shapes_on_a_white_or_black_page_are_seen():
    """White and black are object colours in the world, never backgrounds: on a page of either the
    model invented white circles and miscounted (0 of 16 scenes right; a drawing on paper, a
    slide). The tiny model's config shows the page mid grey (`vision.page_to_grey`): 16 of 16."""
    numbers = {1: "one", 2: "two", 3: "three"}
    with Engine(model="tiny") as engine:
        for level in (255, 0):
            for scene in _on_a_page(level):
                rgb = render(scene)
                caption = engine.submit(rgb, caption="short", params=SamplingParams(max_tokens=40)).result(60).text
                count = engine.submit(rgb, question="How many shapes are there?").result(60).text
                named = [" ".join(part.split()[-2:]) for part in caption.replace(" and ", ", ").split(", ")]
                assert sorted(named) == sorted(f"{o.color} {o.shape}" for o in scene.objects), caption
                assert count == numbers[len(scene.objects)]
