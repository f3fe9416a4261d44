"""Interleavings of threads that lost a source's error, a frame, a feed's stop or a whole feed,
each forced by a pause at the point where another thread got in (found by an audit; unforced,
each came a few times in tens of thousands of tries, or never on an idle machine)."""

import threading
import time
from pathlib import Path

import numpy as np
import pytest

from engine import SamplingParams
from pipelines import grabber as grabber_module
from pipelines.frame import Frame, SourceError


def _pause_after_a_timed_out_get(monkeypatch, thread_name: str, seconds: float) -> None:
    """The taker of frames is switched out right after a get() that came back empty."""
    get = grabber_module.LatestFrameGrabber.get

    def paused(self, timeout=5.0):
        frame = get(self, timeout)
        if frame is None and threading.current_thread().name == thread_name:
            time.sleep(seconds)
        return frame

    monkeypatch.setattr(grabber_module.LatestFrameGrabber, "get", paused)


def _fails_after_one_frame(after: float):
    def frames():  # a camera that sent a frame, then was given up (--max-outage)
        yield Frame("cam", 0, 0.0, np.zeros((16, 16, 3), np.uint8))
        time.sleep(after)
        raise SourceError("cannot read rtsp://cam: Connection refused (nothing for 60 s)")
    return frames


def test_a_source_that_fails_while_the_feed_waits_is_its_error_not_its_end(monkeypatch):
    """The pump's wait for a frame timed out, the source failed, and the pump then read the
    grabber's end flag: a clean end, the error lost (`live URL --max-outage S` exited 0)."""
    from pipelines.feed import LiveFeed
    from pipelines.live import LiveSession

    _pause_after_a_timed_out_get(monkeypatch, "vlmstream-feed", 0.4)
    monkeypatch.setattr(LiveSession, "offer", lambda self, frame: True)  # no engine: only the source matters
    feed = LiveFeed(None, {"caption": "short"}, SamplingParams(), _fails_after_one_frame(0.7), realtime=False)
    try:
        feed._pump.join(10)
        assert not feed._pump.is_alive()
        assert isinstance(feed.exception, SourceError) and "Connection refused" in feed.error
    finally:
        feed.close()


def test_a_located_source_that_fails_or_ends_as_it_is_looked_at_keeps_its_error_and_last_frame(monkeypatch):
    """The same in `live --detect`: its error never reached the run (exit 0, no warning), or a
    short clip's last frame was never located."""
    from pipelines.locator import LiveLocator, LocateSource

    _pause_after_a_timed_out_get(monkeypatch, "vlmstream-locator", 0.03)

    def locate(rgb):
        return {"objects": [], "timings_ms": {"total": 0.1}}

    failing = LiveLocator(locate, [LocateSource("cam", _fails_after_one_frame(0.01), realtime=False)], "person")
    failing._thread.join(10)
    assert "cam" in failing.exceptions()
    failing.close()

    def two_frames():  # a short file: its last frame 50 ms after its first, then its end
        for i in range(2):
            time.sleep(0.05 * i)
            yield Frame("clip", i, i * 0.05, np.zeros((16, 16, 3), np.uint8))

    seen: list = []
    ending = LiveLocator(locate, [LocateSource("clip", two_frames, realtime=False)], "person",
                         on_result=lambda r: seen.append(r.frame.index))
    ending._thread.join(10)
    ending.close()
    assert seen == [0, 1]


def test_a_feeds_callback_turned_off_from_another_thread_is_not_called_as_none():
    """The web UI's Record unticked (or its recording taken) sets a feed's callback to None while
    a result is delivered: the check passed, then None was called, and a detect feed stopped
    with "'NoneType' object is not callable"."""
    from pipelines.feed import LiveFeed

    feed = LiveFeed(None, {"detect": "circle"}, SamplingParams(),
                    locate=lambda rgb: {"objects": [], "timings_ms": {"total": 0.1}})
    given: list = []

    class SlowToTest:
        def __bool__(self):
            time.sleep(0.05)  # the delivering thread is switched out right after the check
            return True

        def __call__(self, r):
            given.append(r)

    stop = threading.Event()

    def push() -> None:
        while not stop.is_set():
            feed.push(np.zeros((32, 32, 3), np.uint8))
            time.sleep(0.005)

    pusher = threading.Thread(target=push, daemon=True)
    pusher.start()
    try:
        feed.on_result = SlowToTest()
        time.sleep(0.02)
        feed.on_result = None  # Record off
        time.sleep(0.3)
        snap = feed.snapshot()
        assert snap.running and snap.error is None, snap.error
    finally:
        stop.set()
        pusher.join(5)
        feed.close()


