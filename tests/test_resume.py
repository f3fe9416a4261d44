"""`video --resume` reads a file from the keyframe before its first new answer: the frames
before it are replayed from the JSONL, not decoded again, and the run gives a full run's lines."""

import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

import pipelines.file_source
from app.cli import main
from pipelines.batch import Sampling
from pipelines.prompts import prompt_key
from pipelines.resume import answered, resume_point
from pipelines.sinks import FrameResult
from pipelines.sources import FileSource

CUTS = Path(__file__).resolve().parents[1] / "sample_videos" / "cuts_640x360_30fps.mp4"


def _clip(path: Path, *args: str, seconds: int = 8, height: int = 144) -> Path:
    """A clip of the cuts sample (8 s: 240 frames at 30 fps, small), encoded by Debian's ffmpeg."""
    subprocess.run([shutil.which("ffmpeg"), "-loglevel", "error", "-y", "-i", str(CUTS), "-t", str(seconds), "-vf",
                    f"scale=-2:{height}", *args, str(path)], check=True)
    return path


@pytest.fixture
def counted(monkeypatch) -> list[int]:
    """Frames out of the decoder, across every FileSource read."""
    count = [0]
    real = pipelines.file_source.decoded

    def decoded(*args, **kwargs):
        for frame in real(*args, **kwargs):
            count[0] += 1
            yield frame

    monkeypatch.setattr(pipelines.file_source, "decoded", decoded)
    return count


def _read(path: Path, **kwargs) -> tuple[list, FileSource]:
    with FileSource(path) as src:
        frames = [(f.index, f.pts, int(f.load().rgb.astype(np.int64).sum())) for f in src.frames(lazy=True, **kwargs)]
    return frames, src


@pytest.mark.parametrize("name, args, seeks", [
    ("b.mp4", ["-c:v", "libx264", "-bf", "3", "-g", "30"], True),  # B-frames: frames come out reordered
    ("m.mkv", ["-c:v", "libx264", "-g", "45"], True),
    ("a.avi", ["-c:v", "mpeg4", "-bf", "2", "-g", "30"], True),  # no times of its own: counted from decode order
    ("v.webm", ["-c:v", "libvpx-vp9", "-b:v", "200k", "-deadline", "realtime", "-g", "30"], True),
    ("t.ts", ["-c:v", "libx264", "-g", "30"], False),  # times that may jump: read from the start
])
def test_a_resumed_read_starts_at_its_frame_decoding_from_the_keyframe_before_it(tmp_path, counted, name, args, seeks):
    path = _clip(tmp_path / name, *args)
    full, src = _read(path)
    decoded, seconds, whole = src.decoded, src.seconds, counted[0]
    assert len(full) == 240
    for k in (1, 100, 200, 239):
        counted[0] = 0
        got, src = _read(path, resume=(k, round(full[k][1], 6), full[0][1]))
        assert got == full[k:], k  # same index, time and pixels as a read from the start
        assert (src.decoded, src.error) == (decoded, None) and src.seconds == pytest.approx(seconds, abs=1e-5)
        if k >= 100:  # well past the start: from a keyframe at most a second and a GOP before it
            assert (counted[0] <= 240 - k + 30 + 45) == seeks, (k, counted[0])
    assert whole == 240


def test_a_resume_frame_not_where_it_was_is_read_from_the_start(tmp_path, counted):
    """A JSONL whose frame times do not match the file (another file of the same name, re-encoded
    since) is read from the start: frames by their decoding order, as before."""
    path = _clip(tmp_path / "c.mp4", "-c:v", "libx264", "-g", "30")
    full, _ = _read(path)
    counted[0] = 0
    for pts in (full[150][1] + 0.5 / 30, 60.0):  # between two frames; past the end
        got, src = _read(path, resume=(150, pts, 0.0))
        assert got == full[150:] and src.error is None


def _records(indices: list[int], prompts: list[dict], fps: float = 30.0) -> dict:
    return {("v", i, prompt_key(p)): FrameResult("v", i, round(i / fps, 6), "x", [1], "stop", {}, p)
            for i in indices for p in prompts}


