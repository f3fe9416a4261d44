"""train-tiny's data and loop: per-image-token labels, and a short run that writes loadable weights."""

import csv
import json
import os
from pathlib import Path

import numpy as np
import pytest

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

    report = train(TrainConfig(out=tmp_path, steps=3, batch_size=2, warmup=1, threads=1, processes=1, bf16=False),
                   progress=False)
    assert report["steps"] == 3 and np.isfinite(report["final_loss"]) and report["dtype"] == "fp32"
    rows = list(csv.DictReader(open(tmp_path / "loss.csv")))
    assert [int(r["step"]) for r in rows] == [0, 1, 2]
    assert all(0.0 <= float(r["probe_acc"]) <= 1.0 and 0.0 <= float(r["probe_shape_acc"]) <= 1.0
               and float(r["aux_loss"]) > 0 for r in rows)
    loaded = load_model(str(tmp_path))  # strict: every key, every shape; the probe heads are not saved
    assert loaded.config.vision.crop_size == 126
    assert (tmp_path / "loss.png").stat().st_size > 0
    # readable by whoever may read the folder's other files (safetensors alone writes 0600)
    assert (tmp_path / "model.safetensors").stat().st_mode & 0o777 == (tmp_path / "config.json").stat().st_mode & 0o777


def test_two_processes_train_the_same_steps_as_one(tmp_path):
    """Two processes split each step's images and average their gradients: the losses follow a
    one-process run of the same seed and batch (not bit for bit: each process averages over its
    own tokens, 2.0 % apart at most here), and the weights load. Without the gradient averaging
    the curves part by 5.9-7.3 % at steps 2-3 (measured in the eleventh session)."""
    import pytest

    from tinyvlm.train import TrainConfig, train

    curves = {}
    for n in (1, 2):
        out = tmp_path / f"p{n}"
        report = train(TrainConfig(out=out, steps=4, batch_size=4, warmup=1, processes=n, vision_share=0.0),
                       progress=False)
        assert report["steps"] == 4
        curves[n] = [float(r["loss"]) for r in csv.DictReader(open(out / "loss.csv"))]
    assert curves[2] == pytest.approx(curves[1], rel=0.03)
    assert curves[1][-1] < curves[1][0] - 0.3  # it learns: the steps are real
    assert load_model(str(tmp_path / "p2")).config.vision.crop_size == 126
    with pytest.raises(ValueError, match="does not split"):
        train(TrainConfig(out=tmp_path / "bad", steps=1, batch_size=3, processes=2), progress=False)


def test_the_vision_stage_trains_the_encoder_alone_then_everything(tmp_path):
    """The first share of the steps moves the vision weights and leaves the decoder's as they were
    drawn; the decoder then trains, its learning rate warming up again."""
    import math

    import torch
    from safetensors.torch import load_file

    from engine.models.weights import random_state_dict
    from tinyvlm.train import TrainConfig, train

    def weights(folder):
        return {k: v.float() for k, v in load_file(str(folder / "model.safetensors")).items()}

    cfg = TrainConfig(out=tmp_path / "v", steps=2, batch_size=2, warmup=2, processes=1, vision_share=0.9)
    report = train(cfg, progress=False)
    assert report["steps"] == 2 and report["final_loss"] is None
    trained = weights(cfg.out)
    drawn = random_state_dict(load_model(str(cfg.out)).config, seed=cfg.seed)
    text = [k for k in trained if ".text." in k]
    vision = [k for k in trained if ".vision." in k]
    assert text and vision
    for k in text:  # stored in fp16
        torch.testing.assert_close(trained[k], drawn[k].half().float(), rtol=0, atol=0)
    assert sum(not torch.equal(trained[k], drawn[k].half().float()) for k in vision) >= len(vision) // 2

    cfg = TrainConfig(out=tmp_path / "vt", steps=4, batch_size=2, warmup=2, processes=1, vision_share=0.5)
    report = train(cfg, progress=False)
    rows = list(csv.DictReader(open(cfg.out / "loss.csv")))
    assert [math.isnan(float(r["loss"])) for r in rows] == [True, True, False, False]
    assert float(rows[2]["lr"]) == cfg.lr / 2  # the decoder's first step: warm-up starts again
    assert math.isfinite(report["final_loss"])
    assert not torch.equal(weights(cfg.out)[text[0]], drawn[text[0]].half().float())


