"""`vlmstream video` with a slow model (Moondream 2 on a CPU: 15-30 s an answer), played by the
small test model with every engine step slowed (`_slowed`): Ctrl-C, the progress bar, the
summary. Each test takes a few seconds, where the slow model's answers would take minutes."""

import threading
import time
from pathlib import Path

import pytest

from app.cli import main

ROOT = Path(__file__).resolve().parents[1]
CLIP = ROOT / "sample_videos" / "cuts_640x360_30fps.mp4"  # 16 s, 480 frames


def _slowed(monkeypatch, step_s: float) -> threading.Event:
    """Every engine step takes step_s longer; the event is set once a file waits for an answer."""
    from engine.batch import Batch
    from engine.request import RequestHandle

    commit, wait, waiting = Batch.commit, RequestHandle.wait, threading.Event()

    def slow_commit(self, record):
        time.sleep(step_s)
        return commit(self, record)

    def waited(self, *a, **k):
        waiting.set()
        return wait(self, *a, **k)

    monkeypatch.setattr(Batch, "commit", slow_commit)
    monkeypatch.setattr(RequestHandle, "wait", waited)
    return waiting


def test_a_second_ctrl_c_cancels_the_frames_under_way(tmp_path, small_folder, monkeypatch):
    """"Ctrl-C again to quit now" did not: the pool's exit waited for its workers, and they for
    the answers under way (Moondream 2 on a CPU: 26 s after the second Ctrl-C). Now those are
    cancelled, and the run ends at the engine's next step."""
    from app.video_run import _AllDone

    waiting = _slowed(monkeypatch, 0.25)  # 64 tokens: 16 s an answer
    monkeypatch.setattr("app.video_run.DOUBLE_SIGNAL_S", 0.0)
    wait, second = _AllDone.wait, [None]

    def interrupted(self, *a, **k):  # the first Ctrl-C once the file waits for an answer
        if waiting.is_set():
            raise KeyboardInterrupt
        return wait(self, *a, **k)

    import concurrent.futures
    result = concurrent.futures.Future.result

    def interrupted_again(self, *a, **k):  # the second as the run waits for the frames under way
        if second[0] is None:
            second[0] = time.perf_counter()
            raise KeyboardInterrupt
        return result(self, *a, **k)

    monkeypatch.setattr(_AllDone, "wait", interrupted)
    monkeypatch.setattr(concurrent.futures.Future, "result", interrupted_again)
    out = tmp_path / "o.jsonl"
    assert main(["video", str(CLIP), "--fps", "0.5", "--max-tokens", "64", "--sticky", "0", "--model",
                 str(small_folder), "-o", str(out)]) == 130
    assert time.perf_counter() - second[0] < 4.0  # a step or two, not the 16 s of the answer
    assert out.read_text() == ""  # the cancelled answer is not written


def test_a_ctrl_c_asks_no_frame_after_those_under_way(capsys, tmp_path, small_folder, monkeypatch):
    """After a Ctrl-C, once the frames under way were answered, the next group was still asked
    and the file decoded on to the group after it, then both cancelled: the bar said 94 % done
    (Moondream 2 at --fps 0.2, 2 of 4 frames answered), the speed counted video never answered."""
    from app.video_run import _AllDone
    from engine import Engine

    waiting = _slowed(monkeypatch, 0.03)
    wait, submit, asked = _AllDone.wait, Engine.submit, []

    def interrupted(self, *a, **k):  # Ctrl-C while the first frame's answer is awaited
        if waiting.is_set() and not asked[1:]:
            raise KeyboardInterrupt
        return wait(self, *a, **k)

    monkeypatch.setattr(_AllDone, "wait", interrupted)
    monkeypatch.setattr(Engine, "submit", lambda self, *a, **k: (asked.append(1), submit(self, *a, **k))[1])
    out = tmp_path / "o.jsonl"
    assert main(["video", str(CLIP), "--fps", "0.2", "--max-tokens", "64", "--model", str(small_folder),
                 "-o", str(out)]) == 130
    assert len(asked) == 1 and len(out.read_text().splitlines()) == 1  # frame 0 answered, no other asked
    bar = capsys.readouterr().err
    assert "151/480" in bar and "301/480" not in bar  # the frame staged, none decoded past it


