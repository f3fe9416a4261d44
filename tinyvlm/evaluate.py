"""Accuracy of a model on held-out scenes: `vlmstream eval-tiny`.

Scenes come from a seed range never used in training and cover every frame size (160x120 to
1920x1080). Every request goes through the engine (greedy). Captions: for each object, is its
"<colour> <shape>" named (short, normal, long; normal split by 1-2 and 3-4 objects), and does the
long caption state the count. Questions: exact answer per type. Shape answers and normal-caption
mentions are also split by the object's size class (small objects are where shape fails), and
each object a normal caption misses is told apart: named with its colour and a wrong shape,
with its shape and a wrong colour, or not at all (`caption_normal_misses`, shares of all objects).
Where the model's region head is trained, detect and point too (`evaluate_regions`): for a
phrase drawn as in training, are the objects it names found (recall) and is what is found one of
them (precision), a box at IoU >= 0.5 or a point inside the drawn object's box, and is the
number found the number named (absent things included: nothing found is then right).
With `renderer="second"` the same scenes are drawn by `second_renderer` (another drawing of the
same ground truth, as the independent check of issue 4 uses).
"""

from __future__ import annotations

import re
import time
from collections import defaultdict
from typing import Callable

import numpy as np

from engine import Engine, EngineConfig, SamplingParams

from .data import HELDOUT_SEED
from .language import NUMBERS
from .regions import located, sample_phrase
from .second_renderer import render_second
from .world import COLORS, SHAPES, Scene, render, sample_scene

RENDERERS = {"world": render, "second": render_second}

MISSES = ("wrong_shape", "wrong_colour", "missing")
_MENTION = re.compile(r"\b(" + "|".join(COLORS) + r")\s+(" + "|".join(SHAPES) + r")s?\b")
_COUNT = re.compile(r"\b(one|two|three|four)\s+shapes?\b")


def eval_questions(scene: Scene, rng: np.random.Generator) -> dict[str, tuple[str, str]]:
    """One question of each applicable type, with its exact answer."""
    objs = scene.objects
    out = {"count": ("How many shapes are there?", NUMBERS[len(objs)])}
    shapes = [s for s in SHAPES if sum(o.shape == s for o in objs) == 1]
    if shapes:
        s = shapes[int(rng.integers(len(shapes)))]
        out["color"] = (f"What color is the {s}?", next(o.color for o in objs if o.shape == s))
    colors = [c for c in COLORS if sum(o.color == c for o in objs) == 1]
    if colors:
        c = colors[int(rng.integers(len(colors)))]
        out["shape"] = (f"What shape is the {c} object?", next(o.shape for o in objs if o.color == c))
    s = SHAPES[int(rng.integers(len(SHAPES)))]
    out["yesno_shape"] = (f"Is there a {s}?", "yes" if any(o.shape == s for o in objs) else "no")
    if rng.random() < 0.5:
        o = objs[int(rng.integers(len(objs)))]
        c, s = o.color, o.shape
    else:
        c, s = list(COLORS)[int(rng.integers(len(COLORS)))], SHAPES[int(rng.integers(len(SHAPES)))]
    out["yesno_color_shape"] = (f"Is there a {c} {s}?", "yes" if any(o.color == c and o.shape == s for o in objs)
                                else "no")
    o = objs[int(rng.integers(len(objs)))]
    out["position"] = (f"Where is the {o.color} {o.shape}?", o.position(scene.width, scene.height))
    return out


# Rewordings of each eval question (format fields: the trained question's shape s, colour c).
REWORDINGS = {
    "count": ("How many objects are there?", "how many shapes", "Count the shapes.",
              "How many things do you see in the image?"),
    "color": ("What colour is the {s}?", "What is the color of the {s}?", "which color is the {s}",
              "What colour is that {s} in the picture?"),
    "shape": ("What shape is the {c} thing?", "What is the shape of the {c} object?", "Which shape is {c}?",
              "what shape is the {c} one"),
    "yesno_shape": ("Do you see a {s}?", "Are there any {s}s?", "is there a {s}", "Can you see a {s} in the image?"),
    "yesno_color_shape": ("Do you see a {c} {s}?", "Are there any {c} {s}s?", "is there a {c} {s}",
                          "Can you see any {c} {s}s?"),
    "position": ("Where's the {c} {s}?", "where is the {c} {s} located", "Where is the {c} {s} in the image?"),
}
_ASKED = {"count": re.compile(r"How many shapes are there\?"), "color": re.compile(r"What color is the (?P<s>\w+)\?"),
          "shape": re.compile(r"What shape is the (?P<c>\w+) object\?"),
          "yesno_shape": re.compile(r"Is there a (?P<s>\w+)\?"),
          "yesno_color_shape": re.compile(r"Is there a (?P<c>\w+) (?P<s>\w+)\?"),
          "position": re.compile(r"Where is the (?P<c>\w+) (?P<s>\w+)\?")}