def test_a_time_budget_ends_two_processes_cleanly(tmp_path):
    """The budget stops the loop mid-stream, with batches still being rendered: every process and
    render worker must leave without an abort, and a budget spent before the first step still
    trains one step and writes weights."""
    import subprocess
    import sys

    # Both runs in one interpreter: a process's start (torch, the tokenizer) is paid once.
    code = ("import json, sys; from tinyvlm.train import TrainConfig, train\n"
            "for out, minutes in zip(sys.argv[1::2], sys.argv[2::2]):\n"
            "    print(json.dumps(train(TrainConfig(out=out, steps=1000, batch_size=4, warmup=1, processes=2,"
            " max_minutes=float(minutes)), progress=False)), flush=True)")
    cases = ((0.02, None), (1e-6, 1))
    args = [str(a) for minutes, _ in cases for a in (tmp_path / str(minutes), minutes)]
    r = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "terminate called" not in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
    reports = [json.loads(line) for line in r.stdout.strip().splitlines() if line.startswith("{")]
    assert len(reports) == len(cases), r.stdout[-2000:]
    for (minutes, steps), report in zip(cases, reports):
        assert report["steps"] >= 1 and (steps is None or report["steps"] == steps)
        assert load_model(str(tmp_path / str(minutes))).config.vision.crop_size == 126


def test_an_error_inside_training_ends_the_process_not_hangs_it(tmp_path):
    """Any error in the loop (here a forward that fails at its second step) left the render
    worker to the interpreter's exit, where it blocked on its full queue: the traceback came,
    and the process never ended (train-tiny --max-minutes 1e308 or --lr 1e38 did that)."""
    import subprocess
    import sys

    code = ("import sys, tinyvlm.train as t\n"
            "real, calls = t.forward_loss, []\n"
            "def failing(*a, **k):\n"
            "    calls.append(1)\n"
            "    if len(calls) > 1:\n"
            "        raise RuntimeError('a bug inside training')\n"
            "    return real(*a, **k)\n"
            "t.forward_loss = failing\n"
            "t.train(t.TrainConfig(out=sys.argv[1], steps=50, batch_size=4, warmup=1, processes=1), progress=False)")
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path / "out")], capture_output=True, text=True,
                       timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 1 and "RuntimeError: a bug inside training" in r.stderr, r.stderr[-2000:]


def test_outline_mask_is_the_object_pixels_of_every_crop_patch_by_patch():
    from engine.models.loader import TINY_DIR, read_config
    from engine.models.tiling import overlap_crops
    from tinyvlm.data import outline_mask
    from tinyvlm.world import render

    vision = read_config(TINY_DIR).vision
    # a 100 px square centred in a 630x315 frame; the global crop squeezes it to ~20 x 40 px
    sq = Obj("square", "red", "large", cx=315, cy=157, extent=100 * 2 ** 0.5, angle=0.0, rgb=(220, 40, 40))
    scene = scene_with(sq)
    m = outline_mask(scene, vision)
    crops, tiling = overlap_crops(render(scene), vision)
    assert m.shape == (len(crops), 81, 196) and len(crops) == 1 + tiling[0] * tiling[1] > 2
    assert set(np.unique(m)) == {0, 1}
    pixels = m.reshape(len(crops), 9, 9, 14, 14).transpose(0, 1, 3, 2, 4).reshape(len(crops), 126, 126)
    ys, xs = np.nonzero(pixels[0])
    assert abs(xs.mean() - 63) < 1.5 and abs(ys.mean() - 63) < 1.5
    assert 18 <= xs.max() - xs.min() + 1 <= 22 and 38 <= ys.max() - ys.min() + 1 <= 42
    assert m[0, 0].sum() == 0  # the corner patch is background
    # every crop's mask lies on the red square of the same crop of the rendered frame
    for crop, mask in zip(crops, pixels):
        if mask.any():
            assert crop[..., 0][mask == 1].mean() > 200
        far = np.ones_like(mask, bool)
        ys, xs = np.nonzero(mask)
        if len(ys):
            far[max(ys.min() - 3, 0):ys.max() + 4, max(xs.min() - 3, 0):xs.max() + 4] = False
        assert abs(crop[..., 0][far].astype(float).mean() - 128) < 3
    # the tiles see the square larger than the global crop does
    assert max(p.sum() for p in pixels[1:]) > 1.8 * pixels[0].sum()


def test_training_attention_matches_torch_with_masks_and_gradients():
    import torch

    from engine.models.vision import sdpa

    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 4, 7, 16, generator=g, requires_grad=True) for _ in range(3))
    mask = torch.rand(2, 1, 7, 7, generator=g) > 0.3
    mask |= torch.eye(7, dtype=torch.bool)
    for m in (None, mask):
        ours = sdpa(q, k, v, attn_mask=m)
        ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=m)
        torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
        g_ours = torch.autograd.grad(ours.square().sum(), (q, k, v))
        g_ref = torch.autograd.grad(ref.square().sum(), (q, k, v))
        for a, b in zip(g_ours, g_ref):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    kv = [t[:, :2].detach().requires_grad_() for t in (k, v)]  # grouped-query: 4 query heads, 2 kv heads
    torch.testing.assert_close(sdpa(q, *kv, enable_gqa=True),
                               torch.nn.functional.scaled_dot_product_attention(q, *kv, enable_gqa=True),
                               atol=1e-5, rtol=1e-5)