def test_on_a_terminal_a_bar_waiting_for_a_slow_answer_keeps_its_clock_running(capsys, tmp_path, small_folder,
                                                                               monkeypatch):
    """tqdm redraws a bar when it moves: until the slow model's first answer (33 s for Moondream 2
    on a CPU) it stood at "0/480 [00:00<?", as if the run hung. On a terminal it is redrawn."""
    _slowed(monkeypatch, 0.04)  # 64 tokens: 2.5 s an answer
    monkeypatch.setattr("app.video_run.on_terminal", lambda: True, raising=False)
    monkeypatch.setattr("app.video_progress.TICK_S", 0.2, raising=False)
    assert main(["video", str(CLIP), "--fps", "0.1", "--max-tokens", "64", "--model", str(small_folder),
                 "-o", str(tmp_path / "o.jsonl")]) == 0
    assert "0/480 [00:01<?" in capsys.readouterr().err  # still no frame answered, a second on


def test_off_a_terminal_a_bar_is_drawn_only_when_it_moves(capsys, tmp_path, small_folder, monkeypatch):
    """In a log file (2>>job.log) a redraw a second would be a line a second for hours."""
    _slowed(monkeypatch, 0.04)
    monkeypatch.setattr("app.video_progress.TICK_S", 0.2, raising=False)
    assert main(["video", str(CLIP), "--fps", "0.1", "--max-tokens", "64", "--model", str(small_folder),
                 "-o", str(tmp_path / "o.jsonl")]) == 0
    assert "0/480 [00:01<?" not in capsys.readouterr().err


def test_a_resumed_runs_speed_is_over_the_video_it_answered(tmp_path, small_folder):
    """The summary's "x real time" of a resumed run counted the video from the file's start: one
    that answered the last 6 s of 16 (Moondream 2 on a CPU, 47 s) said 0.34x, not 0.13x."""
    from engine import Engine, EngineConfig
    from engine.types import SamplingParams
    from pipelines.batch import Sampling, caption_file
    from pipelines.sinks import JsonlSink, done_frames
    from pipelines.sources import FileSource

    out, params, every = tmp_path / "o.jsonl", SamplingParams(max_tokens=4), Sampling(every_n=120)
    with Engine(EngineConfig(model=str(small_folder))) as engine:
        def run(done=None):
            with FileSource(str(CLIP)) as src:
                sink = JsonlSink(out)
                try:
                    return caption_file(engine, src, [sink], {"caption": "short"}, params, every, done=done)
                finally:
                    sink.close()

        assert run().video_seconds == pytest.approx(16.0)  # frames 0, 120, 240 and 360 of 480
        out.write_text("".join(out.read_text().splitlines(keepends=True)[:2]))  # stopped after frame 120
        again = run(done_frames(out))
    assert (again.frames_skipped, again.frames_captioned) == (2, 2)
    assert again.video_seconds == pytest.approx(16.0 - 8.0)  # from frame 240 on


def test_a_slow_runs_summary_says_how_long_a_frame_took():
    """Moondream 2 on a CPU at --fps 0.2: "0.18x real time" alone did not say what another --fps
    or a longer video would take (23 s a frame); a fast run's line is as it was."""
    from app.video import pace_text

    assert pace_text(91.0, 4) == " (a frame every 23 s)"
    assert pace_text(1.3, 32) == pace_text(0.0, 0) == pace_text(50.0, 0) == ""


def test_a_slow_model_load_is_said(capsys, tmp_path, small_folder, monkeypatch):
    """Moondream 2 from a cold disk took 22-30 s to load with nothing on the terminal, then the
    bar; a load past LOAD_NOTICE_S is said (the small model's, well under it, is not)."""
    argv = ["video", str(CLIP), "--every-n", "240", "--max-tokens", "2", "--model", str(small_folder),
            "-o", str(tmp_path / "o.jsonl")]
    assert main(argv) == 0
    assert "loading the model" not in capsys.readouterr().err
    monkeypatch.setattr("app.video.LOAD_NOTICE_S", 0.0, raising=False)
    assert main(argv) == 0
    assert f"vlmstream: loading the model ({small_folder})\n" in capsys.readouterr().err


def test_a_run_of_one_frame_says_one_frame(capsys, small_folder):
    """Moondream 2 on a CPU at `--fps 0.05` (one frame of a 16 s clip) said "1 frames captioned"."""
    assert main(["video", str(CLIP), "--fps", "0.05", "--model", str(small_folder), "--max-tokens", "2"]) == 0
    assert "vlmstream: 1 frame captioned, 0 skipped (resume), 1 file(s), " in capsys.readouterr().err