def reworded(questions: dict[str, tuple[str, str]], rng: np.random.Generator) -> tuple[str, str, str]:
    """(kind, reworded question, exact answer) for one of `questions` (eval_questions' output)."""
    kind = sorted(questions)[int(rng.integers(len(questions)))]
    q, a = questions[kind]
    forms = REWORDINGS[kind]
    return kind, forms[int(rng.integers(len(forms)))].format(**_ASKED[kind].fullmatch(q).groupdict()), a


def named(text: str) -> set[tuple[str, str]]:
    return set(_MENTION.findall(text.lower()))


def evaluate(model: str = "tiny", n: int = 1000, device: str = "cpu", dtype: str | None = None,
             progress: Callable[[int, int], None] | None = None, renderer: str = "world") -> dict:
    if renderer not in RENDERERS:
        raise ValueError(f"unknown renderer {renderer!r} (expected one of {', '.join(RENDERERS)})")
    draw = RENDERERS[renderer]
    hits: dict[str, list[int]] = defaultdict(lambda: [0, 0])  # name -> [right, total]
    misses: dict[str, int] = dict.fromkeys(MISSES, 0)
    examples = []
    t0 = time.perf_counter()
    params = SamplingParams(temperature=0.0, max_tokens=64)
    scored, interrupted = 0, False
    with Engine(EngineConfig(model=model, device=device, dtype=dtype, max_batch_size=32)) as engine:
        ran_on = {"device": str(engine.loaded.device), "dtype": str(engine.loaded.dtype).removeprefix("torch."),
                  "load_seconds": round(time.perf_counter() - t0, 3)}  # within "seconds", told apart
        regions = engine.loaded.config.region.trained
        total = 2 * n if regions else n  # the region pass is the second half of the progress
        pending = []
        try:
            for i in range(n):
                rng = np.random.default_rng([HELDOUT_SEED, i])
                scene = sample_scene(rng)
                ref = engine.encode_image(draw(scene))
                caps = {length: engine.submit(ref, caption=length, params=params)
                        for length in ("short", "normal", "long")}
                asked = eval_questions(scene, rng)
                qs = {kind: (q, a, engine.submit(ref, question=q, params=params)) for kind, (q, a) in asked.items()}
                _, q, a = reworded(asked, np.random.default_rng([HELDOUT_SEED, i, 1]))
                qs["reworded"] = (q, a, engine.submit(ref, question=q, params=params))
                ref.release()
                pending.append((scene, caps, qs))
                while len(pending) > 8 or (i == n - 1 and pending):  # bounded in flight, ordered
                    _score(pending.pop(0), hits, misses, examples)
                    scored += 1
                    if progress:
                        progress(scored, total)
            if regions:
                evaluate_regions(engine.loaded, n, draw, hits, lambda k: progress and progress(n + k, total))
        except KeyboardInterrupt:  # Ctrl-C or SIGTERM: the scenes scored are reported, not lost
            if not scored:
                raise
            interrupted = True
            engine.close(cancel=True)  # the scenes in flight: not decoded to their end
    objects = hits["caption_normal_objects_small"][1] + hits["caption_normal_objects_large"][1]
    report = {
        "model": model, **ran_on, "renderer": renderer, "scenes": scored,  # a bf16 run is told from an fp32 one
        "interrupted": interrupted,  # stopped by Ctrl-C or SIGTERM: "scenes" of the n asked were scored
        "seconds": round(time.perf_counter() - t0, 1),
        "accuracy": {k: round(v[0] / v[1], 4) for k, v in sorted(hits.items()) if v[1]},
        "counts": {k: v[1] for k, v in sorted(hits.items())},
        "caption_normal_misses": {k: round(v / max(objects, 1), 4) for k, v in misses.items()},
        "examples": examples[:5],
    }
    return report


IOU_HIT = 0.5


def iou(a: tuple[float, ...], b: tuple[float, ...]) -> float:
    w = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    h = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = w * h
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else 0.0


def match_count(found: list, truth: list, hit: Callable) -> int:
    """Found items matched one to one with true ones, greedily in the order found."""
    free, n = list(truth), 0
    for f in found:
        k = next((j for j, t in enumerate(free) if hit(f, t)), None)
        if k is not None:
            free.pop(k)
            n += 1
    return n


