"""Detect and point (engine/region_decoder.py): Moondream 2's region protocol, checked against a
plain re-reading of the whole sequence at every step, on a small random Moondream layout."""

import json
import os
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from app.cli import main
from engine.errors import RequestError
from engine.models.loader import load_model
from engine.models.text import attention, attention_mask
from engine.region_decoder import RegionDecoder


@pytest.fixture(scope="module")
def loaded(small_folder):
    return load_model(str(small_folder), device="cpu", dtype="float32")


def _plain(loaded, rgb, what: str, task: str, max_objects: int) -> list[dict]:
    """The protocol as Moondream's own loop states it, without a KV cache: every step runs the
    whole sequence (image prefix, prompt, and every coordinate and size fed back) again."""
    model, cfg = loaded.model, loaded.config
    text, region = model.text, model.region
    crops, tiling = model.preprocess(rgb)
    inputs = [model.prefix_embeddings(model.image_tokens(crops, tiling))[0]]
    t = getattr(cfg.tokenizer.templates, task)
    ids = list(t.prefix) + loaded.tokenizer.encode(" " + what) + list(t.suffix)
    inputs.append(text.embed(torch.tensor(ids)))

    def last_hidden() -> torch.Tensor:
        x = torch.cat(inputs)[None]
        n = x.shape[1]

        def attend(layer, q, k, v):
            return attention(q, k, v, attention_mask(torch.arange(n), n, cfg.prefix_len)[None, None], True)

        return text(x, torch.arange(n)[None], attend)[:, -1]

    def coordinate(h):
        logits = region.decode_coordinate(h)
        return float(logits.argmax(-1)) / logits.shape[-1]

    out = []
    h = last_hidden()
    while int(text.logits(h).argmax(-1)) != cfg.tokenizer.eos_id and len(out) < max_objects:
        x = coordinate(h)
        inputs.append(region.encode_coordinate(torch.tensor([[x]])))
        y = coordinate(h := last_hidden())
        inputs.append(region.encode_coordinate(torch.tensor([[y]])))
        if task == "detect":
            bins = region.decode_size(h := last_hidden())[0]
            w, hh = (2.0 ** (bins.argmax(-1).float() / (bins.shape[-1] - 1) * 10 - 10)).tolist()
            inputs.append(region.encode_size(torch.tensor([w, hh]))[None])
            out.append({"x_min": x - w / 2, "y_min": y - hh / 2, "x_max": x + w / 2, "y_max": y + hh / 2})
        else:
            out.append({"x": x, "y": y})
        h = last_hidden()
    return out


@pytest.mark.parametrize("task", ["detect", "point"])
def test_region_decoding_follows_the_protocol_step_for_step(loaded, rgb_image, task):
    got = RegionDecoder(loaded).locate(rgb_image, "red circle", task, max_objects=4)
    key = "objects" if task == "detect" else "points"
    want = _plain(loaded, rgb_image, "red circle", task, max_objects=4)
    assert len(got[key]) == len(want) >= 1 and got["timings_ms"]["total"] > 0
    for a, b in zip(got[key], want):
        assert a.keys() == b.keys() and all(a[k] == pytest.approx(b[k], abs=1e-6) for k in a)
    for o in got[key]:
        assert all(0 <= o[k] < 1 for k in o if k in ("x", "y"))
        if task == "detect":  # a box about its centre bin, its size a power of two of the image
            assert o["x_max"] > o["x_min"] and o["y_max"] > o["y_min"]


def test_the_end_token_ends_the_objects_and_max_objects_caps_them(loaded, rgb_image, monkeypatch):
    decoder = RegionDecoder(loaded)
    eos = loaded.config.tokenizer.eos_id
    calls = []
    real = loaded.model.text.logits

    def logits(h):  # "another object" twice, then the end
        out = real(h).clone()
        calls.append(1)
        out[..., eos] = out.max() + (1.0 if len(calls) == 3 else -1.0)
        return out

    monkeypatch.setattr(loaded.model.text, "logits", logits)
    assert len(decoder.locate(rgb_image, "star", "point")["points"]) == 2
    calls.clear()
    monkeypatch.setattr(loaded.model.text, "logits", lambda h: torch.where(
        torch.arange(real(h).shape[-1]) == eos, -1e9, real(h)))  # never the end: capped
    assert len(decoder.locate(rgb_image, "star", "detect", max_objects=3)["objects"]) == 3
    for bad in [("", "detect", 3), ("star", "segment", 3), ("star", "detect", 0)]:
        with pytest.raises(RequestError):
            decoder.locate(rgb_image, *bad[:2], max_objects=bad[2])