def test_the_resume_point_is_the_end_of_what_this_run_would_have_picked():
    cap, ask = {"caption": "short"}, {"question": "Is there a dog?"}
    point = lambda done, sampling, tasks=(cap,), group=None: resume_point(answered(done, "v", list(tasks)), sampling,
                                                                         group)
    every = Sampling()
    assert [i for i, _ in point(_records(list(range(10)), [cap]), every)] == list(range(10))
    assert point(_records(list(range(1, 10)), [cap]), every) == []  # no first frame: from the start
    assert point(_records([0, 1], [cap]), every) == []  # too near the start to seek
    assert [i for i, _ in point(_records([0, 1, 2, 3, 5, 6], [cap]), every)] == [0, 1, 2, 3]  # frame 4 missing
    # every prompt of a frame: the last frame has one of two answers
    done = {**_records(list(range(8)), [cap, ask]), **_records([8], [cap])}
    assert point(done, every, (cap, ask))[-1][0] == 7
    assert point(_records(list(range(0, 40, 4)), [cap]), Sampling(every_n=4))[-1][0] == 36
    assert [i for i, _ in point(_records(list(range(0, 40, 4)), [cap]), Sampling(every_n=2))] == []  # another --every-n
    # --fps: 10 a second of a 30 fps file is every third frame; written at 5 a second it is not
    assert point(_records(list(range(0, 60, 3)), [cap]), Sampling(fps=10))[-1][0] == 57
    assert point(_records(list(range(0, 60, 6)), [cap]), Sampling(fps=10)) == []
    assert point(_records(list(range(0, 60, 3)), [cap]), Sampling(fps=5)) == []  # written at a higher rate
    # 20 a second takes frames 0, 2, 3, 5, 6, 8...: one missing (a line lost, or --fps 10: 0, 3, 6) ends it
    twenty = [i for i in range(60) if i % 3 != 1]
    assert [i for i, _ in point(_records(twenty, [cap]), Sampling(fps=20))] == twenty
    assert [i for i, _ in point(_records([i for i in twenty if i != 5], [cap]), Sampling(fps=20))] == [0, 2, 3]
    assert point(_records(list(range(0, 60, 3)), [cap]), Sampling(fps=20)) == []
    # sticky groups of 4: the last whole group's last frame (the frame before the group that asks)
    assert point(_records(list(range(10)), [cap]), every, group=4)[-1][0] == 7
    assert point(_records(list(range(3)), [cap]), every, group=4) == []


def _untimed(lines: list[str]) -> list[dict]:
    # what only this run's timing and grouping say: a resumed --detect run locates what is left in
    # other batches than the full run did
    return [{k: v for k, v in json.loads(x).items() if k not in ("timings_ms", "load_ms", "batch")} for x in lines]


@pytest.mark.parametrize("sampling", [["--every-n", "3"], ["--fps", "7"], ["--every-n", "2", "--sticky", "0"],
                                      ["--every-n", "2", "--question", "What color is the star?"]])
