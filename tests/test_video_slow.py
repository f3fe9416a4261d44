"""`vlmstream video` with a slow model (Moondream 2 on a CPU: 15-30 s an answer), played by the
small test model with every engine step slowed (`_slowed`): Ctrl-C, the progress bar, the
summary. Each test takes a few seconds, where the slow model's answers would take minutes."""

import threading
import time
from pathlib import Path

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
