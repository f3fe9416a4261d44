"""train-tiny's data and loop: per-image-token labels, and a short run that writes loadable weights."""

import csv

import numpy as np

from engine.models.loader import load_model
from tinyvlm.data import PATCH_COLORS, PATCH_SHAPES, patch_labels
from tinyvlm.world import Background, Effects, Obj, Scene


def scene_with(*objs, w=630, h=315):
    return Scene(w, h, tuple(objs), Background("solid", (128, 128, 128), (128, 128, 128)), Effects())


def test_patch_labels_mark_objects_on_the_image_token_grid():
    big = Obj("square", "red", "large", cx=315, cy=157, extent=100, angle=0.0, rgb=(220, 40, 40))
    small = Obj("star", "blue", "small", cx=600, cy=20, extent=12, angle=0.0, rgb=(40, 80, 220))
    colour, shape = patch_labels(scene_with(big, small), grid=9).reshape(2, 9, 9)
    assert colour[4, 4] == PATCH_COLORS.index("red") and shape[4, 4] == PATCH_SHAPES.index("square")
    # the small star covers a sliver of its cell, which is still labelled with it
    assert colour[0, 8] == PATCH_COLORS.index("blue") and shape[0, 8] == PATCH_SHAPES.index("star")
    assert colour[8, 0] == 0 and shape[0, 0] == 0  # background
    assert ((colour > 0) == (shape > 0)).all()
    red_cells = int((colour == PATCH_COLORS.index("red")).sum())
    assert 2 <= red_cells <= 9  # ~100 px of a 630x315 frame: a couple of cells wide, a few tall


def test_a_short_training_run_writes_weights_the_engine_loads(tmp_path):
    from tinyvlm.train import TrainConfig, train

    report = train(TrainConfig(out=tmp_path, steps=3, batch_size=2, warmup=1, threads=1), progress=False)
    assert report["steps"] == 3 and np.isfinite(report["final_loss"])
    rows = list(csv.DictReader(open(tmp_path / "loss.csv")))
    assert [int(r["step"]) for r in rows] == [0, 1, 2]
    assert all(0.0 <= float(r["probe_acc"]) <= 1.0 and float(r["aux_loss"]) > 0 for r in rows)
    loaded = load_model(str(tmp_path))  # strict: every key, every shape; the probe heads are not saved
    assert loaded.config.vision.crop_size == 126
    assert (tmp_path / "loss.png").stat().st_size > 0