def test_a_resumed_video_gives_a_full_runs_lines_decoding_only_what_is_left(tmp_path, small_folder, counted, capsys,
                                                                             sampling):
    path = _clip(tmp_path / "v.mp4", "-c:v", "libx264", "-g", "30")
    out = tmp_path / "o.jsonl"
    cmd = ["video", str(path), "--model", str(small_folder), "--max-tokens", "4", "-o", str(out), *sampling]
    assert main(cmd) == 0
    lines = out.read_text().splitlines()
    out.write_text("\n".join(lines[:len(lines) * 3 // 4]) + "\n")
    counted[0] = 0
    assert main(cmd + ["--resume"]) == 0
    assert _untimed(out.read_text().splitlines()) == _untimed(lines)
    assert counted[0] <= 240 // 4 + 30 + 30 + 10, counted[0]  # a quarter, from a keyframe up to 2 s before it
    assert "Traceback" not in capsys.readouterr().err


def test_a_video_resumed_with_another_fps_still_answers_every_frame_it_picks(tmp_path, small_folder, counted):
    """Answers written at 2 frames a second do not tell where a run at 5 would be: it reads the
    file from the start, as before, asking the frames the first run had not."""
    path = _clip(tmp_path / "v.mp4", "-c:v", "libx264", "-g", "30")
    base = ["video", str(path), "--model", str(small_folder), "--max-tokens", "3", "--sticky", "0"]
    assert main(base + ["--fps", "5", "-o", str(tmp_path / "five.jsonl")]) == 0
    assert main(base + ["--fps", "2", "-o", str(tmp_path / "o.jsonl")]) == 0
    counted[0] = 0
    assert main(base + ["--fps", "5", "-o", str(tmp_path / "o.jsonl"), "--resume"]) == 0
    assert counted[0] >= 240  # all of it (and the first frame, which the run reads first to check the file)
    answered = {json.loads(x)["index"] for x in (tmp_path / "o.jsonl").read_text().splitlines()}
    assert answered >= {json.loads(x)["index"] for x in (tmp_path / "five.jsonl").read_text().splitlines()}


def test_a_file_on_a_web_server_is_resumed_from_its_start(tmp_path):
    """A server that takes no byte ranges (Python's http.server) broke the reading off at the
    seek ("decoding stopped after 0 frames: Input/output error"): a file on a web server is read
    from its start, the frames before the one resumed at passed over."""
    from test_network import _serve

    _clip(tmp_path / "m.mkv", "-c:v", "libx264", "-g", "30", seconds=16, height=360)  # a seek too far to read through
    server = _serve(tmp_path)
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/m.mkv"
        full, _ = _read(url)
        assert len(full) == 480
        for k in (300, 400, 440, 470):  # a seek there had broken the reading off at some of these
            got, src = _read(url, resume=(k, round(full[k][1], 6), full[0][1]))
            assert got == full[k:] and src.error is None, (k, src.error)
    finally:
        server.shutdown()


def test_a_resumed_detect_run_reads_only_what_is_left(tmp_path, small_folder, counted):
    """`video --detect --resume`: the places found before are replayed from the JSONL, and the
    file is read from the keyframe before the last of them."""
    path = _clip(tmp_path / "v.mp4", "-c:v", "libx264", "-g", "30")
    out = tmp_path / "o.jsonl"
    cmd = ["video", str(path), "--detect", "red circle", "--every-n", "8", "--model", str(small_folder),
           "--dtype", "float32", "-o", str(out)]
    assert main(cmd) == 0
    lines = out.read_text().splitlines()
    out.write_text("\n".join(lines[:len(lines) * 3 // 4]) + "\n")
    counted[0] = 0
    assert main(cmd + ["--resume"]) == 0
    assert _untimed(out.read_text().splitlines()) == _untimed(lines) and len(lines) == 30
    assert counted[0] <= 240 // 4 + 30 + 30 + 10, counted[0]


def test_a_frame_whose_line_is_missing_is_asked_again(tmp_path, small_folder):
    """--fps 20 of a 30 fps file takes frames 0, 2, 3, 5, 6...: a JSONL without frame 5's line
    (a 3-frame gap, within the 1.5-frame slack the first check allowed) was replayed past it, and
    frame 5 was never asked."""
    path = _clip(tmp_path / "v.mp4", "-c:v", "libx264", "-bf", "3", "-g", "30", seconds=4)
    out = tmp_path / "o.jsonl"
    cmd = ["video", str(path), "--model", str(small_folder), "--max-tokens", "3", "--sticky", "0", "--fps", "20",
           "-o", str(out)]
    assert main(cmd) == 0
    full = out.read_text().splitlines()
    out.write_text("".join(x + "\n" for x in full[:12] if json.loads(x)["index"] != 5))
    assert main(cmd + ["--resume"]) == 0
    assert sorted(json.loads(x)["index"] for x in out.read_text().splitlines()) == \
        sorted(json.loads(x)["index"] for x in full)


def _pairs(path: Path) -> Path:
    """Frames in pairs sharing one time (0, 0, 0.067, 0.067...): an MKV's times may repeat."""
    return _clip(path, "-vf", "scale=-2:144,setpts='floor(N/2)*2/30/TB'", "-fps_mode", "passthrough", "-c:v", "libx264",
                 "-bf", "0", "-g", "30")


def test_frames_sharing_a_time_are_resumed_at_the_right_one(tmp_path, small_folder):
    """Resumed at frame 37, the second of two frames at 1.2 s, the seek found frame 36 first by
    that time and called it 37: every later index one too high, one line more than the file has
    frames (a helper's adversarial run). A frame whose time the next one shares is read from the
    start."""
    path = _pairs(tmp_path / "d.mkv")
    full, _ = _read(path)
    assert full[36][1] == full[37][1] and len(full) == 240
    for k in (36, 37, 117):
        got, src = _read(path, resume=(k, round(full[k][1], 6), full[0][1]))
        assert got == full[k:] and src.error is None, k
    out = tmp_path / "o.jsonl"
    cmd = ["video", str(path), "--model", str(small_folder), "--max-tokens", "3", "--sticky", "0", "-o", str(out)]
    assert main(cmd) == 0
    lines = out.read_text().splitlines()
    out.write_text("".join(x + "\n" for x in lines[:38]))  # stopped after frame 37
    assert main(cmd + ["--resume"]) == 0
    assert _untimed(out.read_text().splitlines()) == _untimed(lines)


@pytest.mark.parametrize("fps", [20, 24, 25, 29.97, 30, 45, 60])
def test_one_frame_missing_at_a_rate_near_the_videos_ends_the_replay_before_it(fps):
    """At --fps near 30 a single missing frame left a gap the first check let through (a helper
    counted up to 38 of 38 positions passed over)."""
    cap = {"caption": "short"}
    picked, pick = [], Sampling(fps=fps).picker()
    picked = [i for i in range(60) if pick(i, round(i / 30, 6))]
    for gone in picked[3:-1]:
        kept = [i for i in picked if i != gone]
        prefix = resume_point(answered(_records(kept, [cap]), "v", [cap]), Sampling(fps=fps))
        assert not prefix or prefix[-1][0] < gone, (gone, prefix[-1])