def evaluate_regions(loaded, n: int, draw: Callable, hits: dict, progress: Callable[[int], None]) -> None:
    """Detect and point on the first n held-out scenes, one phrase of each (into `hits`)."""
    from engine.region_decoder import RegionDecoder

    decoder = RegionDecoder(loaded)
    for i in range(n):
        scene = sample_scene(np.random.default_rng([HELDOUT_SEED, i]))
        encoded = decoder.reference.encode_image(draw(scene))
        rng = np.random.default_rng([HELDOUT_SEED, i, 2])
        for task in ("detect", "point"):
            phrase = sample_phrase(scene, rng)
            truth = located(scene, phrase)
            got = decoder.locate(encoded, phrase, task)
            if task == "detect":
                found = [(b["x_min"], b["y_min"], b["x_max"], b["y_max"]) for b in got["objects"]]
                right = match_count(found, truth, lambda f, t: iou(f, t) >= IOU_HIT)
            else:
                found = [(p["x"], p["y"]) for p in got["points"]]
                right = match_count(found, truth, lambda f, t: t[0] <= f[0] <= t[2] and t[1] <= f[1] <= t[3])
            for key, (k, total) in {"recall": (right, len(truth)), "precision": (right, len(found)),
                                    "count": (len(found) == len(truth), 1)}.items():
                hits[f"{task}_{key}"][0] += k
                hits[f"{task}_{key}"][1] += total
        progress(i + 1)


def miss_kind(obj_color: str, obj_shape: str, said: set[tuple[str, str]]) -> str | None:
    """How a caption that names `said` misses an object (None: it names it)."""
    if (obj_color, obj_shape) in said:
        return None
    if any(c == obj_color for c, _ in said):
        return "wrong_shape"
    if any(s == obj_shape for _, s in said):
        return "wrong_colour"
    return "missing"


def _score(entry, hits, misses, examples) -> None:
    scene, caps, qs = entry
    truth = {(o.color, o.shape) for o in scene.objects}
    texts = {length: h.result(timeout=600).text for length, h in caps.items()}
    # Every answer waited for before anything is counted: a Ctrl-C in a wait for a question's
    # answer had left the scene's captions counted and its questions not, under "scenes" one short.
    answers = {kind: h.result(timeout=600).text for kind, (_, _, h) in qs.items()}
    bucket = "1-2" if len(scene.objects) <= 2 else "3-4"
    for length, text in texts.items():
        said = named(text)
        for o in scene.objects:
            pair = (o.color, o.shape)
            keys = [f"caption_{length}_objects_{bucket}", f"caption_{length}_objects_{o.size}"] \
                if length == "normal" else [f"caption_{length}_objects"]
            for key in keys:
                hits[key][0] += pair in said
                hits[key][1] += 1
            if length == "normal" and (kind := miss_kind(o.color, o.shape, said)):
                misses[kind] += 1
        if length == "normal":
            hits["caption_normal_no_extra_objects"][0] += said <= truth
            hits["caption_normal_no_extra_objects"][1] += 1
    m = _COUNT.search(texts["long"].lower())
    hits["caption_long_count"][0] += bool(m) and m.group(1) == NUMBERS[len(scene.objects)]
    hits["caption_long_count"][1] += 1
    for kind, (q, a, _) in qs.items():
        got = answers[kind].strip().lower()
        keys = [f"answer_{kind}"]
        if kind == "shape":  # "What shape is the <colour> object?": one object has that colour
            keys.append(f"answer_shape_{next(o.size for o in scene.objects if o.color == q.split()[4])}")
        for key in keys:
            hits[key][0] += got == a
            hits[key][1] += 1
    if len(examples) < 5:
        examples.append({"truth": scene.truth()["objects"], "captions": texts,
                         "answers": {k: [q, a, answers[k]] for k, (q, a, _) in qs.items()}})


def format_report(report: dict) -> str:
    lines = [f"model={report['model']} device={report.get('device', '-')} dtype={report.get('dtype', '-')} "
             f"renderer={report['renderer']} scenes={report['scenes']} ({report['seconds']} s"
             + (f", {report['load_seconds']:.1f} s of it loading)" if "load_seconds" in report else ")")
             + (" (interrupted)" if report.get("interrupted") else "")]
    for k, v in report["accuracy"].items():
        lines.append(f"  {k:<36} {100 * v:6.2f} %   (n={report['counts'][k]})")
    lines.append("  normal captions miss, of all objects: " + ", ".join(
        f"{k.replace('_', ' ')} {100 * v:.2f} %" for k, v in report["caption_normal_misses"].items()))
    return "\n".join(lines)