def test_a_model_whose_region_head_was_never_trained_refuses(capsys, untrained_folder):
    with pytest.raises(RequestError, match="region head was not trained"):
        RegionDecoder(load_model(str(untrained_folder)))
    assert main(["image", "sample_videos/scene.png", "--detect", "red circle", "--model", str(untrained_folder)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("vlmstream: error: this model's region head was not trained") and err.count("\n") == 1


def test_image_detect_and_point_on_the_command_line(capsys, small_folder, tmp_path):
    from PIL import Image

    rgb = np.random.default_rng(3).integers(0, 256, (120, 200, 3), dtype=np.uint8)
    Image.fromarray(rgb).save(tmp_path / "a.png")
    args = ["image", str(tmp_path / "a.png"), "--model", str(small_folder), "--dtype", "float32"]
    assert main([*args, "--detect", "red circle", "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["detect"] == "red circle" and record["width"] == 200 and record["height"] == 120
    assert len(record["pixels"]) == len(record["objects"])
    for box, o in zip(record["pixels"], record["objects"]):  # the fractions are rounded to 4 places
        want = [o["x_min"] * 200, o["y_min"] * 120, o["x_max"] * 200, o["y_max"] * 120]
        assert all(abs(a - b) <= 0.55 for a, b in zip(box, want))
    assert main([*args, "--point", "star"]) == 0
    assert capsys.readouterr().out.startswith("star: ")
    # several images: located a batch at a time, each as alone, in the order given, with a progress bar
    decoder = RegionDecoder(load_model(str(small_folder), device="cpu", dtype="float32"))
    names = [f"{i}.png" for i in range(6)]
    rgbs = [np.random.default_rng(10 + i).integers(0, 256, (60 + 10 * i, 90, 3), dtype=np.uint8) for i in range(6)]
    for name, im in zip(names, rgbs):
        Image.fromarray(im).save(tmp_path / name)
    assert main(["image", *(str(tmp_path / n) for n in names), "--detect", "star", "--json", *args[2:]]) == 0
    captured = capsys.readouterr()
    rows = [json.loads(x) for x in captured.out.splitlines()]
    assert [Path(r["image"]).name for r in rows] == names
    assert [r["objects"] for r in rows] == [[{k: round(v, 4) for k, v in o.items()}
                                             for o in decoder.locate(im, "star")["objects"]] for im in rgbs]
    assert [r["batch"] for r in rows] == [4, 4, 4, 4, 2, 2] and "6/6" in captured.err
    assert all(set(r["timings_ms"]) == {"total"} for r in rows)  # milliseconds only: the count is "batch"
    assert main([*args, "--point", "  "]) == 2
    assert main([*args, "--detect", "star", "--choices", "a,b"]) == 2
    assert "--detect gives places" in capsys.readouterr().err
    # what shapes a decoded answer means nothing to places: it was ignored without a word
    for flag, value in (("--max-tokens", "5"), ("--temperature", "0.5"), ("--top-p", "0.5"), ("--seed", "3"),
                        ("--seed", "0")):
        assert main([*args, "--point", "star", flag, value]) == 2
        assert capsys.readouterr().err == (f"vlmstream: error: {flag} goes with captions and questions, not --point "
                                           "(places are decoded greedily by the region protocol, beside the engine)\n")
    # One image that fails to decode mid-run (its header reads) is said, the others are located,
    # exit 1; one skipped in a folder counts too. Both had been exit 2 with nothing located, or exit 0.
    data = (tmp_path / "0.png").read_bytes()
    (tmp_path / "4.png").write_bytes(data[: len(data) // 2])
    (tmp_path / "5.png").write_bytes(b"")
    assert main(["image", *(str(tmp_path / n) for n in names[:5]), "--detect", "star", "--json", *args[2:]]) == 1
    captured = capsys.readouterr()
    rows = [json.loads(x) for x in captured.out.splitlines()]
    assert [Path(r["image"]).name for r in rows] == names[:5] and "error" in rows[4] and "objects" not in rows[4]
    assert [r["objects"] for r in rows[:4]] == [[{k: round(v, 4) for k, v in o.items()}
                                                 for o in decoder.locate(im, "star")["objects"]] for im in rgbs[:4]]
    assert "4 images located, 1 could not be read" in captured.err
    assert main(["image", str(tmp_path), "--detect", "star", *args[2:]]) == 1  # 5.png skipped, 4.png cut
    captured = capsys.readouterr()
    assert "skipped" in captured.err and "5 images located, 2 could not be read" in captured.err
    assert len(captured.out.splitlines()) == 5


def test_one_image_that_fails_to_decode_is_the_detect_runs_error(capsys, small_folder, tmp_path):
    """`image cut.png --detect star`: the one image named fails to decode (its header reads): that
    is the run's error, one line, exit 2, not a warning and exit 0 with nothing located."""
    from PIL import Image

    Image.fromarray(np.random.default_rng(3).integers(0, 256, (120, 200, 3), dtype=np.uint8)).save(tmp_path / "a.png")
    data = (tmp_path / "a.png").read_bytes()
    (tmp_path / "cut.png").write_bytes(data[: len(data) // 2])
    assert main(["image", str(tmp_path / "cut.png"), "--detect", "star", "--model", str(small_folder)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.startswith(f"vlmstream: error: {tmp_path / 'cut.png'} could not be "
                                                          "decoded") and captured.err.count("\n") == 1, captured.err


def _clip(path, frames: int, fps: int):
    """An H.264 clip of random 96x64 frames (frame i from seed i)."""
    import av

    with av.open(str(path), "w") as c:
        s = c.add_stream("libx264", rate=fps)
        s.width, s.height, s.pix_fmt = 96, 64, "yuv420p"
        for i in range(frames):
            rgb = np.random.default_rng(i).integers(0, 256, (64, 96, 3), dtype=np.uint8)
            for p in s.encode(av.VideoFrame.from_ndarray(rgb, format="rgb24")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    return path


def _check_rows(rows: list[dict], clip, loaded) -> None:
    """Each JSON line's boxes are the decoder's for that frame of the clip alone."""
    from pipelines.sources import FileSource

    decoder = RegionDecoder(loaded)
    with FileSource(clip) as src:
        frames = {f.index: f.rgb for f in src.frames()}
    for r in rows:
        want = decoder.locate(frames[r["index"]], "red circle", "detect")["objects"]
        assert r["objects"] == [{k: round(v, 4) for k, v in o.items()} for o in want]
        assert len(r["pixels"]) == len(want) and (r["width"], r["height"]) == (96, 64)
        assert r["timings_ms"]["total"] > 0


def test_video_detect_and_point_give_each_processed_frame_its_places(capsys, small_folder, loaded, tmp_path,
                                                                    untrained_folder):
    """`video --detect OBJECT`: the region protocol on every processed frame, the same places as
    the decoder gives that frame alone, as JSON lines, terminal lines and drawn on --annotate."""
    import av

    clip = _clip(tmp_path / "clip.mp4", 9, 10)
    out, ann = tmp_path / "boxes.jsonl", tmp_path / "boxes.mp4"
    model = ["--model", str(small_folder), "--dtype", "float32"]
    assert main(["video", str(clip), "--detect", "red circle", "--every-n", "4", "-o", str(out),
                 "--annotate", str(ann), *model]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["index"] for r in rows] == [0, 4, 8] and all(r["detect"] == "red circle" for r in rows)
    _check_rows(rows, clip, loaded)
    with av.open(str(ann)) as c:
        assert sum(1 for _ in c.decode(video=0)) == 3
    assert "vlmstream: 3 frames," in capsys.readouterr().err
    # --resume: an interrupted run's lines (the last one cut short) are kept, the rest located
    lines = out.read_text().splitlines()
    out.write_text(lines[0] + "\n" + lines[1][:20])
    assert main(["video", str(clip), "--detect", "red circle", "--every-n", "4", "-o", str(out), "--resume",
                 "--annotate", str(ann), *model]) == 0
    assert out.read_text().splitlines() == [lines[0], *out.read_text().splitlines()[1:]]
    assert [json.loads(x)["objects"] for x in out.read_text().splitlines()] == [r["objects"] for r in rows]
    # matched whole: a rate such as "8.33 frames/s" holds "3 frames" too
    assert "vlmstream: 2 frames," in (err := capsys.readouterr().err) and ", 1 done before" in err
    with av.open(str(ann)) as c:  # the frame done before is drawn again from its line
        assert sum(1 for _ in c.decode(video=0)) == 3
    # another object on the same file: nothing of it was done
    assert main(["video", str(clip), "--point", "red circle", "--every-n", "4", "-o", str(out), "--resume",
                 *model]) == 0
    assert len(out.read_text().splitlines()) == 6 and ", 0 done before" in capsys.readouterr().err
    assert main(["video", str(clip), "--point", "star", "--every-n", "8", *model]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and all(line.split()[1] == "star:" for line in lines)
    # mistakes are one line, exit 2, before any output is written
    for bad in (["--detect", "star", "--caption", "short"],
                ["--detect", "star", "--changes", "-o", str(tmp_path / "x.srt")],
                ["--point", "star", "--resume", "-o", str(tmp_path / "x.srt")], ["--detect", " "],
                ["--detect", "star", "--snapshots", str(tmp_path / "s")], ["--detect", "star", "--max-tokens", "5"],
                ["--point", "star", "--no-vision-thread"]):
        assert main(["video", str(clip), *bad, *model]) == 2
    assert not (tmp_path / "x.jsonl").exists() and not (tmp_path / "x.srt").exists()
    with pytest.raises(SystemExit) as e:  # argparse: one or the other
        main(["video", str(clip), "--detect", "a", "--point", "b"])
    assert e.value.code == 2
    tiny = tmp_path / "tiny.jsonl"
    assert main(["video", str(clip), "--detect", "star", "--model", str(untrained_folder), "-o", str(tiny)]) == 2
    assert "region head was not trained" in capsys.readouterr().err and not tiny.exists()



def test_live_detect_locates_the_newest_frames_of_a_source(capsys, small_folder, loaded, tmp_path, untrained_folder):
    """`live SOURCE --detect OBJECT`: each located frame's places are the decoder's for that
    frame, in frame order, with the latency from capture; a JSON log, a recording with the boxes,
    the closing figures; mistakes are exit 2 before anything is written."""
    import av

    # 2 s: a loaded machine (a locate 4x slower) still locates several frames in it
    clip = _clip(tmp_path / "cam.mp4", 40, 20)
    out, ann = tmp_path / "places.jsonl", tmp_path / "places.mp4"
    model = ["--model", str(small_folder), "--dtype", "float32"]
    assert main(["live", str(clip), "--detect", "red circle", "-o", str(out), "--annotate", str(ann),
                 "--json", *model]) == 0
    captured = capsys.readouterr()
    summary = json.loads(captured.out)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert summary["frames_in"] == 40 and summary["completed"] == len(rows) >= 3
    assert summary["recording"]["frames"] + summary["recording"]["skipped"] == len(rows)
    indices = [r["index"] for r in rows]
    assert indices == sorted(set(indices)) and indices[-1] >= 35  # newest frames, to the end of the clip
    _check_rows(rows, clip, loaded)
    assert all(r["timings_ms"]["end_to_end"] >= r["timings_ms"]["total"] and r["time"].endswith("+00:00")
               for r in rows)
    with av.open(str(ann)) as c:
        assert sum(1 for _ in c.decode(video=0)) == summary["recording"]["frames"]
    # terminal lines: time, latency, the points in pixels; the closing figures on stderr. --fps 2
    # allows at most 2 a second of the run's wall time, and one more after a slow frame: a bound
    # of the run's own length, as a loaded machine stretches it (a fixed count had no margin)
    start = time.perf_counter()
    assert main(["live", str(clip), "--point", "star", "--fps", "2", *model]) == 0
    elapsed = time.perf_counter() - start
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    assert 3 <= len(lines) <= 2 * elapsed + 2 and all(line.split()[3] == "star:" for line in lines)
    assert "frames located" in captured.err and "passed over" in captured.err
    # mistakes: one line, exit 2, before any output is written
    bad_out = tmp_path / "x.jsonl"
    for bad in (["--detect", "star", "--caption", "short"], ["--detect", "star", "--hold", "2"],
                ["--point", "star", "--max-inflight", "2"], ["--detect", " "], ["--detect", "star", "--sticky", "0"],
                ["--detect", "star", "--max-tokens", "9"], ["--point", "star", "--no-vision-thread"]):
        assert main(["live", str(clip), *bad, "-o", str(bad_out), *model]) == 2
        err = capsys.readouterr().err
        assert err.startswith("vlmstream: error: ") and err.count("\n") == 1, err
    assert not bad_out.exists()
    assert main(["live", str(clip), "--detect", "star", "--model", str(untrained_folder), "-o", str(bad_out)]) == 2
    assert "region head was not trained" in capsys.readouterr().err and not bad_out.exists()


def _fake_locate(monkeypatch):
    """A region decoder whose number found follows the frame (its first pixel's red, mod 3), so
    that counts change along a clip as objects coming and going would."""
    def locate(self, image, what, task="detect", max_objects=None):
        n = int(np.asarray(image)[0, 0, 0]) % 3
        if task == "detect":
            return {"objects": [{"x_min": 0.1 * i, "y_min": 0.1, "x_max": 0.1 * i + 0.1, "y_max": 0.3}
                                for i in range(n)], "timings_ms": {"total": 1.0}}
        return {"points": [{"x": 0.1 * i + 0.05, "y": 0.2} for i in range(n)], "timings_ms": {"total": 1.0}}

    monkeypatch.setattr(RegionDecoder, "locate", locate)
    monkeypatch.setattr(RegionDecoder, "locate_batch", lambda self, images, what, task="detect", max_objects=None: [
        locate(self, im, what, task) for im in images])


def _reported(counts: list[tuple[int, float]], hold: int) -> list[tuple[int, int | None, float]]:
    """What --changes must report for frames' (number found, pts): (number, previous, since)."""
    out, current, pending = [], None, None
    for n, pts in counts:
        if n == current:
            pending = None
            continue
        pending = (n, pending[1], pending[2] + 1) if pending and pending[0] == n else (n, pts, 1)
        if pending[2] >= hold:
            out.append((n, current, pending[1]))
            current, pending = n, None
    return out


def test_video_detect_changes_reports_when_the_number_found_changes(capsys, small_folder, tmp_path, monkeypatch):
    """`video --detect OBJECT --changes`: a line only when the number found differs from the
    last report (held --hold frames), with `previous` and `since`; --snapshots keeps each change's
    frame with its boxes; the terminal says "(was N found)" and the closing line the changes."""
    from PIL import Image

    _fake_locate(monkeypatch)
    clip = _clip(tmp_path / "clip.mp4", 40, 10)
    model = ["--model", str(small_folder), "--dtype", "float32"]
    every, changed, shots = tmp_path / "all.jsonl", tmp_path / "changes.jsonl", tmp_path / "shots"
    assert main(["video", str(clip), "--detect", "star", "-o", str(every), *model]) == 0
    counts = [(len(r["objects"]), r["pts"]) for r in map(json.loads, every.read_text().splitlines())]
    assert len(counts) == 40 and len({n for n, _ in counts}) == 3
    assert _reported(counts, 2) != _reported(counts, 1)  # so that --hold is seen at work
    for hold in (1, 2):
        capsys.readouterr()
        assert main(["video", str(clip), "--detect", "star", "--changes", "--hold", str(hold), "--snapshots",
                     str(shots / str(hold)), "-o", str(changed), *model]) == 0
        rows = [json.loads(x) for x in changed.read_text().splitlines()]
        want = _reported(counts, hold)
        assert 2 <= len(want) < 40 and [(len(r["objects"]), r["previous"], r["since"]) for r in rows] == want
        assert f"{len(want)} changes" in capsys.readouterr().err
        for r in rows:  # the frame the new count began on (--hold 2: the one before the line's), at 10 fps
            assert Path(r["snapshot"]).parent == shots / str(hold)
            assert Path(r["snapshot"]).name.endswith(f"_{round(r['since'] * 10):07d}.jpg"), (r["snapshot"], r["since"])
            with Image.open(r["snapshot"]) as im:
                assert im.size == (96, 64)
        assert len(list((shots / str(hold)).iterdir())) == len(rows)
    # on the terminal: the changed frames alone
    capsys.readouterr()
    assert main(["video", str(clip), "--point", "star", "--changes", *model]) == 0
    lines = capsys.readouterr().out.splitlines()
    want = _reported(counts, 1)
    assert len(lines) == len(want) and "was" not in lines[0]
    assert all(f"(was {prev} found)" in line for line, (_, prev, _) in zip(lines[1:], want[1:]))
    assert main(["video", str(clip), "--detect", "star", "--changes", "--resume", "-o", str(changed), *model]) == 2


def test_video_detect_subtitles_say_the_number_found(capsys, small_folder, tmp_path, monkeypatch):
    """`video --detect OBJECT -o OUT.srt` (or a folder's --format): a cue per run of frames with
    the same number found, "star: 2 found", from the first frame of the run to the next run."""
    import re

    _fake_locate(monkeypatch)
    clip = _clip(tmp_path / "clip.mp4", 30, 10)
    model = ["--model", str(small_folder), "--dtype", "float32"]
    every = tmp_path / "all.jsonl"
    assert main(["video", str(clip), "--detect", "star", "-o", str(every), *model]) == 0
    rows = [json.loads(x) for x in every.read_text().splitlines()]
    runs: list[list] = []  # [number found, first pts]
    for r in rows:
        if not runs or runs[-1][0] != len(r["objects"]):
            runs.append([len(r["objects"]), r["pts"]])
    want = [f"star: {n} found" if n else "star: none found" for n, _ in runs]
    assert main(["video", str(clip), "--detect", "star", "-o", str(tmp_path / "star.srt"), *model]) == 0
    assert capsys.readouterr().out == ""  # the subtitles are the output: no terminal lines
    assert main(["video", str(clip), "--detect", "star", "-o", str(tmp_path / "out") + "/", "--format", "jsonl,vtt",
                 *model]) == 0
    beside = [json.loads(x) for x in (tmp_path / "out" / "clip.jsonl").read_text().splitlines()]
    assert [(r["index"], r["objects"]) for r in beside] == [(r["index"], r["objects"]) for r in rows]
    for path, sep in ((tmp_path / "star.srt", ","), (tmp_path / "out" / "clip.vtt", ".")):
        text = path.read_text()
        cues = re.findall(r"(\d\d):(\d\d):(\d\d)" + re.escape(sep) + r"(\d{3}) --> [^\n]+\n([^\n]+)\n", text)
        assert [c[4] for c in cues] == want, path
        starts = [int(h) * 3600 + int(m) * 60 + int(sec) + int(ms) / 1000 for h, m, sec, ms, _ in cues]
        assert starts == pytest.approx([pts for _, pts in runs], abs=0.002)


def test_live_detect_changes_reports_when_the_number_found_changes(capsys, small_folder, tmp_path, monkeypatch):
    """`live SOURCE --detect OBJECT --changes`: each logged frame's number found differs from the
    one before it, which it names as `previous`; the figures count the changes."""
    _fake_locate(monkeypatch)
    clip = _clip(tmp_path / "cam.mp4", 40, 20)
    out, shots = tmp_path / "changes.jsonl", tmp_path / "shots"
    assert main(["live", str(clip), "--detect", "star", "--changes", "--snapshots", str(shots), "-o", str(out),
                 "--json", "--model", str(small_folder), "--dtype", "float32"]) == 0
    summary = json.loads(capsys.readouterr().out)
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert summary["changes"] == len(rows) >= 2 and summary["completed"] > len(rows)
    found = [len(r["objects"]) for r in rows]
    assert [r["previous"] for r in rows] == [None, *found[:-1]]
    assert all(a != b for a, b in zip(found, found[1:]))
    assert all(Path(r["snapshot"]).exists() for r in rows) and len(list(shots.iterdir())) == len(rows)


def test_live_detect_says_a_silent_source_and_exits_1(capsys, small_folder, tmp_path, monkeypatch):
    """`live CAM1 CAM2 --detect`: a camera that never sends beside one that does is said, with
    why, and the run exits 1, as `live` without --detect: it had passed without a word, exit 0."""
    import socket

    _fake_locate(monkeypatch)
    clip = _clip(tmp_path / "cam.mp4", 20, 20)  # looped to --duration
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:  # a free port nobody sends to
        s.bind(("127.0.0.1", 0))
        silent = f"udp://127.0.0.1:{s.getsockname()[1]}"
    out = tmp_path / "places.jsonl"
    assert main(["live", str(clip), silent, "--detect", "star", "--duration", "2.5", "-o", str(out), "--json",
                 "--model", str(small_folder), "--dtype", "float32"]) == 1
    captured = capsys.readouterr()
    summary = json.loads(captured.out)
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert summary["sources"][silent]["frames_in"] == 0 and summary["sources"][str(clip)]["frames_in"] >= 20
    assert len(rows) == summary["completed"] >= 2 and {r["source"] for r in rows} == {str(clip)}
    assert f"vlmstream: warning: {silent}: no frames received" in captured.err and "Traceback" not in captured.err


def test_live_detect_rates_a_source_that_ended_early_over_its_own_time(capsys, small_folder, tmp_path, monkeypatch):
    """`live short.mp4 long.mp4 --detect`: each source was rated over the whole run's time, so the
    1 s clip's frames were said to come at half their rate while the 2 s clip played on. Each is
    rated over its own time now, and the total is the run's frames over the longest time."""
    _fake_locate(monkeypatch)
    short, long = _clip(tmp_path / "short.mp4", 20, 20), _clip(tmp_path / "long.mp4", 40, 20)
    assert main(["live", str(short), str(long), "--detect", "star", "--json", "--model", str(small_folder),
                 "--dtype", "float32"]) == 0
    summary = json.loads(capsys.readouterr().out)
    a, b = summary["sources"][str(short)], summary["sources"][str(long)]
    span_a, span_b = a["completed"] / a["achieved_fps"], b["completed"] / b["achieved_fps"]
    assert span_a < span_b - 0.4, (span_a, span_b)  # the clips play 1 s apart in real time
    assert summary["achieved_fps"] == pytest.approx(summary["completed"] / span_b)


def test_video_detect_says_a_write_error_in_one_line(capsys, small_folder, tmp_path, monkeypatch):
    """A full disk under `video --detect -o`: one error line and exit 1, not a traceback."""
    from pipelines.sinks import JsonlSink

    def full(self, records):
        raise OSError(28, "No space left on device", str(tmp_path / "boxes.jsonl"))

    _fake_locate(monkeypatch)
    monkeypatch.setattr(JsonlSink, "write_records", full)
    clip = _clip(tmp_path / "clip.mp4", 4, 10)
    assert main(["video", str(clip), "--detect", "star", "-o", str(tmp_path / "boxes.jsonl"),
                 "--model", str(small_folder), "--dtype", "float32"]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[-1] == f"vlmstream: error: cannot write {tmp_path / 'boxes.jsonl'}: No space left on device"


@pytest.mark.parametrize("task", ["detect", "point"])
def test_locating_several_images_at_once_gives_each_its_own_places(loaded, task, monkeypatch):
    """`locate_batch`: one forward a step for every image, the places each image gets alone, also
    when their objects end at different steps (the end token here follows the hidden state, so
    each image stops at a count of its own)."""
    eos = loaded.config.tokenizer.eos_id
    real = loaded.model.text.logits

    def logits(h):
        out = real(h).clone()
        stop = (h.float().sum(-1) * 1000).floor() % 3 == 0
        out[stop, eos] = out[stop].max(-1).values + 1.0
        out[~stop, eos] = out[~stop].min(-1).values - 1.0
        return out

    monkeypatch.setattr(loaded.model.text, "logits", logits)
    decoder = RegionDecoder(loaded)
    rng = np.random.default_rng(11)
    images = [rng.integers(0, 256, (48 + 8 * i, 64, 3), dtype=np.uint8) for i in range(6)]
    alone = [decoder.locate(im, "red circle", task, max_objects=6) for im in images]
    together = decoder.locate_batch(images, "red circle", task, max_objects=6)
    key = "objects" if task == "detect" else "points"
    counts = [len(r[key]) for r in alone]
    assert len(set(counts)) >= 2 and max(counts) >= 2  # the batch shrinks as images finish
    assert [r[key] for r in together] == [r[key] for r in alone]
    assert all(r["batch"] == 6 for r in together) and decoder.locate_batch([], "star") == []


def test_video_detect_locates_frames_in_batches_with_the_same_places(capsys, small_folder, tmp_path):
    """`video --detect --batch N`: frames located N at a time give the lines one at a time gives,
    in frame order; --batch is for region tasks only, and >= 1."""
    clip = _clip(tmp_path / "clip.mp4", 7, 10)
    model = ["--model", str(small_folder), "--dtype", "float32"]
    rows = {}
    for batch in (1, 3):
        out = tmp_path / f"b{batch}.jsonl"
        assert main(["video", str(clip), "--detect", "red circle", "--batch", str(batch), "-o", str(out), *model]) == 0
        rows[batch] = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["index"] for r in rows[3]] == list(range(7))
    assert [(r["objects"], r["pixels"]) for r in rows[3]] == [(r["objects"], r["pixels"]) for r in rows[1]]
    assert {r["batch"] for r in rows[3]} == {3, 1}  # 3 + 3 + the last one
    capsys.readouterr()
    for bad in (["--detect", "star", "--batch", "0"], ["--caption", "short", "--batch", "2"]):
        assert main(["video", str(clip), *bad, *model]) == 2
        err = capsys.readouterr().err
        assert err.startswith("vlmstream: error: --batch") and err.count("\n") == 1


def test_a_batch_of_raw_and_encoded_images_locates_each_as_alone(loaded, rgb_image):
    """A batch may mix frames and images encoded before (as eval-tiny passes them): each gets the
    places it gets alone."""
    decoder = RegionDecoder(loaded)
    rng = np.random.default_rng(3)
    images = [rng.integers(0, 256, (64 + 16 * i, 80, 3), dtype=np.uint8) for i in range(3)] + [rgb_image]
    alone = [decoder.locate(im, "star", "detect", max_objects=3)["objects"] for im in images]
    mixed = [images[0], decoder.reference.encode_image(images[1]), images[2], decoder.reference.encode_image(rgb_image)]
    assert alone[0] != alone[1]  # so that two images sharing one image's keys would show
    # two (two cameras) as well as four: each image's keys and values in the batch's buffer
    for batch, want in ((images, alone), (mixed, alone), (images[:2], alone[:2])):
        assert [r["objects"] for r in decoder.locate_batch(batch, "star", "detect", max_objects=3)] == want


def test_eval_tiny_scores_detect_and_point_against_the_scenes_truth(loaded, monkeypatch):
    """eval-tiny's region figures (a model whose head is trained): a decoder that gives the true
    boxes scores 1 everywhere; one box too many costs precision and the count, not recall; boxes
    half a box off (IoU < 0.5) and points outside every box are misses."""
    from collections import defaultdict

    import tinyvlm.evaluate as ev

    truth: list = []
    real_located = ev.located

    def located(scene, phrase):
        truth[:] = real_located(scene, phrase)
        return list(truth)

    def decoder_giving(boxes):
        def locate(self, image, what, task="detect", max_objects=None):
            got = boxes(list(truth))
            if task == "detect":
                return {"objects": [dict(zip(("x_min", "y_min", "x_max", "y_max"), b)) for b in got]}
            return {"points": [{"x": (b[0] + b[2]) / 2, "y": (b[1] + b[3]) / 2} for b in got]}
        return locate

    monkeypatch.setattr(ev, "located", located)
    cases = {
        "true": lambda t: t,
        "one more": lambda t: t + [(0.0, 0.0, 0.01, 0.01)],
        "off": lambda t: [(b[2] + 0.01, b[1], 2 * b[2] - b[0] + 0.01, b[3]) for b in t],  # beside it
        "twice": lambda t: t + t,  # each object found twice: one of the two is right
        # moved right by a fifth of its width (IoU 2/3, a hit) or by two fifths (3/7, a miss)
        "a fifth": lambda t: [(b[0] + (b[2] - b[0]) / 5, b[1], b[2] + (b[2] - b[0]) / 5, b[3]) for b in t],
        "two fifths": lambda t: [(b[0] + 2 * (b[2] - b[0]) / 5, b[1], b[2] + 2 * (b[2] - b[0]) / 5, b[3])
                                 for b in t],
    }
    scores = {}
    for name, boxes in cases.items():
        monkeypatch.setattr(RegionDecoder, "locate", decoder_giving(boxes))
        hits = defaultdict(lambda: [0, 0])
        ev.evaluate_regions(loaded, 12, ev.RENDERERS["world"], hits, lambda k: None)
        scores[name] = {k: v[0] / v[1] for k, v in hits.items() if v[1]}
    assert scores["true"] == {f"{t}_{k}": 1.0 for t in ("detect", "point") for k in ("recall", "precision", "count")}
    more = scores["one more"]
    assert more["detect_recall"] == more["point_recall"] == 1.0
    assert more["detect_precision"] < 1.0 and more["detect_count"] == more["point_count"] == 0.0
    off = scores["off"]
    assert off["detect_recall"] == off["point_recall"] == 0.0 and off["detect_count"] == 1.0
    twice = scores["twice"]
    assert twice["detect_recall"] == twice["point_recall"] == 1.0
    assert twice["detect_precision"] == twice["point_precision"] == 0.5
    assert scores["a fifth"]["detect_recall"] == 1.0
    assert scores["two fifths"]["detect_recall"] == 0.0 and scores["two fifths"]["point_recall"] == 1.0


def test_video_detect_resume_checks_its_model_and_log_and_keeps_what_it_had(capsys, small_folder, tmp_path,
                                                                         monkeypatch):
    """--detect's --resume took another model's places, continued a --changes log with every frame,
    and a resumed run stopped early cut its subtitles and annotated video back."""
    import av

    import pipelines.sources

    clip = _clip(tmp_path / "clip.mp4", 12, 10)
    out, ann = tmp_path / "boxes.jsonl", tmp_path / "boxes.mp4"
    model = ["--model", str(small_folder), "--dtype", "float32"]
    detect = ["video", str(clip), "--detect", "red circle", "--every-n", "3"]
    assert main([*detect, "-o", str(out), "--annotate", str(ann), *model]) == 0
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert {r["model"] for r in rows} == {os.path.realpath(small_folder)}
    lines = out.read_text()
    assert main([*detect, "-o", str(out), "--resume"]) == 2  # the tiny model
    assert "holds the places of" in capsys.readouterr().err and out.read_text() == lines
    assert main([*detect, "--changes", "-o", str(tmp_path / "c.jsonl"), *model]) == 0
    assert main([*detect, "-o", str(tmp_path / "c.jsonl"), "--resume", *model]) == 2
    assert "written with --changes" in capsys.readouterr().err

    def frames(path):
        with av.open(str(path)) as c:
            return sum(1 for _ in c.decode(video=0))

    shown = frames(ann)
    real = pipelines.sources.FileSource.frames

    def stopped(self, *a, **k):  # a stop after the first frame (Ctrl-C, SIGTERM)
        for i, frame in enumerate(real(self, *a, **k)):
            if i == 1:
                raise KeyboardInterrupt
            yield frame

    monkeypatch.setattr(pipelines.sources.FileSource, "frames", stopped)
    assert main([*detect, "-o", str(out), "--annotate", str(ann), "--resume", *model]) == 130
    assert frames(ann) == shown and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_detect_json_lines_follow_the_images_order_when_one_fails_to_decode(capsys, small_folder, tmp_path):
    """An image of a batch that failed to decode had its error line written as the batch was
    read, before the places of the images ahead of it (b's error, then a's boxes)."""
    import shutil

    scene = Path(__file__).resolve().parents[1] / "sample_videos" / "scene.png"
    shutil.copy(scene, tmp_path / "a.png")
    data = scene.read_bytes()
    (tmp_path / "b.png").write_bytes(data[: len(data) // 2])  # its header reads: it fails when decoded
    shutil.copy(scene, tmp_path / "c.png")
    assert main(["image", *(str(tmp_path / n) for n in ("a.png", "b.png", "c.png")), "--detect", "star", "--json",
                 "--model", str(small_folder)]) == 1
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [Path(r["image"]).name for r in rows] == ["a.png", "b.png", "c.png"]
    assert "error" in rows[1] and rows[0]["objects"] == rows[2]["objects"]


def test_video_detect_refuses_sticky_as_live_detect_does(capsys, small_folder, tmp_path):
    """`video --detect star --sticky 1` ran and ignored --sticky without a word, where `live
    --detect` refuses it (exit 2): places are located afresh in every frame, nothing sticks."""
    clip = _clip(tmp_path / "clip.mp4", 4, 10)
    out = tmp_path / "boxes.jsonl"
    for task in ("--detect", "--point"):
        assert main(["video", str(clip), task, "star", "--sticky", "1", "-o", str(out), "--model", str(small_folder),
                     "--dtype", "float32"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("vlmstream: error: --sticky goes with captions and questions") and err.count("\n") == 1
    assert not out.exists()


def _never_the_end(loaded, monkeypatch):
    real, eos = loaded.model.text.logits, loaded.config.tokenizer.eos_id
    monkeypatch.setattr(loaded.model.text, "logits", lambda h: torch.where(
        torch.arange(real(h).shape[-1]) == eos, -1e9, real(h)))


# (room after the prompt in the small layout: 105, 104, 105 and 94 positions: a whole number of
# objects, some left over, and MAX_OBJECTS reached first)
@pytest.mark.parametrize("task, what", [("detect", "red circle"), ("detect", "the red circle"), ("point", "red circle"),
                                        ("point", "the small red circle next to the blue square")])
def test_objects_go_on_until_the_context_is_full(loaded, rgb_image, monkeypatch, task, what):
    """A model that never says the end fills the context with whole objects (x, y and for detect
    the size: a position each) and stops there, or at MAX_OBJECTS, whichever comes first."""
    from engine.region_decoder import MAX_OBJECTS

    _never_the_end(loaded, monkeypatch)
    cfg = loaded.config
    t = getattr(cfg.tokenizer.templates, task)
    ids = list(t.prefix) + loaded.tokenizer.encode(" " + what) + list(t.suffix)
    room = cfg.text.max_context - cfg.prefix_len - len(ids)
    per_object = 3 if task == "detect" else 2
    key = "objects" if task == "detect" else "points"
    got = RegionDecoder(loaded).locate(rgb_image, what, task)[key]
    assert len(got) == min(MAX_OBJECTS, room // per_object)


def test_the_model_reads_back_the_place_it_reported(loaded, rgb_image, monkeypatch):
    """Each object's x, then y, then (detect) its width and height go back into the model as the
    protocol says: the next object follows from the places the caller was given."""
    _never_the_end(loaded, monkeypatch)
    region = loaded.model.region
    fed = []
    for name in ("encode_coordinate", "encode_size"):
        real = getattr(region, name)
        monkeypatch.setattr(region, name, lambda v, real=real, name=name: fed.append((name, v[0].tolist())) or real(v))
    boxes = RegionDecoder(loaded).locate(rgb_image, "red circle", "detect", max_objects=4)["objects"]
    want = []
    for o in boxes:
        cx, cy, w, h = ((o["x_min"] + o["x_max"]) / 2, (o["y_min"] + o["y_max"]) / 2,
                        o["x_max"] - o["x_min"], o["y_max"] - o["y_min"])
        want += [("encode_coordinate", [cx]), ("encode_coordinate", [cy]), ("encode_size", [w, h])]
    assert len(boxes) == 4 and any(w != h for (_, (w, h)) in want[2::3])  # a flip of (w, h) would show
    assert [n for n, _ in fed] == [n for n, _ in want]
    assert all(a == pytest.approx(b, abs=1e-6) for (_, a), (_, b) in zip(fed, want))


def test_the_object_asked_for_is_read_without_the_spaces_around_it(loaded, rgb_image):
    """Text from a form or a command line comes with stray spaces and newlines: the prompt is the
    object's words, as `--detect "red circle"` gives them."""
    decoder = RegionDecoder(loaded)
    for task, key in (("detect", "objects"), ("point", "points")):
        stray = decoder.locate(rgb_image, "  red circle \n", task, 3)[key]
        assert stray == decoder.locate(rgb_image, "red circle", task, 3)[key]


@pytest.mark.parametrize("top", [True, False])
def test_a_box_is_its_size_bin_about_its_centre(loaded, rgb_image, monkeypatch, top):
    """The size bins span 2 ** -10 .. 1 of the image: the top bin is a box as large as the image
    (half of it either side of the centre), bin 0 a box of 1/1024."""
    region = loaded.model.region
    real = region.decode_size

    def decode_size(h):
        bins = real(h)
        return torch.zeros_like(bins).index_fill_(-1, torch.tensor([bins.shape[-1] - 1 if top else 0]), 1.0)

    monkeypatch.setattr(region, "decode_size", decode_size)
    size = 1.0 if top else 2.0 ** -10
    boxes = RegionDecoder(loaded).locate(rgb_image, "red circle", "detect", max_objects=2)["objects"]
    assert boxes
    for o in boxes:
        assert o["x_max"] - o["x_min"] == pytest.approx(size) and o["y_max"] - o["y_min"] == pytest.approx(size)
        assert 0 <= (o["x_min"] + o["x_max"]) / 2 < 1 and 0 <= (o["y_min"] + o["y_max"]) / 2 < 1


@pytest.mark.parametrize("task", ["detect", "point"])
def test_a_prompt_that_leaves_no_room_for_one_object_is_refused_not_none_found(loaded, rgb_image, monkeypatch, task):
    """With fewer positions left than one object takes (x, y, and for detect the size), the model
    is never asked where anything is: "none found" would be a claim about the image that nobody
    made. Room for exactly one object gives it."""
    _never_the_end(loaded, monkeypatch)
    cfg = loaded.config
    t = getattr(cfg.tokenizer.templates, task)
    per_object = 3 if task == "detect" else 2
    decoder = RegionDecoder(loaded)
    key = "objects" if task == "detect" else "points"

    def what_with_room(room):  # "star star ...": a long object's name that leaves `room` positions
        for n in range(1, cfg.text.max_context):
            what = " ".join(["star"] * n)
            ids = list(t.prefix) + loaded.tokenizer.encode(" " + what) + list(t.suffix)
            if cfg.text.max_context - cfg.prefix_len - len(ids) == room:
                return what
        raise AssertionError(f"no name leaves {room} positions")

    assert len(decoder.locate(rgb_image, what_with_room(per_object), task)[key]) == 1
    for room in range(per_object):
        with pytest.raises(RequestError, match="does not fit"):
            decoder.locate(rgb_image, what_with_room(room), task)


def test_live_detect_the_recording_of_a_source_that_ended_before_the_run_ends_with_it(capsys, small_folder,
                                                                                   tmp_path, monkeypatch):
    """As live's captions: `live short.mp4 long.mp4 --detect --annotate DIR/` had recorded the 1 s
    clip 2 s long, its last frame held to the run's end."""
    import av

    _fake_locate(monkeypatch)
    short, long = _clip(tmp_path / "short.mp4", 20, 20), _clip(tmp_path / "long.mp4", 40, 20)
    out = tmp_path / "recordings"
    assert main(["live", str(short), str(long), "--detect", "star", "--annotate", f"{out}/", "--json",
                 "--model", str(small_folder), "--dtype", "float32"]) == 0
    stats = json.loads(capsys.readouterr().out)["sources"]
    with av.open(stats[str(short)]["recording"]["path"]) as c:
        assert float(c.duration / av.time_base) < 1.5
    with av.open(stats[str(long)]["recording"]["path"]) as c:  # one that played to the end: as long as it
        assert float(c.duration / av.time_base) > 1.5