def test_live_stats_read_while_results_come_in(small_folder):
    """The web UI reads a session's stats on its own thread while the session records results:
    a comprehension over the growing deque raised "deque mutated during iteration", and the page
    stopped the viewer's feed. Forced by a completion time whose comparison lets the other
    thread in."""
    from engine import Engine, EngineConfig
    from pipelines.live import LiveSession

    class SwitchesOut(float):
        def __ge__(self, other):
            time.sleep(0.005)
            return float(self) >= other

    with Engine(EngineConfig(model=str(small_folder))) as engine:
        session = LiveSession(engine, {"caption": "short"}, SamplingParams(max_tokens=4), max_inflight=4)
        session._completions.append(SwitchesOut(time.perf_counter()))
        try:
            for i in range(6):
                session.offer(Frame("cam", i, i / 60, np.full((64, 64, 3), 40 * i, np.uint8)))
                for _ in range(20):
                    session.stats()
        finally:
            session.close()
        assert session.completed >= 1


def test_a_start_that_loses_to_closing_its_tab_leaves_no_feed():
    """Start took its session's lock a moment after checking the session was open; a tab closed
    in between found nothing to stop, and the feed then started played on for nobody."""
    from app.service import Service, Settings, UIError

    service = Service(Settings(max_tokens=4))
    try:
        service.start_live("tab", "shapes_640x360_60fps.mp4", {"caption": "short"})  # its lock now exists
        service.stop_live("tab")
        lock = service.live._starting["tab"]

        class LateToTake:  # the Start is switched out before it takes the session's lock
            def __enter__(self):
                if threading.current_thread().name == "start":
                    time.sleep(0.3)
                return lock.__enter__()

            def __exit__(self, *exc):
                return lock.__exit__(*exc)

        service.live._starting["tab"] = LateToTake()
        failed: list = []

        def start() -> None:
            try:
                service.start_live("tab", "shapes_640x360_60fps.mp4", {"caption": "short"})
            except UIError as e:
                failed.append(e)

        starting = threading.Thread(target=start, name="start")
        starting.start()
        time.sleep(0.1)
        service.close_session("tab")
        starting.join(30)
        assert service.feed("tab") is None and len(failed) == 1
    finally:
        service.close()
        service.remove_outputs()


def test_a_frame_added_as_the_recording_closes_is_written_or_not_taken(tmp_path):
    """add() passed its closed check, close() queued the end mark, and the frame went in after
    it: neither written nor counted as skipped."""
    from engine.types import RequestOutput
    from pipelines.live import LiveResult
    from pipelines.recorder import Recorder

    rec = Recorder(tmp_path / "r.mp4")
    put = rec._queue.put_nowait
    adding = threading.Event()

    def late_put(item):
        adding.set()
        time.sleep(0.3)  # close() comes now
        put(item)

    rec._queue.put_nowait = late_put
    rgb = np.full((120, 160, 3), 90, np.uint8)
    result = LiveResult(Frame("cam", 0, 0.0, rgb, captured_at=100.0), [RequestOutput("yes", [], "stop")], 20.0,
                        [{"caption": "short"}])
    adder = threading.Thread(target=rec.add, args=(result,))
    adder.start()
    assert adding.wait(5)
    rec.close()
    adder.join(5)
    assert rec.written + rec.skipped == 1 and rec.error is None


def test_a_start_that_loses_to_a_model_reload_is_told_to_start_again():
    """Another viewer's Settings > Apply reloaded the model while a Start opened its source: the
    feed was built on the engine the reload closed, installed, and showed "the engine is closed"
    with nothing captioned."""
    from app.service import Service, Settings, UIError
    from app.task import make_task

    service = Service(Settings(max_tokens=4, dtype="float32"))
    try:
        service.engine()
        reloaded = threading.Event()
        region_of = service.region_of

        def after_the_reload(task):  # between engine() and the feed's construction
            if threading.current_thread().name == "start":
                reloaded.wait(60)
            return region_of(task)

        service.region_of = after_the_reload
        said: list = []

        def start() -> None:
            try:
                service.start_live("tab", "shapes_640x360_60fps.mp4", make_task("short"))
            except UIError as e:
                said.append(str(e))

        starting = threading.Thread(target=start, name="start")
        starting.start()
        time.sleep(0.3)
        assert service.apply(Settings(max_tokens=4, dtype="bfloat16")) == "engine reloaded"
        reloaded.set()
        starting.join(60)
        feed = service.feed("tab")
        assert feed is None and said and "reloaded" in said[0], (said, feed and feed.snapshot().error)
    finally:
        service.close()
        service.remove_outputs()