def test_a_run_continues_from_a_weights_folder_and_may_change_the_tiling(tmp_path, capsys):
    """--init starts from trained weights, not random ones (the shipped model's answer loss is
    ~0.2 where a random start is ~6.9); a folder of another architecture or with no weights is
    refused with a one-line error before anything is written."""
    import shutil

    import pytest

    from app.cli import main
    from engine.models.loader import TINY_DIR
    from tinyvlm.train import TrainConfig, train

    from tinyvlm.language import CAPTION_REWRITES, QUESTION_REWRITES

    before = tmp_path / "before"  # a folder written before configs carried question rewrites
    shutil.copytree(TINY_DIR, before)
    config = json.loads((before / "config.json").read_text())
    del config["tokenizer"]["question_rewrites"], config["tokenizer"]["caption_rewrites"]
    (before / "config.json").write_text(json.dumps(config))
    cfg = TrainConfig(out=tmp_path / "c", init=before, steps=2, batch_size=2, warmup=1, processes=1,
                      vision_share=0.0, lr=1e-6, first_item=10 ** 6, tiling="moondream")
    report = train(cfg, progress=False)
    rows = list(csv.DictReader(open(cfg.out / "loss.csv")))
    assert report["steps"] == 2 and all(float(r["loss"]) < 1.0 for r in rows)
    continued = load_model(str(cfg.out)).config
    assert continued.vision.tiling == "moondream" and continued.tokenizer.question_rewrites == QUESTION_REWRITES
    assert continued.tokenizer.caption_rewrites == CAPTION_REWRITES

    other = tmp_path / "other"
    shutil.copytree(TINY_DIR, other)
    config = json.loads((other / "config.json").read_text())
    config["text"]["n_layers"] += 1
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="another architecture"):
        train(TrainConfig(out=tmp_path / "x", init=other, steps=1, processes=1), progress=False)
    assert not (tmp_path / "x").exists()
    assert main(["train-tiny", "--init", str(tmp_path / "empty"), "--out", str(tmp_path / "y")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("vlmstream: error: ") and "model.safetensors" in err and err.count("\n") == 1
    assert not (tmp_path / "y").exists()  # a refused --init creates no --out
    (other / "config.json").unlink()  # it was read as Moondream 2's layout: "another architecture"
    with pytest.raises(ValueError, match="holds no config.json"):
        train(TrainConfig(out=tmp_path / "x", init=other, steps=1, processes=1), progress=False)
    with pytest.raises(ValueError, match="tiling"):
        TrainConfig(tiling="tiles")


def test_bf16_autocast_follows_the_cpu(tmp_path, monkeypatch):
    """By default training autocasts to bf16 only on CPUs with bf16 matrix instructions: on others
    (AVX2 alone) bf16 is emulated ~50x slower than fp32."""
    import pytest
    import torch

    import tinyvlm.train as tt

    class Seen(Exception):  # stops the run at its first forward: the choice is made by then
        pass

    def recording(*args, **kwargs):
        raise Seen(kwargs.get("enabled", True))

    monkeypatch.setattr(torch, "autocast", recording)
    for native in (True, False):
        monkeypatch.setattr(tt, "cpu_has_native_bf16", lambda native=native: native)
        with pytest.raises(Seen) as seen:
            tt.train(tt.TrainConfig(out=tmp_path / str(native), steps=1, batch_size=2, processes=1), progress=False)
        assert seen.value.args == (native,)


def _descendants(pid: int) -> set[int]:
    found, todo = set(), [pid]
    while todo:
        for task in Path(f"/proc/{todo.pop()}/task").glob("*"):
            try:
                kids = {int(k) for k in (task / "children").read_text().split()}
            except OSError:  # gone meanwhile
                continue
            todo += list(kids - found)
            found |= kids
    return found


def test_sigterm_stops_two_training_processes_at_once(tmp_path):
    """`kill` (or systemd) stops the command's own process only: the other training process then
    waited on it at its next step for the group's two-minute timeout, and the command with it."""
    import os
    import signal
    import subprocess
    import sys
    import time

    code = ("import sys; from app.launcher import sigterm_as_interrupt; from tinyvlm.train import TrainConfig, train\n"
            "with sigterm_as_interrupt():\n"
            "    try: train(TrainConfig(out=sys.argv[1], steps=100000, batch_size=4, warmup=1, processes=2,"
            " max_minutes=10), progress=False)\n"
            "    except KeyboardInterrupt: sys.exit(143)")
    p = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.monotonic() + 120

    def spawned() -> bool:  # the second training process has started (it then waits on the first)
        for pid in _descendants(p.pid):
            try:
                if b"multiprocessing.spawn" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    return True
            except OSError:
                pass
        return False

    while not spawned():
        assert p.poll() is None and time.monotonic() < deadline, p.stderr.read()[-2000:] if p.poll() else "no spawn"
        time.sleep(0.1)
    time.sleep(1.0)  # into its start-up: the group's rendezvous, or a step
    family = _descendants(p.pid)
    t0 = time.monotonic()
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=200)
    assert p.returncode == 143 and time.monotonic() - t0 < 30, err[-2000:]
    time.sleep(0.5)
    assert not [pid for pid in family if Path(f"/proc/{pid}").exists()
                and "Z" not in Path(f"/proc/{pid}/stat").read_text().split(")")[-1][:3]], "a process was left running"


@pytest.mark.parametrize("stop, code, said", [("SIGINT", 130, "interrupted"), ("SIGTERM", 143, "terminated")])
def test_ctrl_c_or_a_group_sigterm_stops_train_tiny_in_one_line(tmp_path, stop, code, said):
    """Ctrl-C reaches the whole foreground group, and a SIGTERM sent to the group (`timeout`,
    systemd's stop) every process of it: the render workers and the second training process died
    of it too, and the command ended with exit 1 and tracebacks ("DataLoader worker exited
    unexpectedly", "... killed by signal: Terminated") instead of exit 130 (143) and its one line."""
    import os
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "new" / "weights"
    p = subprocess.Popen([str(Path(sys.executable).with_name("vlmstream")), "train-tiny", "--out", str(out),
                          "--steps", "100000", "--batch-size", "4"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True)
    deadline = time.monotonic() + 120
    while not (out / f".partial-{p.pid}" / "config.json").exists():  # the loop is about to start
        assert p.poll() is None and time.monotonic() < deadline, p.stderr.read()[-2000:] if p.poll() else "no start"
        time.sleep(0.1)
    time.sleep(3.0)  # into the steps, both processes and their render workers running
    os.killpg(p.pid, getattr(signal, stop))  # what Ctrl-C in a terminal does (SIGINT), or `timeout`
    _, err = p.communicate(timeout=120)
    assert p.returncode == code and "Traceback" not in err, err[-3000:]
    # one line, after the closed bar (it said two, glued to the bar, and the bar came again after); on a
    # loaded machine the interrupt can come before the bar is drawn, and the line is all there is
    assert ("\n" + err).endswith(f"\nvlmstream: {said}: train-tiny stopped, {out} left as it was\n"), err[-1000:]
    assert err.count("vlmstream: ") == 1, err[-1000:]
    assert not (tmp_path / "new").exists()  # the folders made for the run are gone with it


def test_ctrl_c_as_the_second_training_process_starts_is_one_line(tmp_path):
    """CI, under load: Ctrl-C came while the spawned second process was still importing torch,
    before it could turn deaf to it, and its KeyboardInterrupt traceback was printed."""
    import os
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "weights"
    p = subprocess.Popen([str(Path(sys.executable).with_name("vlmstream")), "train-tiny", "--out", str(out),
                          "--steps", "100000", "--batch-size", "4", "--processes", "2"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
                         start_new_session=True)
    deadline = time.monotonic() + 120
    while True:  # the moment it is importing torch, long before it could turn deaf
        spawned = []
        for pid in _descendants(p.pid):
            try:
                if (b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()
                        and "libtorch" in Path(f"/proc/{pid}/maps").read_text()):
                    spawned.append(pid)
            except OSError:
                pass
        if spawned:
            break
        assert p.poll() is None and time.monotonic() < deadline, p.stderr.read()[-2000:] if p.poll() else "no spawn"
        time.sleep(0.005)
    # What Ctrl-C in a terminal brings it then; the group's own (every process) after it has
    # had time to show: sent together, this process's end could come before its traceback.
    os.kill(spawned[0], signal.SIGINT)
    time.sleep(1.0)
    os.killpg(p.pid, signal.SIGINT)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 130 and "Traceback" not in err, err[-3000:]
    assert f"vlmstream: interrupted: train-tiny stopped, {out} left as it was" in err


def test_a_full_disk_at_the_end_of_a_run_is_one_line(tmp_path, capsys, monkeypatch):
    """The weights are written at the end: a full disk then lost the run to a traceback."""
    import tinyvlm.train as tt
    from app.cli import main

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(tt, "save_weights", disk_full)
    out = tmp_path / "weights"
    assert main(["train-tiny", "--steps", "1", "--batch-size", "2", "--processes", "1", "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert err.endswith(f"vlmstream: error: train-tiny could not write into {out}: No space left on device; "
                        f"{out} left as it was\n") and "Traceback" not in err
    assert not out.exists()


def test_an_out_folder_on_another_file_system_takes_the_weights(tmp_path):
    """--out a link to another disk (or a mounted volume): the run wrote beside the link's path and
    could not rename its files across, so it failed at its end and deleted what it trained."""
    import os
    import shutil
    import tempfile

    from tinyvlm.train import TrainConfig, train

    if not Path("/dev/shm").is_dir() or os.stat("/dev/shm").st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("no second file system at /dev/shm")
    elsewhere = Path(tempfile.mkdtemp(dir="/dev/shm"))
    try:
        (tmp_path / "link").symlink_to(elsewhere)
        train(TrainConfig(out=tmp_path / "link", steps=2, batch_size=2, warmup=1, processes=1), progress=False)
        assert sorted(p.name for p in elsewhere.iterdir()) == ["config.json", "loss.csv", "loss.png",
                                                              "model.safetensors", "tokenizer.json"]
        assert sorted(p.name for p in tmp_path.iterdir()) == ["link"]
    finally:
        shutil.rmtree(elsewhere)


def test_a_sigterm_whose_interrupt_was_lost_still_stops_training(tmp_path):
    """The KeyboardInterrupt a SIGTERM raises can be lost (raised inside a finalizer, which Python
    reports and ignores); the handler raises once, so `kill` of train-tiny once left it training
    (found under load in the thirtieth session). The loop checks at each step."""
    import pytest

    from app.launcher import sigterm_as_interrupt, stop_requested
    from conftest import lose_a_sigterm
    from tinyvlm.train import TrainConfig, train

    with sigterm_as_interrupt() as term:
        lose_a_sigterm(term)
        with pytest.raises(KeyboardInterrupt):
            train(TrainConfig(out=tmp_path / "out", steps=50, batch_size=2, warmup=1, processes=1), progress=False)
    assert not stop_requested()  # the block is over: a later run in this process trains
    assert list(tmp_path.iterdir()) == []  # nothing written: neither --out nor the run's own folder


def test_a_ctrl_c_whose_interrupt_was_lost_in_start_up_still_stops_training(tmp_path):
    """Ctrl-C's KeyboardInterrupt can be lost as a SIGTERM's can: one that came while train-tiny's
    first process built its optimizer (which imports mpmath, whose `import gmpy2` sits in a bare
    `except: pass`) vanished, and the run trained on where the user waited for its one line and
    exit 130 (the CI flake of test_ctrl_c_as_the_second_training_process_starts_is_one_line). The
    loop's check at each step sees a Ctrl-C too."""
    import signal
    import time

    import app.launcher as launcher
    from tinyvlm.train import TrainConfig, train

    before = signal.signal(signal.SIGINT, launcher._interrupt)  # as the console script has it
    try:
        with launcher.sigterm_as_interrupt():
            try:
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(5)
            except KeyboardInterrupt:
                pass  # swallowed, as by a finalizer
            with pytest.raises(KeyboardInterrupt):
                train(TrainConfig(out=tmp_path / "out", steps=20, batch_size=2, warmup=1, processes=1),
                      progress=False)
    finally:
        signal.signal(signal.SIGINT, before)
    assert not launcher.stop_requested(ctrl_c=True)  # the block is over: a later run in this process trains
    assert list(tmp_path.iterdir()) == []  # nothing written: neither --out nor the run's own folder


def test_the_seed_and_the_first_item_set_a_run(tmp_path):
    """A run is deterministic for a seed (train-tiny's help says so): the same --seed and
    --first-item give the same loss curve, another --seed other initial weights, another
    --first-item other scenes. Each dropped inside the run (the weights drawn with seed 0, the
    scenes from item 0, whatever the flags said; or the probe heads drawn from whatever state the
    global generator was in) and no test failed: a continued run retrained on the scenes its
    first run had seen (hand mutants)."""
    from tinyvlm.train import TrainConfig, train

    def curve(name, **kw) -> list[tuple[str, str]]:
        out = tmp_path / name
        train(TrainConfig(out=out, steps=2, batch_size=2, warmup=1, processes=1, vision_share=0.0, bf16=False, **kw),
              progress=False)
        return [(r["loss"], r["aux_loss"]) for r in csv.DictReader(open(out / "loss.csv"))]

    base = curve("base")
    assert curve("again") == base  # the answer and probe losses of every step, to the csv's digits
    # the first step's answer loss: the initial decoder weights and the scenes alone set it
    assert curve("seed", seed=1)[0][0] != base[0][0]
    assert curve("item", first_item=1000)[0][0] != base[0][0]


def test_the_report_and_the_loss_curve_say_what_the_run_measured(tmp_path, monkeypatch):
    """The JSON report's minutes are the run's own, and loss.csv's probe_acc is the mean of the
    probe's colour and shape accuracies, probe_shape_acc the shape's: minutes given in seconds
    (60x the time), probe_acc as the colour's alone, and the two columns' names swapped each
    passed every test (hand mutants)."""
    import time

    import tinyvlm.train as tt

    real = tt.forward_loss

    def known_accuracies(*args, **kwargs):
        loss, aux, _, _ = real(*args, **kwargs)
        return loss, aux, 0.25, 0.75  # colour, shape

    monkeypatch.setattr(tt, "forward_loss", known_accuracies)
    t0 = time.perf_counter()
    report = tt.train(tt.TrainConfig(out=tmp_path, steps=2, batch_size=2, warmup=1, processes=1, vision_share=0.0,
                                     bf16=False), progress=False)
    wall_minutes = (time.perf_counter() - t0) / 60
    rows = list(csv.DictReader(open(tmp_path / "loss.csv")))
    assert [(float(r["probe_acc"]), float(r["probe_shape_acc"])) for r in rows] == [(0.5, 0.75)] * 2
    assert 0 < report["minutes"] <= wall_minutes
    assert report["steps"] == len(rows) and report["final_loss"] == float(rows[-1]["loss"])


def test_the_learning_rate_warms_up_to_its_peak_then_decays_to_a_floor(tmp_path):
    """loss.csv's lr column: --warmup steps up to --lr, never above it, then down a cosine that
    keeps 5 % of it at the end. The warm-up one step too long (1.5x the peak rate the step after)
    and the floor dropped (a run's last steps at ~0 learning rate) each passed every test (hand
    mutants)."""
    from tinyvlm.train import TrainConfig, train

    cfg = TrainConfig(out=tmp_path, steps=20, batch_size=2, warmup=2, processes=1, vision_share=0.99, bf16=False)
    train(cfg, progress=False)  # every step vision-only (fast): its stage's schedule is the same
    lrs = [float(r["lr"]) for r in csv.DictReader(open(tmp_path / "loss.csv"))]
    assert len(lrs) == 20 and lrs[:2] == [cfg.lr / 2, cfg.lr]
    assert all(later <= earlier for earlier, later in zip(lrs[1:], lrs[2:]))  # the peak, then down
    assert 0.05 * cfg.lr <= lrs[-1] < 0.1 * cfg.lr


def test_the_loss_plot_starts_at_the_first_answer(tmp_path, monkeypatch):
    """loss.png plots the answer loss from the step the decoder began to train: the vision-only
    steps before have none (NaN in loss.csv), and plotted they made its caption "loss nan -> ..."
    and its line a NaN; that passed every test (a hand mutant)."""
    import math

    import tinyvlm.train as tt

    plotted, real = [], tt._plot

    def recording(path, xs, ys):
        plotted.append((path.name, xs, ys))
        real(path, xs, ys)

    monkeypatch.setattr(tt, "_plot", recording)
    tt.train(tt.TrainConfig(out=tmp_path, steps=4, batch_size=2, warmup=2, processes=1, vision_share=0.5, bf16=False),
             progress=False)
    name, xs, ys = plotted[-1]  # at the end of the run (step 0 drew one too)
    assert name == "loss.png" and xs == [2, 3] and all(math.isfinite(y) for y in ys)


def test_a_weights_folder_with_another_tokenizer_is_refused(tmp_path):
    """--init from a folder whose tokenizer numbers its tokens otherwise (the same size, so the
    architecture matches): its embeddings mean other words, and the check that refuses it could
    be dropped with no test failing; the run trained on, and wrote train-tiny's tokenizer beside
    weights that read another's (a hand mutant)."""
    import shutil

    from engine.models.loader import TINY_DIR
    from tinyvlm.train import TrainConfig, train

    other = tmp_path / "other"
    shutil.copytree(TINY_DIR, other)
    tokenizer = json.loads((other / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    a, b = "red", "blue"
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (other / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(ValueError, match="another tokenizer"):
        train(TrainConfig(out=tmp_path / "x", init=other, steps=1, batch_size=2, processes=1), progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other"]  # nothing written


def test_a_run_that_diverges_or_stops_leaves_the_folder_as_it_was(tmp_path):
    """--lr 1e9 trained on NaN to the end, saved NaN weights and said nothing; and an interrupted
    run had already written its tokenizer, config and loss curve into --out (the shipped folder by
    default), beside the old weights: a config saying the region head was trained, over weights
    whose head was not, drew boxes at random."""
    import pytest

    from tinyvlm.train import TrainConfig, train

    out = tmp_path / "weights"
    out.mkdir()
    before = {name: f"the previous run's {name}".encode() for name in ("config.json", "model.safetensors")}
    for name, data in before.items():
        (out / name).write_bytes(data)
    with pytest.raises(ValueError, match="training diverged: the loss is not a number at step"):
        train(TrainConfig(out=out, steps=8, batch_size=2, warmup=1, processes=1, lr=1e9, regions=2), progress=False)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["weights"]  # the run's own folder is gone



def test_region_blocks_train_what_the_region_decoder_reads():
    """A detect block: the objects the phrase names left to right, each centre as the coordinate
    bins the decoder reads and feeds back, the size as its size bins; the token after the prompt and
    after each object says whether another follows; an absent thing is EOS at once."""
    from engine.models.loader import TINY_DIR, load_model as load
    from tinyvlm.data import collate
    from tinyvlm.regions import region_block

    loaded = load(str(TINY_DIR))
    cfg, tok = loaded.config, loaded.tokenizer
    eos, coord, size = cfg.tokenizer.eos_id, cfg.tokenizer.coord_id, cfg.tokenizer.size_id
    right = Obj("circle", "red", "large", cx=500, cy=100, extent=100, angle=0.0, rgb=(220, 40, 40))
    left = Obj("circle", "blue", "large", cx=100, cy=200, extent=50, angle=0.0, rgb=(40, 80, 220))
    scene = scene_with(right, left, w=640, h=320)
    b = region_block(scene, "detect", "circle", cfg, tok)
    assert b.prompt[:3] == list(cfg.tokenizer.templates.detect.prefix) and b.answer == [coord, coord, size] * 2 + [eos]
    bins = cfg.region.coord_out_dim
    # left first: centre (100, 200) of 640x320, then (500, 100)
    assert [v for _, v in b.coord_target] == [round(100 / 640 * bins), round(200 / 320 * bins),
                                              round(500 / 640 * bins), round(100 / 320 * bins)]
    assert [v for _, v in b.coord_in] == [round(100 / 640 * bins) / bins, round(200 / 320 * bins) / bins,
                                          round(500 / 640 * bins) / bins, round(100 / 320 * bins) / bins]
    (_, (w, h)), (_, (w2, _)) = b.size_in
    assert w == pytest.approx(50 / 640, rel=0.03) and h == pytest.approx(50 / 320, rel=0.03)
    assert w2 == pytest.approx(100 / 640, rel=0.03)
    batch = collate([_item_of(scene, [b])], cfg.prefix_len)
    t = batch.targets[0, cfg.prefix_len:cfg.prefix_len + len(b.prompt) + len(b.answer)].tolist()
    n = len(b.prompt)
    # each x is read where the token says an object follows: after the prompt, after the first size
    assert [j for j, _ in b.coord_target] == [n - 1, n, n + 2, n + 3]
    # after the prompt: an object follows; x and y positions predict no token; after the first
    # object's size another follows; after the second, the end
    assert t[n - 1] == coord and t[n] == t[n + 1] == -100 and t[n + 2] == coord and t[n + 5] == eos
    assert batch.coord_target.tolist() == [v for _, v in b.coord_target]
    assert [tuple(i) for i in batch.coord_target_idx.tolist()] == [(0, cfg.prefix_len + j) for j, _ in b.coord_target]
    assert region_block(scene, "point", "star", cfg, tok).answer == [eos]  # absent: the end at once
    p = region_block(scene, "point", "red", cfg, tok)
    assert p.answer == [coord, coord, eos] and not p.size_target


def _item_of(scene, blocks):
    from tinyvlm.data import Item

    return Item(np.zeros((1, 126, 126, 3), np.uint8), (1, 1), blocks, np.zeros((2, 81), np.int64),
                np.zeros((1, 81, 196), np.uint8))


def test_a_region_run_trains_the_head_on_a_frozen_vision_encoder(tmp_path, capsys):
    """--regions with --freeze-vision: the vision encoder's weights are those of --init, the region
    head's are trained, and the folder says its head is trained (the region decoder takes it)."""
    import pytest

    from app.cli import main
    from engine.models.loader import TINY_DIR
    from engine.region_decoder import RegionDecoder
    from tinyvlm.train import TrainConfig, train

    cfg = TrainConfig(out=tmp_path / "r", init=TINY_DIR, regions=2, freeze_vision=True, vision_share=0.0,
                      steps=2, batch_size=2, warmup=1, processes=1, bf16=False, lr=1e-3)
    report = train(cfg, progress=False)
    assert report["steps"] == 2 and np.isfinite(report["final_loss"])
    before, after = load_model(str(TINY_DIR)), load_model(str(cfg.out))
    assert after.config.region.trained
    b, a = before.model.state_dict(), after.model.state_dict()
    assert all(torch_equal(b[k], a[k]) for k in b if k.startswith("vision."))
    assert not all(torch_equal(b[k], a[k]) for k in b if k.startswith("region."))
    assert not all(torch_equal(b[k], a[k]) for k in b if k.startswith("text."))
    RegionDecoder(after)  # no error: the head is marked trained
    for bad in ({"freeze_vision": True}, {"regions": 9}):
        with pytest.raises(ValueError):
            TrainConfig(**bad)
    assert main(["train-tiny", "--init", str(TINY_DIR), "--freeze-vision", "--out", str(tmp_path / "y")]) == 2
    assert "vision share to 0" in capsys.readouterr().err


def torch_equal(a, b) -> bool:
    import torch

    return bool(torch.equal(a, b))


def test_a_signal_during_the_final_renames_waits_for_them():
    """Ctrl-C between two of the five renames left a new tokenizer and config beside the old
    weights, and the command said the folder was left as it was: they are one change."""
    import os
    import signal

    from tinyvlm.interrupts import signals_held

    before = signal.getsignal(signal.SIGINT)
    with signals_held():
        os.kill(os.getpid(), signal.SIGINT)  # would raise KeyboardInterrupt here
        renamed = True
    assert renamed and signal.getsignal(signal.SIGINT) is before


def test_a_render_worker_is_quiet_about_a_training_process_gone_mid_handshake():
    """Its resource-sharer thread printed a traceback through sys.excepthook when the training
    process died as it fetched a batch's tensors (seen once under a Ctrl-C's clean one line);
    other errors still print, and Ctrl-C is still ignored."""
    import subprocess
    import sys

    code = ("import signal, sys\n"
            "from multiprocessing import AuthenticationError\n"
            "from tinyvlm.interrupts import render_worker_init\n"
            "render_worker_init(0)\n"
            "assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN\n"
            "for e in (EOFError('peer gone'), ConnectionResetError(104, 'reset'), AuthenticationError('digest')):\n"
            "    sys.excepthook(type(e), e, None)\n"
            "sys.excepthook(ValueError, ValueError('a real one'), None)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       cwd=Path(__file__).resolve().parents[1])
    assert r.returncode == 0, r.stderr
    assert "a real one" in r.stderr and "peer gone" not in r.stderr and "reset" not in r.stderr
    assert "digest" not in r.stderr


def test_region_phrases_name_what_they_say_within_the_frame():
    """What a detect or point phrase names, in training and in eval-tiny's region figures: a
    colour and a shape name that one object (not every red thing and every star); boxes are
    clipped to the frame as the decoder's are; centres go to the nearest bin; about a quarter of
    the phrases drawn name nothing, so "nothing there" is trained and scored."""
    from tinyvlm.regions import coord_bin, located, sample_phrase, tight_box
    from tinyvlm.world import COLORS, sample_scene

    # 20 px past the left edge
    red_circle = Obj("circle", "red", "large", cx=10, cy=100, extent=60, angle=0.0, rgb=(220, 40, 40))
    red_star = Obj("star", "red", "small", cx=300, cy=100, extent=30, angle=0.0, rgb=(220, 40, 40))
    blue_circle = Obj("circle", "blue", "small", cx=500, cy=200, extent=30, angle=0.0, rgb=(40, 80, 220))
    scene = scene_with(red_circle, red_star, blue_circle, w=640, h=320)
    assert located(scene, "red circle") == [tight_box(red_circle, 640, 320)]
    assert located(scene, "blue star") == [] and len(located(scene, "red")) == len(located(scene, "circle")) == 2
    assert tight_box(red_circle, 640, 320) == pytest.approx((0.0, 70 / 320, 40 / 640, 130 / 320))
    corner = Obj("circle", "green", "large", cx=630, cy=300, extent=60, angle=0.0, rgb=(40, 180, 60))
    assert tight_box(corner, 640, 320) == pytest.approx((600 / 640, 270 / 320, 1.0, 1.0))
    assert coord_bin(0.5 + 0.7 / 1024, 1024) == 513 and coord_bin(0.5 + 0.3 / 1024, 1024) == 512
    empty, n, kinds = 0, 400, set()
    for i in range(n):
        scene = sample_scene(np.random.default_rng([21, i]))
        rng = np.random.default_rng([21, i, 2])
        for phrase in (sample_phrase(scene, rng), sample_phrase(scene, rng)):
            empty += not located(scene, phrase)
            words = phrase.split()
            kinds.add("all" if phrase == "shape" else "colour shape" if len(words) == 2
                      else "colour" if words[0] in COLORS else "shape")
    assert 0.15 < empty / (2 * n) < 0.45
    assert kinds == {"all", "colour shape", "colour", "shape"}


def test_training_blocks_see_the_image_and_themselves_causally_never_each_other():
    """The packed training sequence: each (prompt, answer) block attends to the image prefix and
    to its own earlier tokens, and starts at position prefix_len, exactly as one request does at
    inference; a block that saw another's tokens, or its own later ones, trains on what it will
    not have."""
    from tinyvlm.data import collate

    prefix = 3
    batch = collate([_item_of(scene_with(), [([1, 2], [3, 4]), ([5], [6, 7])])], prefix)
    m = batch.mask[0, 0]
    first, second = range(prefix, prefix + 4), range(prefix + 4, prefix + 7)
    assert m[:prefix, :prefix].all() and not m[:prefix, prefix:].any()  # the image sees itself only
    for block in (first, second):
        for i in block:
            assert m[i, :prefix].all()
            assert [bool(m[i, j]) for j in block] == [j <= i for j in block]
    assert not m[first.start:first.stop, second.start:second.stop].any()
    assert not m[second.start:second.stop, first.start:first.stop].any()
    assert batch.positions[0, prefix:].tolist() == [3, 4, 5, 6, 3, 4, 5]
    assert batch.targets[0, prefix:].tolist() == [-100, 3, 4, -100, 6, 7, -100]