def test_a_page_that_leaves_live_while_its_sample_restarts_leaves_it_paused():
    """Back on Live the page restarts its sample; gone again before that Start had opened it, the
    page's leaving found no feed to pause, and the sample played on for nobody."""
    import types

    from app import ui
    from app.service import Service, Settings

    service = Service(Settings(max_tokens=4))
    try:
        handlers = {f.name: f.fn for f in ui.build(service).fns.values()}
        page = types.SimpleNamespace(session_hash="tab")
        form = ("shapes_640x360_60fps.mp4", None, "short", "", "none", "")
        updates = []  # the page's update streams, kept open as Gradio keeps them (closed, each stops its feed)
        updates.append(handlers["autoplay"](*form, request=page))
        next(updates[-1])  # the page opens on Live: the sample plays
        handlers["leave_live"](request=page)  # ...and goes to another tab: paused
        assert service.feed("tab") is None
        start = service.start_live

        def slow_start(*args, **kwargs):
            time.sleep(0.6)  # opening the source on a busy server
            return start(*args, **kwargs)

        service.start_live = slow_start
        updates.append(handlers["back_to_live"](*form, request=page))
        opening = threading.Thread(target=next, args=(updates[-1],))
        opening.start()
        time.sleep(0.2)
        handlers["leave_live"](request=page)  # away again while the sample opens
        opening.join(30)
        time.sleep(0.5)
        feed = service.feed("tab")
        assert feed is None or not feed.running
        service.start_live = start
        updates.append(handlers["back_to_live"](*form, request=page))
        next(updates[-1])  # and back: it plays again
        assert service.feed("tab") is not None and service.feed("tab").running
        handlers["closed"](request=page)
    finally:
        service.close()
        service.remove_outputs()


def test_an_interrupt_as_an_annotated_frame_is_written_keeps_the_frames_the_encoder_held(tmp_path):
    """Ctrl-C (or SIGTERM) raised while a frame was muxed was taken for a failed write: close()
    then skipped the encoder's flush, and the MP4 lost the frames x264 still held (27 of 40)."""
    import av

    from pipelines.annotated import AnnotatedVideoSink

    sink = AnnotatedVideoSink(tmp_path / "a.mp4", 160, 120)
    mux, calls = sink._mux, [0]

    def interrupted(packets):
        calls[0] += 1
        if calls[0] == 21:
            raise KeyboardInterrupt  # the signal, raised between two bytecodes here
        mux(packets)

    sink._mux = interrupted
    rgb = np.full((120, 160, 3), 90, np.uint8)
    for i in range(20):
        sink.write_image(rgb, f"frame {i}", "", i / 10)
    with pytest.raises(KeyboardInterrupt):
        sink.write_image(rgb, "frame 20", "", 2.0)
    sink.close()
    with av.open(str(tmp_path / "a.mp4")) as c:
        assert sum(1 for _ in c.decode(video=0)) >= 20


def test_a_second_interrupt_before_the_stop_is_set_still_stops_video(tmp_path, small_folder):
    """GNU `timeout -s INT` signals the command and then its group, microseconds apart: a second
    SIGINT that came as the first one's handler began escaped it before it told the workers to
    stop, and the run captioned every frame of every file before exiting. Forced: the second is
    sent from inside the stop flag's set()."""
    import os
    import subprocess
    import sys

    clip = Path(__file__).resolve().parents[1] / "sample_videos" / "cuts_640x360_30fps.mp4"
    out = tmp_path / "o.jsonl"
    script = f"""if True:
        import os, signal, sys, threading, time
        set_ = threading.Event.set
        armed = [True]
        def set_and_signal(self):
            if armed[0] and sys._getframe(1).f_code.co_filename.endswith("video.py") \\
                    and threading.current_thread() is threading.main_thread():
                armed[0] = False
                os.kill(os.getpid(), signal.SIGINT)  # the group's copy of the signal, now
            return set_(self)
        threading.Event.set = set_and_signal
        def first():
            while not (os.path.exists({str(out)!r}) and open({str(out)!r}).read().count("\\n") >= 8):
                time.sleep(0.02)
            os.kill(os.getpid(), signal.SIGINT)
        threading.Thread(target=first, daemon=True).start()
        sys.argv = ["vlmstream", "video", {str(clip)!r}, "--every-n", "4", "--model", {str(small_folder)!r},
                    "--max-tokens", "8", "-o", {str(out)!r}]
        from app.launcher import entry
        entry()
    """
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=Path(__file__).resolve().parents[1])
    lines = out.read_text().count("\n")
    assert run.returncode == 130 and lines < 100, (run.returncode, lines, run.stderr[-800:])
