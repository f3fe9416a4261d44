"""Live-session semantics on a slow fake device: stale cancellation, intake drops, deadlines."""

import json
import os
import re
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import engine.engine as engine_module
from engine import Engine, EngineConfig, SamplingParams
from engine.runner import StepResult
from engine.types import RequestOutput, StageTimings
from pipelines.grabber import LatestFrameGrabber
from pipelines.live import LIVE_STICKY, LiveSession
from pipelines.sources import Frame

from test_engine_properties import FakeRunner


class NewestStopsFirst(FakeRunner):
    """Each step takes 15 ms; request `stop_id` says EOS after two tokens, the others go on."""

    stop_id = None

    def launch(self, plan, step_id):
        slot = self.slots[step_id % 2]
        assert not slot.busy
        slot.busy = True
        rows = [c.seq for c in plan.prefills if c.last] + plan.decodes
        newest = NewestStopsFirst.stop_id

        def run():
            time.sleep(0.015)
            for i, s in enumerate(rows):
                slot.tokens[i] = 0 if (s.id == newest and s.launched >= 2) else 7
            return StepResult(rows, slot.tokens[: len(rows)], {})

        return self.executor.launch(run), slot


def _frames(n):
    return [Frame("cam", i, i / 60, np.full((48, 64, 3), (10 * i) % 256, np.uint8)) for i in range(n)]


def _wait(pred, timeout=10.0):
    end = time.time() + timeout
    while not pred() and time.time() < end:
        time.sleep(0.005)
    assert pred()


def test_newer_result_cancels_older_frames(small_folder, monkeypatch):
    monkeypatch.setattr(engine_module, "Runner", NewestStopsFirst)
    monkeypatch.setattr(NewestStopsFirst, "stop_id", None)
    results = []
    with Engine(EngineConfig(model=str(small_folder), debug_checks=True)) as eng:
        s = LiveSession(eng, {"caption": "short"}, SamplingParams(max_tokens=200), max_inflight=3,
                        on_result=results.append)
        for f in _frames(3):
            assert s.offer(f)
        NewestStopsFirst.stop_id = s._inflight[-1][1][0].id  # the newest frame's request
        _wait(lambda: s.completed == 1 and s.in_flight == 0)
        s.close()
        st = s.stats()
        assert st["cancelled_stale"] == 2 and st["completed"] == 1 and st["dropped"] == 0
        assert [r.frame.index for r in results] == [2]
        _wait(lambda: eng.stats().kv_pages_in_use == 0)
    assert eng.stats().kv_pages_in_use == 0


def test_a_live_sources_unconverted_frames_are_converted_when_taken(small_folder):
    """open_live's frames come without their pixels (converted on demand): the README's own
    example, `for frame in open_live(...).frames(): session.offer(frame)`, was an ImageError."""
    rgb = np.random.default_rng(1).integers(0, 256, (48, 64, 3), dtype=np.uint8)
    converted = []
    results = []
    with Engine(EngineConfig(model=str(small_folder))) as eng:
        s = LiveSession(eng, {"caption": "short"}, SamplingParams(max_tokens=3), max_inflight=1,
                        on_result=results.append)
        frames = [Frame("cam", i, i / 10, None, convert=lambda: converted.append(1) or rgb) for i in range(3)]
        taken = [s.offer(f) for f in frames]  # with one in flight, those offered meanwhile are dropped
        _wait(lambda: s.in_flight == 0 and s.completed >= 1)
        s.close()
    assert taken[0] and len(converted) == sum(taken)  # a frame dropped at intake is never converted
    assert results and all(np.array_equal(r.frame.rgb, rgb) for r in results)


class _HeldHandle:
    """A request handle that finishes when the test says so."""

    def __init__(self, gate: threading.Event | None = None):
        self.callbacks, self.out, self.gate = [], None, gate

    def add_done_callback(self, fn):
        self.callbacks.append(fn)

    def result(self, timeout=None):
        if self.gate is not None:
            assert self.gate.wait(10)
        return self.out

    def cancel(self):
        pass  # too late: it has finished, as a real handle would have

    def finish(self, text, total_ms=0.0):
        self.out = RequestOutput(text, [1], "stop", StageTimings(total=total_ms))
        for fn in self.callbacks:
            fn(self)


class _HeldEngine:
    """An engine whose requests finish only when the test finishes their handles."""

    def __init__(self, gate: threading.Event | None = None):
        self.handles, self.gate = [], gate

    def submit(self, rgb, params=None, draft=None, **task):
        self.handles.append(_HeldHandle(self.gate))
        self.handles[-1].draft = draft
        return self.handles[-1]


def test_a_frame_that_finished_just_before_a_newer_one_won_is_not_reported():
    """Completions are queued; when a newer frame's result is handled first, the older frame's
    (already finished, still queued) must not be reported after it: captions never step back."""
    engine, reported = _HeldEngine(), []
    s = LiveSession(engine, {"caption": "short"}, max_inflight=3, on_result=lambda r: reported.append(r.frame.index))
    try:
        frames = _frames(3)
        for f in frames:
            assert s.offer(f)
        with s._lock:  # hold the session thread until both completions are queued, newest first
            engine.handles[1].finish("newer")
            engine.handles[0].finish("older")
        _wait(lambda: s.completed == 1 and s.in_flight == 1)
        engine.handles[2].finish("newest")
        _wait(lambda: s.completed == 2)
    finally:
        s.close()
    assert reported == [1, 2] and s.cancelled_stale == 1


def test_a_result_handled_past_its_deadline_is_not_reported():
    """A frame's request may finish in time and still be handled late: this thread was held, or
    results had queued up. Its caption is as stale as one that never came, and is not reported
    (deadlines had been checked only while no result waited)."""
    gate, reported = threading.Event(), []
    engine = _HeldEngine(gate)
    s = LiveSession(engine, {"caption": "short"}, max_inflight=3, deadline_ms=50,
                    on_result=lambda r: reported.append(r.frame.index))
    try:
        for f in _frames(2):
            assert s.offer(f)
        for h in engine.handles:
            h.finish("in time")
        _wait(lambda: s._finished.qsize() == 1)  # the first is taken, and its result read is held
        time.sleep(0.1)  # past both deadlines
        gate.set()
        _wait(lambda: s.in_flight == 0 and s._finished.empty())
    finally:
        gate.set()
        s.close()
    assert reported == [] and s.completed == 0 and s.cancelled_deadline == 2 and s.error is None


def test_with_nothing_to_draft_from_the_oldest_frame_runs_past_its_deadline_for_the_next():
    """`live --deadline-ms 30`: answers took 13 ms drafted from the frame before, 78 ms with no
    draft, and a frame drafts only from an answer: every frame expired, none was ever answered (0
    of 182). The oldest now runs on, unreported, and the frames after it draft from its answer."""
    engine, reported = _HeldEngine(), []
    s = LiveSession(engine, {"caption": "short"}, max_inflight=3, deadline_ms=700,  # a loaded machine's pauses
                    on_result=lambda r: reported.append(r.frame.index))
    try:
        for f in _frames(2):
            assert s.offer(f)
        _wait(lambda: s.cancelled_deadline == 1)  # the newer expired; the oldest goes on
        time.sleep(0.8)
        assert s.in_flight == 1 and s.cancelled_deadline == 1 and engine.handles[0].draft is None
        engine.handles[0].finish("a red circle")  # late: not reported, but kept as the draft
        _wait(lambda: s.in_flight == 0 and s.cancelled_deadline == 2)
        assert s.offer(_frames(3)[2]) and engine.handles[2].draft == [1]
        engine.handles[2].finish("a red circle")  # in time
        _wait(lambda: s.completed == 1)
        assert s.offer(_frames(4)[3])  # a frame with a draft expires as ever
        _wait(lambda: s.cancelled_deadline == 3 and s.in_flight == 0)
    finally:
        s.close()
    assert reported == [2]


def test_a_session_takes_one_frame_at_a_time_while_answers_are_slow():
    """Moondream 2 on two CPU cores: 4 frames admitted together shared the machine, the first
    answer came after 56 s instead of 16, and each later one as late, for frames of nearly the
    same instant. An answer over a second makes the session take one frame at a time, until one
    alone is fast again (a warm-up's one-time costs, a machine no longer busy)."""
    engine = _HeldEngine()
    s = LiveSession(engine, {"caption": "short"}, max_inflight=4)
    try:
        frames = _frames(12)
        assert all(s.offer(f) for f in frames[:4]) and not s.offer(frames[4])
        for h in engine.handles[:4]:  # 4 answers together, each 5 s
            h.finish("slow", total_ms=5000.0)
        _wait(lambda: s.in_flight == 0)
        assert s.one_at_a_time and s.stats()["one_at_a_time"]
        assert s.offer(frames[5]) and not s.offer(frames[6]) and s.dropped == 2
        engine.handles[4].finish("alone, not fast", total_ms=600.0)  # between the two: stays one at a time
        _wait(lambda: s.in_flight == 0)
        assert s.offer(frames[7]) and not s.offer(frames[8])
        engine.handles[5].finish("fast again", total_ms=50.0)
        _wait(lambda: s.in_flight == 0)
        assert not s.one_at_a_time and all(s.offer(f) for f in frames[9:12])
        for h in engine.handles[6:]:
            h.finish("fast", total_ms=50.0)
        _wait(lambda: s.in_flight == 0)
    finally:
        s.close()
    assert s.completed == 9 and s.last_answer_s == 0.05


def test_a_session_told_of_a_slow_warm_up_starts_one_at_a_time_unless_it_may_not_adapt():
    engine = _HeldEngine()
    slow = LiveSession(engine, {"caption": "short"}, max_inflight=4, answer_s=12.0)
    fixed = LiveSession(engine, {"caption": "short"}, max_inflight=4, answer_s=12.0, adapt=False)
    fast = LiveSession(engine, {"caption": "short"}, max_inflight=4, answer_s=0.2)
    try:
        frames = _frames(4)
        assert slow.offer(frames[0]) and not slow.offer(frames[1])
        assert all(fixed.offer(f) for f in frames) and all(fast.offer(f) for f in frames)
        for h in engine.handles:
            h.finish("slow", total_ms=5000.0)
        _wait(lambda: not (slow.in_flight or fixed.in_flight or fast.in_flight))
        assert slow.one_at_a_time and fast.one_at_a_time and not fixed.one_at_a_time
    finally:
        for s in (slow, fixed, fast):
            s.close()


def test_a_session_that_knows_no_answer_time_lets_its_first_answer_decide():
    """The web UI's first feed of a server starts one frame at a time (answer_s infinity: no answer
    time known) "until its own first answer" (README). An answer alone between FAST_ANSWER_S and
    SLOW_ANSWER_S had kept it at one for good, where a feed told that answer time (`live`'s
    warm-up) takes all its frames; one over SLOW_ANSWER_S keeps it one at a time."""
    import math

    for took_ms, alone in ((600.0, False), (5000.0, True)):
        engine = _HeldEngine()
        s = LiveSession(engine, {"caption": "short"}, max_inflight=4, answer_s=math.inf)
        try:
            frames = _frames(5)
            assert s.one_at_a_time and s.offer(frames[0]) and not s.offer(frames[1])
            engine.handles[0].finish("first", total_ms=took_ms)
            _wait(lambda: s.in_flight == 0)
            assert s.one_at_a_time is alone
            assert [s.offer(f) for f in frames[2:]] == [True, not alone, not alone]
            for h in engine.handles[1:]:  # a later answer in between changes nothing (hysteresis)
                h.finish("later", total_ms=600.0)
            _wait(lambda: s.in_flight == 0)
            assert s.one_at_a_time is alone
        finally:
            s.close()


class _SlowSubmitEngine(_HeldEngine):
    """Its submit takes `slow` seconds (a big frame's preprocessing, done inside submit)."""

    slow = 0.0

    def submit(self, rgb, params=None, draft=None, **task):
        time.sleep(self.slow)
        return super().submit(rgb, params, draft, **task)


def test_a_frames_deadline_counts_its_preprocessing():
    """`live --deadline-ms 40` logged a 720p frame whose own `total` (preprocessing included) was
    40.7 ms: the deadline's clock started once submit had returned, after the frame's conversion
    and preprocessing. A frame offered 1 s before its answer is past a 700 ms deadline."""
    engine, reported = _SlowSubmitEngine(), []
    s = LiveSession(engine, {"caption": "short"}, max_inflight=3, deadline_ms=700,  # a loaded machine's pauses
                    on_result=lambda r: reported.append(r.frame.index))
    try:
        frames = _frames(2)
        assert s.offer(frames[0])
        engine.handles[0].finish("a red circle")  # answered at once: in time, and the next one's draft
        _wait(lambda: s.completed == 1)
        engine.slow = 1.0
        assert s.offer(frames[1])
        engine.handles[1].finish("a red circle")  # at once after submit, 1 s after the offer
        _wait(lambda: s.in_flight == 0 and s._finished.empty())
    finally:
        s.close()
    assert reported == [0] and s.completed == 1 and s.cancelled_deadline == 1


def test_a_failure_handled_past_its_deadline_is_still_said():
    gate = threading.Event()
    engine = _HeldEngine(gate)
    s = LiveSession(engine, {"caption": "short"}, max_inflight=3, deadline_ms=50)
    try:
        assert s.offer(_frames(1)[0])
        engine.handles[0].finish("")
        engine.handles[0].out = RequestOutput("", [], "error")
        _wait(lambda: s._finished.empty())  # taken, and its result read held
        time.sleep(0.1)
        gate.set()
        _wait(lambda: s.in_flight == 0)
    finally:
        gate.set()
        s.close()
    assert s.error and "engine failed" in s.error and s.cancelled_closed == 1


def test_intake_drops_when_saturated_and_deadlines_cancel(small_folder, monkeypatch):
    monkeypatch.setattr(engine_module, "Runner", FakeRunner)  # never says EOS: only max_tokens stops
    with Engine(EngineConfig(model=str(small_folder))) as eng:
        s = LiveSession(eng, {"caption": "short"}, SamplingParams(max_tokens=1000, ignore_eos=True),
                        max_inflight=2, deadline_ms=100)
        accepted = [s.offer(f) for f in _frames(5)]
        assert accepted == [True, True, False, False, False]
        _wait(lambda: s.in_flight == 0)
        s.close()
        st = s.stats()
        assert st["dropped"] == 3 and st["cancelled_deadline"] == 2 and st["completed"] == 0
    assert eng.stats().kv_pages_in_use == 0


def test_grabber_keeps_only_the_latest_frame():
    frames = _frames(50)
    g = LatestFrameGrabber(lambda: iter(frames), realtime=False)
    _wait(lambda: g.ended)
    f = g.get(timeout=1)
    assert f.index == 49 and g.overwritten == 49
    assert g.get(timeout=0.1) is None
    g.close()


def test_a_live_source_converts_only_the_frames_its_consumer_takes(monkeypatch):
    """The grabber keeps the newest frame; a consumer slower than the source (a slow model, 4K)
    used to pay the colour conversion of every frame it never took (23 ms a 4K frame)."""
    import av

    from pipelines.sources import open_live

    converted = []
    real = av.VideoFrame.to_ndarray
    monkeypatch.setattr(av.VideoFrame, "to_ndarray", lambda self, **kw: converted.append(1) or real(self, **kw))
    clip = Path(__file__).resolve().parents[1] / "sample_videos" / "cuts_640x360_30fps.mp4"
    g = LatestFrameGrabber(open_live(str(clip)).frames, realtime=False)  # as fast as it decodes
    taken = []
    try:
        while (f := g.get(timeout=2)) is not None:  # None: the clip has ended and its last frame was taken
            taken.append(f.load())
            time.sleep(0.02)
    finally:
        g.close()
    assert g.overwritten > 100 and len(converted) == len(taken) and all(f.rgb.shape == (360, 640, 3) for f in taken)


def test_grabber_paces_in_real_time_and_loops():
    frames = [Frame("f", i, i / 50, np.zeros((2, 2, 3), np.uint8)) for i in range(10)]  # 0.2 s at 50 fps
    t0, got, early = time.perf_counter(), [], []
    g = LatestFrameGrabber(lambda: iter(frames), realtime=True, loop=True)
    # until it has looped, not for a fixed 0.5 s: a busy machine may switch this thread out for
    # part of it (the frames it missed are overwritten, as they should be)
    while (not got or got[-1] < 0.35 or len(got) < 15) and time.perf_counter() - t0 < 20:
        f = g.get(timeout=0.1)
        if f is not None:
            got.append(f.pts)
            if f.pts > time.perf_counter() - t0 + 0.01:  # real time: no frame before its time
                early.append((f.pts, time.perf_counter() - t0))
    g.close()
    assert got == sorted(got) and got[-1] >= 0.35  # looped past the 0.2 s clip, clock continuing
    assert len(got) >= 15 and early == []


def test_live_cli_logs_to_stdout_and_appends_to_a_file(small_folder, tmp_path, capsys):
    from app.cli import main

    sample = Path(__file__).resolve().parents[1] / "sample_videos" / "cuts_640x360_30fps.mp4"
    cmd = ["live", str(sample), "--model", str(small_folder), "--duration", "1.5", "--max-tokens", "3"]
    assert main(cmd + ["-o", "-"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = [json.loads(line) for line in lines]  # standard output holds the log alone
    assert len(rows) > 5 and {r["source"] for r in rows} == {str(sample)}
    assert {r["caption"] for r in rows} == {"short"} and "question" not in rows[0]  # the prompt answered
    assert {r["model"] for r in rows} == {os.path.realpath(small_folder)}  # as video's lines name it
    log = tmp_path / "log.jsonl"
    assert main(cmd + ["-o", str(log)]) == 0 and main(cmd + ["-o", str(log)]) == 0
    first_run = capsys.readouterr().out.count("\n")  # caption lines still go to the terminal
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    restarts = [i for i in range(1, len(rows)) if rows[i]["index"] <= rows[i - 1]["index"]]
    assert len(restarts) == 1 and first_run == len(rows)  # the second run continued the log
    import fcntl

    with open(log, "a") as other:  # another run writing the log, its last line half written
        fcntl.flock(other, fcntl.LOCK_EX)
        other.write('{"index": 9')
        other.flush()
        before = log.read_text()
        assert main(cmd + ["-o", str(log)]) == 2  # its lines had been spliced into the other's
        assert capsys.readouterr().err == (f"vlmstream: error: {log} is being written by another vlmstream run: "
                                           "wait for it to end, or write elsewhere\n")
        assert log.read_text() == before  # the other's half line not cut off
    for bad, says in [(["-o", "-", "--json"], "both write to standard output"),
                      (["-o", str(tmp_path / "no" / "log.jsonl")], "cannot write"),
                      (["-o", str(tmp_path / "log.srt")], "-o must end in .jsonl"),  # JSON lines in a .srt
                      # permission bits say yes, and /proc takes no file: it was exit 1 after the run
                      (["--annotate", "/proc/rec.mp4"], "cannot write /proc/rec.mp4: No such file")]:
        assert main(cmd + bad) == 2
        err = capsys.readouterr().err
        assert says in err and err.count("\n") == 1


def test_live_cli_waits_for_its_frames_in_flight_and_counts_them(small_folder, tmp_path, capsys, monkeypatch):
    """A slow model (Moondream 2 on a CPU: 25-70 s a frame): the end of a run waited 30 s for the
    frames in flight, then warned that the session's thread still ran, said "1 of 1755 frames
    captioned" while 4 captions came, and closed the recording before the other 3. The wait is
    now as long as they take, said after 2 s; figures and recording are taken after it."""
    from app.cli import main
    from engine.batch import Batch

    commit = Batch.commit

    def slow(self, record):  # each step 0.4 s: frames are in flight when the run ends
        time.sleep(0.4)
        commit(self, record)

    monkeypatch.setattr(Batch, "commit", slow)
    monkeypatch.setattr("app.live.WAIT_NOTICE_S", 0.0)  # said at once, whatever the machine's load
    sample = Path(__file__).resolve().parents[1] / "sample_videos" / "cuts_640x360_30fps.mp4"
    log, video = tmp_path / "log.jsonl", tmp_path / "annotated.mp4"
    # 4 in flight as given: by default a model this slow is asked one frame at a time
    assert main(["live", str(sample), "--model", str(small_folder), "--duration", "0.5", "--max-tokens", "3",
                 "--no-draft", "-o", str(log), "--annotate", str(video), "--json", "--max-inflight", "4"]) == 0
    out, err = capsys.readouterr()
    stats = json.loads(out)
    assert re.fullmatch(r"vlmstream: waiting for the \d+ frames? in flight \(Ctrl-C cancels (them|it)\)\n", err), err
    logged = log.read_text().splitlines()
    assert stats["completed"] == len(logged) == stats["recording"]["frames"] >= 2, (stats, len(logged))
    assert stats["kv_pages_in_use_after"] == 0


def test_a_warm_up_slower_than_any_fixed_limit_still_starts_the_run(small_folder, capsys, monkeypatch):
    """The warm-up's request had a fixed 120 s (Moondream 2 in fp32 on a CPU, a 720p frame of 9
    crops, takes longer): the run ended in a TimeoutError traceback before its first frame. Here
    the clock of every wait on a request is sped up 1000x (120 s: 0.12 s) and each step takes 0.1 s."""
    from app.cli import main
    from engine.batch import Batch
    from engine.request import RequestHandle

    commit, result = Batch.commit, RequestHandle.result
    monkeypatch.setattr(Batch, "commit", lambda self, record: (time.sleep(0.1), commit(self, record))[1])
    monkeypatch.setattr(RequestHandle, "result",
                        lambda self, timeout=None: result(self, None if timeout is None else timeout / 1000))
    sample = Path(__file__).resolve().parents[1] / "sample_videos" / "cuts_640x360_30fps.mp4"
    assert main(["live", str(sample), "--model", str(small_folder), "--duration", "0.2", "--max-tokens", "4",
                 "--no-draft", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["completed"] >= 1


def test_live_cli_asks_one_frame_at_a_time_after_a_slow_warm_up_unless_told_how_many(small_folder, capsys,
                                                                                      monkeypatch):
    """Every answer counts as slow here (the threshold at 0): the run says so after its warm-up
    and keeps one frame in flight; an explicit --max-inflight is kept as given."""
    import pipelines.live
    from app.cli import main

    monkeypatch.setattr(pipelines.live, "SLOW_ANSWER_S", 0.0)
    sample = Path(__file__).resolve().parents[1] / "sample_videos" / "cuts_640x360_30fps.mp4"
    run = ["live", str(sample), "--model", str(small_folder), "--duration", "1", "--max-tokens", "4", "--json"]
    assert main(run) == 0
    out, err = capsys.readouterr()
    assert re.search(r"the warm-up's answer took \d+\.\d s: frames are asked one at a time until an answer takes "
                     r"under 0.25 s \(--max-inflight N keeps N in flight\)", err), err
    stats = json.loads(out)
    assert stats["one_at_a_time"] and stats["completed"] >= 1
    assert main(run + ["--max-inflight", "4"]) == 0
    out, err = capsys.readouterr()
    assert "one at a time" not in err and not json.loads(out)["one_at_a_time"]


def test_a_sigterm_lost_during_the_end_of_run_wait_still_stops_the_run(small_folder, capsys, monkeypatch):
    """The end of a run waits for its frames in flight as long as they take. A SIGTERM whose
    KeyboardInterrupt was lost (raised inside a finalizer: Python reports and ignores it) had left
    that wait going to its end, however long; it now cancels those frames and ends as a Ctrl-C."""
    import app.launcher
    from app.cli import main
    from engine.batch import Batch
    from pipelines.feed import LiveFeed

    commit, close = Batch.commit, LiveFeed.close

    def slow(self, record):  # each step 0.5 s: the frames in flight would take seconds to finish
        time.sleep(0.5)
        commit(self, record)

    def lost_sigterm(self, cancel=True, timeout=10.0):
        if not cancel:  # the end-of-run wait: a SIGTERM comes, its KeyboardInterrupt lost
            threading.Timer(0.3, app.launcher._requested.append, (signal.SIGTERM,)).start()
        close(self, cancel=cancel, timeout=timeout)

    monkeypatch.setattr(Batch, "commit", slow)
    monkeypatch.setattr(LiveFeed, "close", lost_sigterm)
    sample = Path(__file__).resolve().parents[1] / "sample_videos" / "cuts_640x360_30fps.mp4"
    try:
        code = main(["live", str(sample), "--model", str(small_folder), "--duration", "0.5", "--max-tokens", "8",
                     "--no-draft", "--json"])
    finally:
        time.sleep(0.4)  # the timer has fired
        app.launcher._requested.clear()
    stats = json.loads(capsys.readouterr().out)
    assert code == 130 and stats["cancelled_closed"] >= 1, (code, stats)
    assert stats["kv_pages_in_use_after"] == 0


def test_live_cli_says_how_many_frames_missed_the_deadline(small_folder, capsys):
    from app.cli import main

    sample = Path(__file__).resolve().parents[1] / "sample_videos" / "cuts_640x360_30fps.mp4"
    assert main(["live", str(sample), "--model", str(small_folder), "--duration", "1", "--deadline-ms", "0.01"]) == 0
    err = capsys.readouterr().err  # every frame is cancelled: the line says where they went
    m = re.search(r"(\d+) of (\d+) frames captioned, .* (\d+) past the deadline, ", err)
    assert m and m[1] == "0" and int(m[3]) > 5, err
    assert "p50" not in err  # no frame completed: no median latency (it said "p50 0.0 ms")


def test_more_frames_in_flight_than_memory_holds_is_said_as_the_flag_that_asked(capsys):
    """`live clip.mp4 --max-inflight 1000000` said "the KV cache for max_batch_size=1000000 ...;
    lower max_batch_size or kv_pages": the engine's settings, which `live` has no flags for."""
    from app.cli import main

    clip = str(Path(__file__).resolve().parents[1] / "sample_videos" / "cuts_640x360_30fps.mp4")
    assert main(["live", clip, "--max-inflight", "100000000", "--duration", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("vlmstream: error: --max-inflight 100000000: ") and "lower --max-inflight" in err
    assert "kv_pages" not in err and "max_batch_size" not in err and err.count("\n") == 1
    # two sources: the engine's batch is twice the flag, said as frames in flight, not as its setting
    shapes = str(Path(__file__).resolve().parents[1] / "sample_videos" / "shapes_640x360_60fps.mp4")
    assert main(["live", clip, shapes, "--max-inflight", "100000000", "--duration", "1"]) == 2
    err = capsys.readouterr().err
    assert "the KV cache for 200000000 frames in flight " in err and "max_batch_size" not in err, err


def test_live_cli_watches_several_sources_with_one_engine(small_folder, tmp_path, capsys):
    from app.cli import main

    samples = Path(__file__).resolve().parents[1] / "sample_videos"
    a, b = str(samples / "cuts_640x360_30fps.mp4"), str(samples / "shapes_640x360_60fps.mp4")
    log = tmp_path / "log.jsonl"
    cmd = ["live", a, b, "--model", str(small_folder), "--duration", "2", "--max-tokens", "3"]
    assert main(cmd + ["--json", "-o", str(log)]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert set(stats["sources"]) == {a, b} and stats["kv_pages_in_use_after"] == 0
    assert stats["sticky"] == LIVE_STICKY  # answers keep the previous frame's by default
    assert [s["max_inflight"] for s in stats["sources"].values()] == [2, 2]  # the default 4, shared out
    for key in ("frames_in", "completed", "dropped", "cancelled_stale"):
        assert stats[key] == sum(s[key] for s in stats["sources"].values())
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    for source in (a, b):
        mine = [r["index"] for r in rows if r["source"] == source]
        assert len(mine) == stats["sources"][source]["completed"] > 3
        assert mine == sorted(set(mine))  # each source's own frame order: latest frame wins per source
    assert main(cmd) == 0
    captured = capsys.readouterr()
    assert captured.out.count(f"{a}  ") > 3 and captured.out.count(f"{b}  ") > 3  # lines say whose they are
    # in columns, whichever source a line names (the shorter name padded to the longer's width)
    assert len({line.index(" ms ") for line in captured.out.splitlines()}) == 1, captured.out
    assert captured.err.count("frames captioned") == 2
    assert main(["live", a, a]) == 2 and main(["live", a, str(tmp_path / "missing.mp4")]) == 2
    assert main(["live", a, "--max-inflight", "0"]) == 2 and main(["live", a, "--sticky", "nan"]) == 2
    err = capsys.readouterr().err
    assert "listed twice" in err and "--max-inflight >= 1" in err and "missing.mp4" in err and "Traceback" not in err
    assert "--sticky must be a number >= 0" in err
    # the same file spelt two ways was watched twice over
    assert main(["live", a, os.path.relpath(a)]) == 2 and "listed twice" in capsys.readouterr().err
    # a recording over its own source replaced the clip with two seconds of it (exit 0); by a hard link too
    copy, link = tmp_path / "copy.mp4", tmp_path / "link.mp4"
    copy.write_bytes(Path(a).read_bytes())
    os.link(copy, link)
    for target in (copy, link, tmp_path / "." / "copy.mp4"):
        assert main(["live", str(copy), "--annotate", str(target), "--duration", "1"]) == 2
        assert f"an output would overwrite the source {copy}" in capsys.readouterr().err
    assert copy.read_bytes() == Path(a).read_bytes()


def test_a_source_that_ends_leaves_its_frames_in_flight_to_the_others(small_folder, tmp_path, capsys):
    """Two clips played once: the longer one, alone after the shorter ended, had run on with 2 of
    the default 4 frames in flight (the web UI shares again when a viewer leaves)."""
    from app.cli import main
    from test_pipelines import write_video

    short, long = write_video(tmp_path / "short.mp4", "mpeg4", n=5), write_video(tmp_path / "long.mp4", "mpeg4", n=25)
    assert main(["live", str(short), str(long), "--model", str(small_folder), "--max-tokens", "3", "--json"]) == 0
    sources = json.loads(capsys.readouterr().out)["sources"]
    assert [sources[str(p)]["max_inflight"] for p in (short, long)] == [2, 4]
    # one given by --max-inflight is the user's: kept
    assert main(["live", str(short), str(long), "--model", str(small_folder), "--max-tokens", "3", "--json",
                 "--max-inflight", "2"]) == 0
    sources = json.loads(capsys.readouterr().out)["sources"]
    assert [sources[str(p)]["max_inflight"] for p in (short, long)] == [2, 2]


def test_several_prompts_per_live_frame_give_each_prompts_own_answer(small_folder):
    from PIL import Image

    rgb = np.asarray(Image.open(Path(__file__).resolve().parents[1] / "sample_videos" / "scene.png").convert("RGB"))
    prompts = [{"caption": "normal"}, {"question": "How many shapes are there?"}, {"question": "Is there a star?"}]
    params = SamplingParams(max_tokens=12)
    results = []
    with Engine(EngineConfig(model=str(small_folder), debug_checks=True)) as eng:
        alone = [eng.submit(rgb, params=params, **p).result(timeout=60) for p in prompts]
        s = LiveSession(eng, prompts, params, max_inflight=2, on_result=results.append)
        for i in range(3):
            s.offer(Frame("cam", i, i / 30, rgb))
            _wait(lambda: s.completed == i + 1, timeout=60)
        s.close()
        _wait(lambda: eng.stats().kv_pages_in_use == 0)
    assert [r.frame.index for r in results] == [0, 1, 2]
    for r in results:  # the same answers as each prompt alone (the later frames drafted from the earlier)
        assert [o.token_ids for o in r.outputs] == [o.token_ids for o in alone]
        rows = r.records()
        assert [(row.get("caption"), row.get("question")) for row in rows] == \
            [(p.get("caption"), p.get("question")) for p in prompts]
        cut = "…" if alone[1].finish_reason == "length" else ""  # an answer max_tokens cut short is shown so
        assert r.text.splitlines()[1] == f"How many shapes are there?: {alone[1].text.strip()}{cut}"
        assert [row["text"] for row in rows] == [o.text for o in alone]  # the log keeps it as it came
        assert all(row["timings_ms"]["end_to_end"] == round(r.end_to_end_ms, 3) for row in rows)


def test_live_cli_asks_several_questions_about_each_frame(small_folder, tmp_path, capsys):
    from app.cli import main

    sample = Path(__file__).resolve().parents[1] / "sample_videos" / "cuts_640x360_30fps.mp4"
    log = tmp_path / "log.jsonl"
    assert main(["live", str(sample), "--model", str(small_folder), "--duration", "1.5", "--max-tokens", "3",
                 "--caption", "short", "--question", "Is there a star?", "-o", str(log), "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(rows) == 2 * stats["completed"] > 4  # a frame completes with both its answers
    by_frame: dict = {}
    for r in rows:
        by_frame.setdefault(r["index"], []).append(r.get("caption") or r["question"])
    assert all(v == ["short", "Is there a star?"] for v in by_frame.values())
    assert list(by_frame) == sorted(by_frame)
    assert main(["live", str(sample), "--question", "Why?", "--question", "Why?"]) == 2


def test_a_raising_or_closing_on_result_and_late_offers_keep_the_session_sound(small_folder, caplog):
    """An on_result that raised ended the session's thread: every later frame was dropped, with
    nothing said. close() from on_result joined its own thread (RuntimeError); an offer after
    close() was taken and its result never came; close(timeout) returned with the thread alive."""
    import threading

    params = SamplingParams(max_tokens=4)
    with Engine(EngineConfig(model=str(small_folder))) as eng:
        s = LiveSession(eng, {"caption": "short"}, params, max_inflight=2, on_result=lambda r: 1 / 0)
        deadline = time.time() + 30
        for f in _frames(6):
            while not s.offer(f):  # it had never freed a place again
                assert time.time() < deadline, "the session stopped taking frames"
                time.sleep(0.005)
        s.close()
        assert s.completed >= 3 and s.in_flight == 0  # it went on
        assert sum("on_result raised" in r.getMessage() for r in caplog.records) == s.completed
        frames_in, fps = s.frames_in, s.stats()["achieved_fps"]
        assert not s.offer(_frames(1)[0]) and s.frames_in == frames_in  # closed: refused, not taken
        time.sleep(0.2)
        assert s.stats()["achieved_fps"] == fps  # measured up to the close, not on

        holder = []
        s = LiveSession(eng, {"caption": "short"}, params, on_result=lambda r: holder[0].close())
        holder.append(s)
        assert s.offer(_frames(1)[0])
        s._thread.join(30)
        assert not s._thread.is_alive() and s.completed == 1

        entered, release = threading.Event(), threading.Event()
        s = LiveSession(eng, {"caption": "short"}, params, on_result=lambda r: (entered.set(), release.wait(30)))
        assert s.offer(_frames(1)[0])
        assert entered.wait(10)
        with pytest.raises(TimeoutError, match="still runs after 0.2 s"):
            s.close(timeout=0.2)
        release.set()
        s.close()


def test_frames_the_engine_drops_under_a_session_are_counted(small_folder):
    """The engine closed (cancelling) under a session: its frames left every counter."""
    eng = Engine(EngineConfig(model=str(small_folder)))
    s = LiveSession(eng, {"caption": "long"}, SamplingParams(max_tokens=200, ignore_eos=True), max_inflight=4)
    for f in _frames(4):
        assert s.offer(f)
    eng.close(cancel=True)
    s.close()
    st = s.stats()
    assert st["submitted"] == 4 and st["completed"] + st["cancelled_closed"] + st["cancelled_stale"] == 4
    assert st["cancelled_closed"] >= 1 and s.in_flight == 0


def test_a_closed_session_does_not_keep_its_engine_through_frames_cancelled_as_it_closed(small_folder, monkeypatch):
    """CI: the web UI kept a reloaded engine (its weights, its KV pool) alive through a stopped
    feed. Frames cancelled as the session closed finished after its thread had ended, and their
    handles, each holding the engine, stayed in the session's queue of finished frames."""
    import gc
    import weakref

    monkeypatch.setattr(engine_module, "Runner", NewestStopsFirst)  # 15 ms steps: frames still in flight
    monkeypatch.setattr(NewestStopsFirst, "stop_id", None)
    eng = Engine(EngineConfig(model=str(small_folder)))
    s = LiveSession(eng, {"caption": "short"}, SamplingParams(max_tokens=200), max_inflight=3)
    frames = _frames(3)
    assert all(s.offer(f) for f in frames)
    s.cancel_all()
    s.close(10.0)  # nothing in flight any more: its thread ends before the engine ends the frames
    eng.close(cancel=True)
    assert s.engine is None
    engine_ref = weakref.ref(eng)
    del eng
    gc.collect()
    assert engine_ref() is None
    assert s.stats()["cancelled_closed"] == 3


def test_a_frame_is_counted_completed_only_once_its_result_is_delivered():
    """A page waits for `completed` to grow and then reads the results (its log, its Export): the
    count must never run ahead of what on_result was given."""
    engine, seen = _HeldEngine(), []
    s = LiveSession(engine, {"caption": "short"}, max_inflight=3,
                    on_result=lambda r: seen.append((r.frame.index, s.stats()["completed"])))
    try:
        for f in _frames(2):
            assert s.offer(f)
        engine.handles[0].finish("first")
        _wait(lambda: s.completed == 1)
        engine.handles[1].finish("second")
        _wait(lambda: s.completed == 2)
    finally:
        s.close()
    assert seen == [(0, 0), (1, 1)]  # each delivered while the count still said the ones before


def test_the_rolling_rate_of_a_slow_model_spans_its_answers():
    """Moondream 2 on a CPU answers every ~15 s: over the 2 s window the page said 0.0 fps while
    its answers came. The window spans a few of the newest intervals, and still empties when they stop."""
    from pipelines.window import ROLLING_INTERVALS, rolling_rate

    answers = [100.0 + 15 * i for i in range(6)]
    assert rolling_rate(answers, answers[-1]) == pytest.approx(1 / 15)
    assert rolling_rate(answers, answers[-1] + 10) == pytest.approx(1 / 15)  # waiting on the next one
    assert rolling_rate(answers, answers[-1] + 30) == pytest.approx(2 / 45)  # 3 in the 60 s, silence counted
    assert rolling_rate(answers, answers[-1] + ROLLING_INTERVALS * 15 + 1) == 0.0  # they stopped
    assert rolling_rate(answers[:2], answers[1] + 1) == pytest.approx(1 / 15)  # from the second answer on
    fast = [100 + i / 60 for i in range(120)]  # a 60 fps stream: its 2 s as before
    assert rolling_rate(fast, fast[-1]) == pytest.approx(60)
    assert rolling_rate(fast, fast[-1] + 2.1) == 0.0


def test_the_rolling_rate_falls_to_zero_when_frames_stop_coming(monkeypatch):
    """A camera in an outage: the page's counters said the rate of its last 120 frames, 30 fps
    for as long as the outage lasted; the rate is now over the newest ROLLING_S seconds, and the
    silence since the last frame counts in it (it had said the full rate until the window emptied)."""
    import types

    import pipelines.live
    import pipelines.window

    # the session's clock moved by the test, as in the test of the rolling rate below: on the wall
    # clock, a busy machine's pause of 0.5 s among the four frames left them out of the window
    clock = [100.0]
    monkeypatch.setattr(pipelines.live, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    monkeypatch.setattr(pipelines.window, "ROLLING_S", 0.5)
    engine = _HeldEngine()
    s = LiveSession(engine, {"caption": "short"}, max_inflight=1)
    try:
        for f in _frames(4):
            assert s.offer(f)
            engine.handles[-1].finish("a red circle")
            _wait(lambda: s.in_flight == 0)
            clock[0] += 0.02
        assert s.stats()["rolling_fps"] == pytest.approx(50.0)  # 3 intervals of 20 ms
        clock[0] += 0.3  # nothing more came: the four are in the window still, 0.32 s ago
        assert s.stats()["rolling_fps"] == pytest.approx(3 / 0.36)  # the silence counted, not 50
        clock[0] += 0.3
        assert s.stats()["rolling_fps"] == 0.0 and s.stats()["completed"] == 4
    finally:
        s.close()


def test_an_answer_cut_short_by_max_tokens_is_shown_so():
    """`Which? [alpha, beta]` with max tokens 2 showed 'al' as the answer, on the page, in its log
    and on the terminal; a JSON answer an unclosed string."""
    from pipelines.live import LiveResult

    frame = _frames(1)[0]
    cut, whole = RequestOutput("al", [1, 2], "length"), RequestOutput("beta", [3], "stop")
    r = LiveResult(frame, [cut, whole], 12.0, [{"question": "Which?"}, {"question": "Other?"}])
    assert r.text == "Which?: al…\nOther?: beta"
    assert [row["text"] for row in r.records()] == ["al", "beta"]  # the log keeps it as it came
    assert LiveResult(frame, [whole], 5.0, [{"question": "Other?"}]).text == "beta"


def test_after_a_scene_cut_the_frame_that_runs_on_is_of_the_new_scene():
    """The frame let run past its deadline was the oldest in flight even from before a cut, whose
    answer can be no draft for the new scene; the cut's own frame, which could, was cancelled."""
    engine = _HeldEngine()
    s = LiveSession(engine, {"caption": "short"}, SamplingParams(sticky=2.0), max_inflight=3, deadline_ms=700)
    dark, bright = np.zeros((48, 64, 3), np.uint8), np.full((48, 64, 3), 255, np.uint8)
    try:
        assert s.offer(Frame("cam", 0, 0.0, dark))
        engine.handles[0].finish("a dark room")
        _wait(lambda: s.completed == 1)
        assert s.offer(Frame("cam", 1, 0.1, dark)) and s.offer(Frame("cam", 2, 0.2, bright))  # a cut at 2
        assert engine.handles[1].draft is not None and engine.handles[2].draft is None
        _wait(lambda: s.cancelled_deadline == 1, timeout=5)
        time.sleep(0.2)
        assert [f.index for f, _, _ in s._inflight] == [2]  # the new scene's frame goes on
    finally:
        for h in engine.handles:  # the frames still in flight end, so that the session can close
            if h.out is None:
                h.finish("")
        s.close()


def test_a_latency_window_keeps_the_newest_values_in_memory_made_once():
    """A live run's RSS grew for its first ten minutes (~300 bytes a result, 9.5 MB a source in
    deques of floats, found by a soak) and its percentiles took 13 ms a call once full."""
    import tracemalloc

    import numpy as np

    from pipelines.window import LatencyWindow

    w = LatencyWindow(size=5)
    assert not w
    for v in range(12):
        w.append(float(v))
    # 7..11 only, and said to be 5: a p99 of 5 is no 1-in-100 tail
    assert len(w) == 5 and w.percentiles() == {"p50": 9.0, "p90": 10.6, "p99": 10.96, "samples": 5}
    w.clear()
    assert not w
    big = LatencyWindow(size=20_000)
    for v in range(20_000):  # every page written once
        big.append(v / 7)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for v in range(20_000):
        big.append(v * 1.5)  # a float object each, as the engine's timings are
    kept = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert kept < 10_000, kept  # a deque held every one of them (~640 KB)
    assert big.percentiles()["p50"] == round(float(np.percentile(np.arange(20_000) * 1.5, 50)), 3)


def test_a_feed_counts_the_frames_it_passes_over_above_its_fps(monkeypatch):
    """`live --fps 10` of a 60 fps source: every frame read is offered, overwritten before it was
    taken, or passed over above the rate; the last had been counted nowhere (41 frames in of
    the ~240 a camera sent, none dropped)."""
    from pipelines.feed import LiveFeed

    offered = []
    monkeypatch.setattr(LiveSession, "offer", lambda self, frame: offered.append(frame) or True)

    def frames():  # 1.5 s of a 60 fps source, played in real time
        for i in range(90):
            yield Frame("cam", i, i / 60, np.zeros((8, 8, 3), np.uint8))

    start = time.perf_counter()
    feed = LiveFeed(None, {"caption": "short"}, SamplingParams(), frames, realtime=True, fps=10)
    try:
        feed._pump.join(10)
        elapsed = time.perf_counter() - start
        assert not feed._pump.is_alive()
        counters = feed.snapshot().counters
        # at most 10 a second of the feed's own run, and one after a late frame: a loaded machine
        # stretches the 1.5 s
        assert 10 <= len(offered) <= 10 * elapsed + 2 and counters["above_fps"] >= 60
        assert len(offered) + counters["above_fps"] + counters["overwritten_at_grab"] == feed._grabber.read == 90
    finally:
        feed.close()


class _CancelCountingEngine(_HeldEngine):
    """A held engine whose handles count the cancels they get."""

    def submit(self, rgb, params=None, draft=None, **task):
        h = super().submit(rgb, params, draft, **task)
        h.cancelled = 0

        def cancel(h=h):
            h.cancelled += 1

        h.cancel = cancel
        return h


def test_a_newer_frames_result_cancels_the_older_frames_requests_in_the_engine():
    """Their captions are never shown: their requests are cancelled (pages freed, decode slots
    given back at once), not left to run on to max_tokens under the frames that matter."""
    engine = _CancelCountingEngine()
    s = LiveSession(engine, {"caption": "short"}, max_inflight=3)
    try:
        for f in _frames(3):
            assert s.offer(f)
        engine.handles[1].finish("newer")
        _wait(lambda: s.completed == 1 and s.in_flight == 1)
        assert [h.cancelled for h in engine.handles] == [1, 0, 0]  # the older one only
        engine.handles[2].finish("newest")
        _wait(lambda: s.completed == 2)
    finally:
        s.close()
    assert [h.cancelled for h in engine.handles] == [1, 0, 0] and s.cancelled_stale == 1


def test_a_frame_past_its_deadline_is_cancelled_in_the_engine():
    """`--deadline-ms`: a frame that expires is cancelled, not only left unreported: it stops
    taking the engine's time and pages from the frames after it."""
    engine = _CancelCountingEngine()
    s = LiveSession(engine, {"caption": "short"}, max_inflight=3, deadline_ms=1000)
    try:
        assert s.offer(_frames(1)[0])
        engine.handles[0].finish("a red circle")  # in time: the frames after have a draft, none runs on
        _wait(lambda: s.completed == 1)
        assert s.offer(_frames(2)[1])
        _wait(lambda: s.cancelled_deadline == 1 and s.in_flight == 0)
        assert [h.cancelled for h in engine.handles] == [0, 1]
    finally:
        s.close()


def test_stats_say_the_rolling_rate_and_end_to_end_latency_of_the_frames_delivered(monkeypatch):
    """The page's fps and the CLI's closing "p50 ... ms": 4 frames answered 0.1 s apart, each 40 ms
    after its capture, are 10 frames a second (3 intervals in 0.3 s) at a p50 of 40 ms."""
    import types

    import pipelines.live

    clock = [100.0]
    monkeypatch.setattr(pipelines.live, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    engine, results = _HeldEngine(), []
    s = LiveSession(engine, {"caption": "short"}, max_inflight=1, on_result=results.append)
    try:
        for i in range(4):
            clock[0] = 100.0 + 0.1 * i
            assert s.offer(Frame("cam", i, i / 10, np.zeros((48, 64, 3), np.uint8), captured_at=clock[0] - 0.04))
            engine.handles[-1].finish("a red circle")
            _wait(lambda i=i: s.completed == i + 1 and s.in_flight == 0)
    finally:
        s.close()
    st = s.stats()
    assert [r.end_to_end_ms for r in results] == pytest.approx([40.0] * 4)
    assert st["rolling_fps"] == pytest.approx(10.0)
    assert st["achieved_fps"] == pytest.approx(4 / 0.3)
    assert st["latency_ms"]["end_to_end"] == {"p50": 40.0, "p90": 40.0, "p99": 40.0, "samples": 4}


def test_the_frame_rate_counts_the_time_of_frames_that_finish_after_the_close(monkeypatch):
    """`live clip.mp4 --duration 0.01` said "1 of 1 frames captioned, 169.5 fps" with a p50 of
    116 ms: the frame in flight at the close finished (and counted) after it, and the rate's time
    stopped at the close. One frame offered at 0 s and answered at 0.1 s, the session closed at
    0.01 s, is 10 frames a second, not 100."""
    import types

    import pipelines.live

    clock = [100.0]
    monkeypatch.setattr(pipelines.live, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    engine = _HeldEngine()
    s = LiveSession(engine, {"caption": "short"}, max_inflight=1)
    assert s.offer(Frame("cam", 0, 0.0, np.zeros((48, 64, 3), np.uint8), captured_at=clock[0]))
    clock[0] = 100.01
    closing = threading.Thread(target=s.close)  # close() waits for the frame in flight
    closing.start()
    _wait(lambda: s._closed_at is not None)
    clock[0] = 100.1
    engine.handles[-1].finish("a red circle")
    closing.join(10)
    assert s.completed == 1 and s.stats()["achieved_fps"] == pytest.approx(10.0)


def test_a_sources_frame_rate_stops_counting_when_it_ends(monkeypatch):
    """`live short.mp4 long.mp4 --json`: the 2 s clip's 54 frames were said to come at 18 fps,
    its rate's time running on until the 3 s clip ended the run. A source of one frame, answered
    1 s after its feed began, has 1 frame a second however long the run goes on after it."""
    import types

    import pipelines.live
    from pipelines.feed import LiveFeed

    clock = [100.0]
    monkeypatch.setattr(pipelines.live, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    engine = _HeldEngine()

    def frames():  # one frame, then the source ends half a second in
        yield Frame("cam", 0, 0.0, np.zeros((48, 64, 3), np.uint8), captured_at=100.0)
        clock[0] = 100.5

    feed = LiveFeed(engine, {"caption": "short"}, SamplingParams(), frames, realtime=False, max_inflight=1)
    try:
        feed._pump.join(10)
        assert not feed._pump.is_alive() and len(engine.handles) == 1
        clock[0] = 101.0
        engine.handles[0].finish("a red circle")
        _wait(lambda: feed.session.completed == 1)
        clock[0] = 110.0  # the other sources play on
        assert feed.snapshot().counters["achieved_fps"] == pytest.approx(1.0)
    finally:
        feed.close()
    assert feed.snapshot().counters["achieved_fps"] == pytest.approx(1.0)


def test_a_frames_stage_timings_are_those_of_its_slowest_answer():
    """Several prompts a frame: the frame waits for all its answers, so its stage latencies (the
    page's chart, the percentiles) are each stage's slowest."""
    from engine.types import StageTimings
    from pipelines.live import LiveResult

    a = RequestOutput("a", [1], "stop", StageTimings(vision=5.0, decode=30.0, total=40.0))
    b = RequestOutput("b", [2], "stop", StageTimings(vision=5.0, decode=10.0, total=60.0))
    r = LiveResult(_frames(1)[0], [a, b], 70.0, [{"question": "A?"}, {"question": "B?"}])
    assert r.timings_ms["decode"] == 30.0 and r.timings_ms["total"] == 60.0 and r.timings_ms["vision"] == 5.0


def test_a_paced_files_frames_count_their_latency_from_when_they_were_due():
    """A file played in real time but decoded slower than it plays (400 ms a frame of a 100 fps
    clip): each frame was captured when a camera would have sent it (start + pts), so the
    captions' end-to-end latency grows with the backlog instead of counting from the decode."""
    yielded = []

    def slow():
        for f in _frames(8):
            time.sleep(0.4)  # 0.4 s a frame, the margin below 0.3 s: room for a loaded machine's delays
            yielded.append(time.perf_counter())
            yield Frame(f.source_id, f.index, f.index / 100, f.rgb)

    g = LatestFrameGrabber(slow, realtime=True)
    try:
        late = []
        while len(late) < 4:
            f = g.get(timeout=5.0)
            assert f is not None
            if f.pts > 0:  # the first frame is due at once, so it is late only by its decode
                late.append(f)
        for f in late:  # the clock starts at the first frame; stamped when decoded, each was 0.4 s more on
            assert f.captured_at - yielded[0] < f.pts + 0.3, (f.pts, f.captured_at - yielded[0])
    finally:
        g.close()


def test_a_paced_files_clock_starts_at_its_first_frame_not_before_it_opened():
    """A file that takes 1.5 s to open (over HTTP, a slow disk): its first frame, at pts 0, was
    due when the grabber started, and was stamped captured 1.5 s before it could have been (its
    end-to-end latency that much too long), the frames after it let through at once to catch up."""
    yielded = []

    def slow_open():
        time.sleep(1.5)  # more than twice the margin below (0.6 s and 0.3 s had little room for a loaded machine)
        for f in _frames(3):
            yielded.append(time.perf_counter())
            yield f

    g = LatestFrameGrabber(slow_open, realtime=True)
    try:
        first = g.get(timeout=5.0)
        assert first is not None and first.index == 0
        assert abs(first.captured_at - yielded[0]) < 0.75, first.captured_at - yielded[0]
    finally:
        g.close()


def _taken(grabber: LatestFrameGrabber, n: int, timeout: float = 5.0) -> list[Frame]:
    """The first n frames a grabber gives, each within `timeout`; the grabber closed after."""
    taken = []
    try:
        while len(taken) < n:
            f = grabber.get(timeout=timeout)
            assert f is not None
            taken.append(f)
    finally:
        grabber.close()
    return taken


def test_a_looped_source_goes_on_one_frame_step_after_its_last_frame():
    """`live clip.mp4 --loop`: the next pass starts a frame's step after the last frame, on the
    same clock: no time shown twice, no frame let through early."""
    frames = [Frame("f", i, i * 0.25, np.zeros((2, 2, 3), np.uint8)) for i in range(3)]  # 0, 0.25, 0.5
    g = LatestFrameGrabber(lambda: iter(frames), realtime=True, loop=True)
    got = [f.pts for f in _taken(g, 7, timeout=2)]
    assert got == pytest.approx([0.25 * i for i in range(7)]) and g.overwritten == 0


def test_a_looped_source_that_gives_no_frame_ends():
    """Looping a source with nothing in it (a stream that answers with no frame) ends it; it had
    asked again and again, a core busy for as long as the run lasted."""
    calls = []
    g = LatestFrameGrabber(lambda: calls.append(1) or iter(()), realtime=True, loop=True)
    try:
        _wait(lambda: g.ended, timeout=5)
        assert g.get(timeout=0.1) is None and len(calls) == 1
    finally:
        g.close()


def _push_answered(feed, engine: _HeldEngine, i: int) -> None:
    """Push a blank frame to a feed on a _HeldEngine, answer it, and wait until it is the i-th
    (from 0) completed."""
    assert feed.push(np.zeros((48, 64, 3), np.uint8))
    engine.handles[-1].finish("a red circle")
    _wait(lambda: feed.snapshot().counters["completed"] == i + 1)


def test_a_feeds_latency_history_holds_its_last_window_only(monkeypatch):
    """The web UI's latency chart covers the feed's last `window_s` seconds: older points go (a feed
    runs for days; kept, they grew its memory and the page's chart without end), beyond the few
    kept for a slow model (none here)."""
    import pipelines.feed
    from pipelines.feed import LiveFeed

    monkeypatch.setattr(pipelines.feed, "MIN_CHART_BARS", 1)
    engine = _HeldEngine()
    feed = LiveFeed(engine, {"caption": "short"}, SamplingParams(), window_s=0.3, max_inflight=1)
    try:
        for i in range(2):
            _push_answered(feed, engine, i)
            if i == 0:
                time.sleep(0.5)
        assert [p.index for p in feed.snapshot().latency] == [1]
    finally:
        feed.close()


def test_a_feeds_chart_counts_preprocessing_in_the_vision_stage():
    """The web UI's chart stacks queue, vision, prefill and decode: the image's preprocessing (its
    crops) is part of the vision bar, so the bars add up to the frame's time in the engine."""
    from engine.types import StageTimings
    from pipelines.feed import LiveFeed

    engine = _HeldEngine()
    feed = LiveFeed(engine, {"caption": "short"}, SamplingParams(), max_inflight=1)
    try:
        assert feed.push(np.zeros((48, 64, 3), np.uint8))
        h = engine.handles[-1]
        h.out = RequestOutput("a red circle", [1], "stop",
                              StageTimings(preprocess=3.0, vision=5.0, prefill=7.0, decode=11.0, total=28.0, queue=2.0))
        for fn in h.callbacks:
            fn(h)
        _wait(lambda: feed.snapshot().counters["completed"] == 1)
        (point,) = feed.snapshot().latency
        assert point.stages_ms == {"queue": 2.0, "vision": 8.0, "prefill": 7.0, "decode": 11.0}
        assert sum(point.stages_ms.values()) == 28.0
    finally:
        feed.close()


def test_a_frame_dropped_at_intake_is_counted_among_the_frames_in():
    """"X of Y frames captioned": Y counts every frame offered to a running session, the ones
    dropped because the engine was saturated among them."""
    engine = _HeldEngine()
    s = LiveSession(engine, {"caption": "short"}, max_inflight=1)
    try:
        assert [s.offer(f) for f in _frames(3)] == [True, False, False]
        assert s.frames_in == 3 and s.dropped == 2 and s.submitted == 1
    finally:
        engine.handles[0].finish("a red circle")
        s.close()
    st = s.stats()
    assert st["frames_in"] == st["submitted"] + st["dropped"] == 3


def test_cancel_all_cancels_the_frames_requests_in_the_engine():
    """A viewer left: nobody reads these captions, so their requests are cancelled in the engine
    (pages and decode slots given back), not only forgotten by the session."""
    engine = _CancelCountingEngine()
    s = LiveSession(engine, {"caption": "short"}, max_inflight=3)
    try:
        for f in _frames(2):
            assert s.offer(f)
        s.cancel_all()
        assert [h.cancelled for h in engine.handles] == [1, 1]
        assert s.in_flight == 0 and s.cancelled_closed == 2
    finally:
        s.close()


def test_a_feed_closed_with_cancel_cancels_its_frames_in_flight():
    """`LiveFeed.close(cancel=True)` (a viewer left, a Ctrl-C): the frames in flight are cancelled
    at once, not waited for (an engine that never finishes them held the close to its timeout)."""
    from pipelines.feed import LiveFeed

    engine = _CancelCountingEngine()
    feed = LiveFeed(engine, {"caption": "short"}, SamplingParams(), max_inflight=2)
    assert feed.push(np.zeros((48, 64, 3), np.uint8)) and feed.push(np.zeros((48, 64, 3), np.uint8))
    feed.close(cancel=True, timeout=2.0)
    assert feed.error is None and [h.cancelled for h in engine.handles] == [1, 1]
    assert feed.session.cancelled_closed == 2 and feed.session.in_flight == 0


def test_the_grabbers_get_gives_up_at_its_timeout():
    """A source with nothing to give (a camera in an outage): get() returns None at its timeout,
    so that the pump can look at its stop event, instead of waiting for the next frame."""
    release = threading.Event()

    def frames():
        release.wait(10)
        yield from _frames(1)

    g = LatestFrameGrabber(frames, realtime=False)
    timer = threading.Timer(30.0, release.set)  # a frame comes, far past the timeout (a loaded machine too)
    timer.start()
    try:
        assert g.get(timeout=0.05) is None and not g.ended
    finally:
        release.set()
        timer.cancel()
        g.close()


def test_a_paced_grabber_stops_at_close_without_waiting_for_its_next_frame():
    """A source paced in real time whose next frame is far off (a slow clip, a still image looped):
    close() stops the grabber's thread during the wait, not when the wait is over."""
    frames = [Frame("cam", i, 30.0 * i, np.zeros((8, 8, 3), np.uint8)) for i in range(2)]
    g = LatestFrameGrabber(lambda: iter(frames), realtime=True)
    try:
        assert g.get(timeout=5).index == 0
    finally:
        g.close()
    assert not g._thread.is_alive() and g.read == 1


def test_pushed_frames_give_the_newest_frame_pushed():
    """A browser's camera pushes faster than the locator looks: the newest frame wins."""
    from pipelines.grabber import PushedFrames

    pushed = PushedFrames()
    for f in _frames(3):
        pushed.push(f)
    it = pushed.frames()
    assert next(it).index == 2
    pushed.close()
    assert list(it) == []


def test_an_error_closing_the_feeds_at_the_end_of_a_run_reaches_the_caller(monkeypatch):
    """The feeds are closed on a thread of their own at the end of a run (so that a SIGTERM is
    still heard): what that thread raises is raised to the run, not lost with it."""
    from app import live_run

    class Broken:
        def close(self, cancel, timeout):
            raise RuntimeError("the recording could not be closed")

    monkeypatch.setattr(live_run, "stop_requested", lambda: False)
    with pytest.raises(RuntimeError, match="could not be closed"):
        live_run._wait_closed([Broken()])


def test_live_plays_named_sources_and_a_cameras_password_is_in_no_command_line_or_output(small_folder, tmp_path,
                                                                                         capsys):
    """`live rtsp://admin:pw@cam/...` put the camera's password in the process list (ps) and the
    shell's history. `live --sources cams.txt [NAME...]` reads it from a file, and the run says
    and writes each source by its name: its lines, log, recordings, closing figures."""
    from app.cli import main

    samples = Path(__file__).resolve().parents[1] / "sample_videos"
    cams = tmp_path / "cams.txt"
    cams.write_text(f"Lobby = {samples / 'cuts_640x360_30fps.mp4'}\nDoor = rtsp://admin:s3cret@127.0.0.1:9/cam\n")
    log, folder = tmp_path / "log.jsonl", tmp_path / "rec"
    cmd = ["live", "--sources", str(cams), "--model", str(small_folder), "--duration", "2", "--max-tokens", "3"]
    assert main([*cmd, "--json", "-o", str(log), "--annotate", f"{folder}/"]) == 1  # the door's camera is off
    captured = capsys.readouterr()
    stats = json.loads(captured.out)
    assert set(stats["sources"]) == {"Lobby", "Door"} and stats["sources"]["Lobby"]["completed"] > 3
    assert "Door: no frames received (Connection refused)" in captured.err
    assert {json.loads(line)["source"] for line in log.read_text().splitlines()} == {"Lobby"}
    assert [p.name.split("_", 1)[1] for p in sorted(folder.iterdir())] == ["Lobby.mp4"]  # the door's: no frame
    said = captured.out + captured.err + log.read_text()
    assert "s3cret" not in said and "127.0.0.1:9" not in said and "cuts_640x360" not in said
    assert main([*cmd, "Lobby"]) == 0  # one of them, by its name
    captured = capsys.readouterr()
    assert "frames captioned" in captured.err and "Door" not in captured.out + captured.err
    for argv, said in [(["live", "--sources", str(cams), "Lobb"], f"Lobb is no name in {cams} (Lobby, Door) and no file"),
                       (["live", "--sources", str(cams), "Lobby", "Lobby"], "a source is listed twice"),
                       (["live"], "name a SOURCE (a file, webcam:N, a stream URL, -), or give --sources FILE")]:
        assert main(argv) == 2
        assert capsys.readouterr().err == f"vlmstream: error: {said}\n"


def test_the_json_summary_of_several_sources_totals_every_counter(capsys):
    """`live a b --json`: the top-level figures are each source's summed, past-the-deadline
    frames among them."""
    import argparse
    import types

    from app.live_run import _SUMMED, LiveRun

    run = LiveRun.__new__(LiveRun)
    run.args, run.labels, run.several, run.changes = argparse.Namespace(json=True, deadline_ms=50), ["a", "b"], True, None
    per_source = [{k: 1 + i for k in ("frames_in", "submitted", "completed", "cancelled_stale",
                                      "cancelled_deadline", "cancelled_closed", "dropped", "achieved_fps")}
                  for i in range(2)]
    run.report(per_source, types.SimpleNamespace(kv_pages_in_use=0, draft_proposed=0, draft_accepted=0), 2.0)
    stats = json.loads(capsys.readouterr().out)
    assert {k: stats[k] for k in _SUMMED} == {k: 3 for k in per_source[0]}
    assert stats["cancelled_deadline"] == 3 and set(stats["sources"]) == {"a", "b"}


def test_the_json_summary_of_several_sources_totals_the_frames_passed_over(capsys):
    """`live a b --fps 10 --json`: the frames each source read but never offered (overwritten at
    the grab, above --fps) are totalled as frames_in is, so that the top-level figures add up to
    the frames read; a source without a grabber (none of these counters) counts none."""
    import argparse
    import types

    from app.live_run import LiveRun

    run = LiveRun.__new__(LiveRun)
    run.args, run.labels, run.several, run.changes = argparse.Namespace(json=True, deadline_ms=None), ["a", "b", "c"], True, None
    per_source = [{"frames_in": 31, "submitted": 31, "completed": 31, "cancelled_stale": 0, "cancelled_deadline": 0,
                   "cancelled_closed": 0, "dropped": 0, "achieved_fps": 10.0, **extra}
                  for extra in ({"overwritten_at_grab": 8, "above_fps": 146}, {"overwritten_at_grab": 2, "above_fps": 60},
                                {})]
    run.report(per_source, types.SimpleNamespace(kv_pages_in_use=0, draft_proposed=0, draft_accepted=0), 2.0)
    stats = json.loads(capsys.readouterr().out)
    assert stats["frames_in"] == 93 and stats["overwritten_at_grab"] == 10 and stats["above_fps"] == 206


def test_the_json_summary_of_sources_that_ended_apart_rates_the_run(capsys):
    """`live short.mp4 long.mp4 --json`: each source is rated over its own time, so a 2 s clip's
    60 frames (30 fps) beside a 3 s clip's 75 (25 fps) are 135 frames in the run's 3 s, 45 a
    second, not the rates' sum, 55."""
    import argparse
    import types

    from app.live_run import LiveRun

    run = LiveRun.__new__(LiveRun)
    run.args, run.labels, run.several, run.changes = argparse.Namespace(json=True, deadline_ms=None), ["a", "b"], True, None
    per_source = [{"frames_in": n, "submitted": n, "completed": n, "cancelled_stale": 0, "cancelled_deadline": 0,
                   "cancelled_closed": 0, "dropped": 0, "achieved_fps": fps} for n, fps in ((60, 30.0), (75, 25.0))]
    run.report(per_source, types.SimpleNamespace(kv_pages_in_use=0, draft_proposed=0, draft_accepted=0), 2.0)
    stats = json.loads(capsys.readouterr().out)
    assert stats["completed"] == 135 and stats["achieved_fps"] == pytest.approx(45.0)
    assert [s["achieved_fps"] for s in stats["sources"].values()] == [30.0, 25.0]


def test_after_a_stall_a_feed_goes_back_to_its_fps_at_once(monkeypatch):
    """`live --fps 10` of a source that stalled (a network outage of 10 s): when frames come again
    they are offered at 10 a second from then on, not all of them until the pacing has made up
    for the ten seconds missed (a burst of 100 frames that the engine drops at its intake)."""
    import types

    import pipelines.feed
    from pipelines.feed import LiveFeed

    clock, offered, holder = [0.0], [], []
    monkeypatch.setattr(pipelines.feed, "time", types.SimpleNamespace(
        perf_counter=lambda: clock[0], time=time.time, monotonic=time.monotonic))
    monkeypatch.setattr(LiveSession, "offer", lambda self, frame: offered.append(frame.index) or True)
    schedule = [0.0] + [10.0 + i / 100 for i in range(20)]  # a frame, 10 s of nothing, then 100 fps

    def frames():
        for i, t in enumerate(schedule):
            _wait(lambda: holder and len(offered) + holder[0]._above_fps == i)  # the one before, taken
            clock[0] = t
            yield Frame("cam", i, t, np.zeros((8, 8, 3), np.uint8))

    feed = LiveFeed(None, {"caption": "short"}, SamplingParams(), frames, realtime=False, fps=10)
    holder.append(feed)
    try:
        _wait(lambda: len(offered) + feed._above_fps == len(schedule))
    finally:
        feed.close()
    assert offered[0] == 0 and len(offered) <= 5, offered  # 10.0, 10.1 and a frame or two as it starts again


def test_the_terminal_shows_a_line_per_prompt_of_each_frame(capsys):
    """`live --caption short --question ...`: each frame's answers are printed a line each, every
    one with the frame's time and latency."""
    import argparse
    import threading as _threading

    from app.live_run import LiveRun
    from pipelines.live import LiveResult

    run = LiveRun.__new__(LiveRun)
    run.args, run.log, run.snapshots, run.write_error = argparse.Namespace(json=False, output=None), None, None, []
    run.print_lock, run.changes, run.recorders, run.several, run.width = _threading.Lock(), None, {}, False, 3
    frame = Frame("cam", 7, 1.5, np.zeros((8, 8, 3), np.uint8))
    outs = [RequestOutput("a red circle", [1], "stop"), RequestOutput("yes", [2], "stop")]
    run.show("cam", LiveResult(frame, outs, 42.0, [{"caption": "short"}, {"question": "Is there a star?"}]))
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and all(re.match(r"\s+1\.500\s+42\.0 ms  ", line) for line in lines), lines
    assert lines[0].endswith("a red circle") and lines[1].endswith("yes")


def test_a_pushed_frame_is_given_once_not_again_until_a_new_one_comes():
    """The locator captions each frame a browser pushes once: the frame taken is not given again
    while the viewer's camera sends nothing new."""
    from pipelines.grabber import PushedFrames

    pushed, got = PushedFrames(), []
    reader = threading.Thread(target=lambda: got.extend(pushed.frames()), daemon=True)
    reader.start()
    first, second = _frames(2)
    pushed.push(first)
    _wait(lambda: len(got) >= 1)
    pushed.push(second)
    _wait(lambda: len(got) >= 2)
    pushed.close()
    reader.join(5)
    assert got == [first, second]


def test_a_looped_source_that_paces_itself_is_timed_at_least_by_the_wall_clock():
    """A camera's snapshot URL read again and again (a pass of one frame, each taking its time to
    fetch): its frames' times keep up with the wall clock, not a frame step a pass."""
    def fetch():
        time.sleep(0.1)
        yield Frame("snap", 0, 0.0, np.zeros((2, 2, 3), np.uint8))

    taken = _taken(LatestFrameGrabber(fetch, realtime=False, loop=True), 4)
    # frame k came after k + 1 fetches of at least 0.1 s: its pass began k * 0.1 s after the start
    assert all(f.pts >= 0.1 * f.index - 1e-6 for f in taken), [(f.index, f.pts) for f in taken]
    assert [f.pts for f in taken] == sorted(f.pts for f in taken)


def test_a_looped_clip_of_one_frame_keeps_its_pace():
    """A clip of a single frame not at time 0 (its stream's start offset) looped in real time: each
    pass a frame step after the last, not ever further apart."""
    g = LatestFrameGrabber(lambda: iter([Frame("f", 0, 0.5, np.zeros((2, 2, 3), np.uint8))]), realtime=True, loop=True)
    got = [f.pts for f in _taken(g, 4)]
    gaps = np.diff(got)
    assert gaps == pytest.approx([gaps[0]] * 3), got


def test_a_failed_sources_line_names_it_once():
    """Said while others go on: the error names its source already ("cannot read cam1: ..."), or
    is prefixed with it; a label found elsewhere in the text (a camera called `10`, in "nothing
    for 10 s") is not taken for the name."""
    from app.live_report import newly_failed

    said: set = set()
    errors = {"rtsp://cam1": "cannot read rtsp://cam1: 404 Not Found", "10": "it stopped sending frames (nothing for 10 s)"}
    assert newly_failed(errors, {"rtsp://cam1", "10", "other"}, said) == [
        ("rtsp://cam1", "cannot read rtsp://cam1: 404 Not Found"), ("10", "10: it stopped sending frames (nothing for 10 s)")]
    assert newly_failed(errors, {"other"}, said) == []  # said once


def test_a_session_refuses_a_malformed_task_or_setting_when_made_not_at_its_first_frame():
    """A task given as "short", with an unknown key or with `params` in it, and params as a dict,
    had been taken, then a TypeError (AttributeError) from inside Engine.submit at the first offer;
    max_inflight "2" or deadline_ms "5" a TypeError from a comparison, 1.5 taken; close(math.inf)
    an OverflowError from Thread.join."""
    import math

    from engine import RequestError

    bad = [({"task": "short"}, "a task is a dict such as"),
           ({"task": [{"caption": "short"}, "long"]}, "a task is a dict such as"),
           ({"task": {"caption": "short", "params": SamplingParams()}}, "unknown task key 'params'"),
           ({"task": {"caption": "short", "question": "Why?"}}, "exactly one of caption"),
           ({"task": []}, "at least one prompt"),
           ({"params": {"max_tokens": 5}}, "params must be a SamplingParams"),
           ({"max_inflight": "2"}, "max_inflight must be an integer >= 1"),
           ({"max_inflight": 1.5}, "max_inflight must be an integer >= 1"),
           ({"deadline_ms": "5"}, "deadline_ms must be a finite number > 0")]
    for kw, message in bad:
        kw = {"task": {"caption": "short"}, **kw}
        with pytest.raises(RequestError, match=message):
            LiveSession(_HeldEngine(), **kw)
    engine = _HeldEngine()
    s = LiveSession(engine, [{"question": "Is it open?", "constraint": None}], max_inflight=2)
    with pytest.raises(RequestError, match="max_inflight must be an integer"):
        s.set_max_inflight("3")
    assert s.offer(_frames(1)[0])
    engine.handles[0].finish("yes")
    _wait(lambda: s.completed == 1)
    with pytest.raises(RequestError, match="timeout must be a number of seconds or None"):
        s.close(timeout="5")
    assert s.offer(_frames(2)[1])  # a refused close left the session open, as Engine.close does
    engine.handles[1].finish("no")
    _wait(lambda: s.completed == 2)
    s.close(timeout=math.inf)
    assert not s._thread.is_alive()


def test_the_closing_line_of_a_slow_model_gives_its_rate_and_the_frames_a_stop_cancelled(capsys):
    """Moondream 2 on a CPU, one answer every ~27 s, stopped by Ctrl-C during an answer: the line
    said "1 of 2121 frames captioned, 0.0 fps, 0 stale cancelled, 2119 dropped" (nothing done,
    it read, and one frame missing from the figures)."""
    import argparse
    import types

    from app.live_run import LiveRun

    run = LiveRun.__new__(LiveRun)
    run.args, run.labels, run.several, run.changes = argparse.Namespace(json=False, deadline_ms=None), ["a"], False, None
    s = {"frames_in": 2121, "submitted": 2, "completed": 1, "cancelled_stale": 0, "cancelled_deadline": 0,
         "cancelled_closed": 1, "dropped": 2119, "achieved_fps": 1 / 27.3, "latency_ms": {}}
    run.report([s], types.SimpleNamespace(kv_pages_in_use=0, draft_proposed=0, draft_accepted=0), 2.0)
    line = capsys.readouterr().err.strip()
    assert line == ("vlmstream: 1 of 2121 frames captioned, 0.037 fps (an answer every 27 s), 0 stale cancelled, "
                    "1 cancelled at the stop, 2119 dropped"), line
    run.report([{**s, "cancelled_closed": 0, "achieved_fps": 12.34}],
               types.SimpleNamespace(kv_pages_in_use=0, draft_proposed=0, draft_accepted=0), 2.0)
    assert ", 12.3 fps, 0 stale cancelled, 2119 dropped" in capsys.readouterr().err  # as before


def test_a_ctrl_c_with_frames_in_flight_says_at_once_that_it_cancels_them(small_folder, capsys, monkeypatch):
    """Moondream 2 on a CPU: a Ctrl-C during an answer ended the run ~7 s later (the model's step
    under way ends first) with nothing said meanwhile. The cancelling is said at once, before the
    closing figures, which count the frame it cancelled."""
    from app.cli import main
    from app.live_run import LiveRun
    from engine.batch import Batch

    commit, say_failed = Batch.commit, LiveRun.say_failed
    monkeypatch.setattr(Batch, "commit", lambda self, record: (time.sleep(0.2), commit(self, record))[1])

    def ctrl_c_once_a_frame_is_in_flight(self, feeds):  # called at each turn of the run's loop
        say_failed(self, feeds)
        if any(f.session.in_flight for f in feeds):
            raise KeyboardInterrupt

    monkeypatch.setattr(LiveRun, "say_failed", ctrl_c_once_a_frame_is_in_flight)
    sample = Path(__file__).resolve().parents[1] / "sample_videos" / "cuts_640x360_30fps.mp4"
    assert main(["live", str(sample), "--model", str(small_folder), "--duration", "20", "--max-tokens", "8",
                 "--no-draft"]) == 130
    lines = capsys.readouterr().err.strip().splitlines()
    assert re.fullmatch(r"vlmstream: interrupted: cancelling the (\d+) frames? in flight "
                        r"\(the model's step under way ends first\)", lines[-2]), lines
    n = int(re.search(r"the (\d+) frame", lines[-2]).group(1))
    assert f"{n} cancelled at the stop" in lines[-1] and "frames captioned" in lines[-1], lines


def test_a_slow_feeds_chart_keeps_its_last_answers_beyond_the_window():
    """Moondream 2 on a CPU answers every ~30 s: the web UI's 30 s chart held one bar, each
    answer's replacing the one before. Its last few stay however old, and the chart says the
    time they cover (one frame, not "1 frames")."""
    from app.view import chart_svg
    from pipelines.feed import LiveFeed

    engine = _HeldEngine()
    feed = LiveFeed(engine, {"caption": "short"}, SamplingParams(), window_s=0.05, max_inflight=1)
    try:
        for i in range(3):
            _push_answered(feed, engine, i)
            time.sleep(0.1)  # past the window before the next answer
        points = feed.snapshot().latency
        assert [p.index for p in points] == [0, 1, 2]
    finally:
        feed.close()
    span = points[-1].wall - points[0].wall
    svg = chart_svg(points, 0.05)
    assert f"last {span:.0f} s (3 frames shown)" in svg and 'data-bars="3"' in svg
    assert "(1 frame shown)" in chart_svg(points[:1], 30.0) and "(1 frame):" in chart_svg(points[:1], 30.0)


def test_a_listed_url_that_is_no_stream_url_is_said_by_its_name(tmp_path, capsys):
    """`live --sources cams.txt NAME` (and a page's Start of NAME): a mistyped scheme or port was
    said with the URL's host, and a URL that does not parse with its password whole
    ("rtsp://admin:s3cret@[::1/cam is not a valid URL"): a listed source goes by its name in
    everything the run says."""
    from app.cli import main

    cams = tmp_path / "cams.txt"
    cams.write_text("Typo = rtps://admin:s3cret@10.0.0.5/cam\nBracket = rtsp://admin:s3cret@[::1/cam\n"
                    "Port = rtsp://10.0.0.5:99999/cam?token=t0k\n")
    for name, said in [("Typo", "unsupported URL scheme 'rtps' in Typo"),
                       ("Bracket", "Bracket: not a valid URL (Invalid IPv6 URL)"),
                       ("Port", "Port: Port out of range")]:
        assert main(["live", "--sources", str(cams), name]) == 2
        err = capsys.readouterr().err
        assert said in err and "s3cret" not in err and "10.0.0.5" not in err and "::1" not in err, err


def test_a_listed_files_relative_path_is_taken_from_the_lists_folder(small_folder, tmp_path, monkeypatch, capsys):
    """`Door = clips/door.mp4` in /etc/vlmstream/cams.txt: the path was looked for in the folder
    the run (or the web UI's server) was started from, so the list worked from one folder and
    said "no such file" from any other. A setup file's paths are its own folder's, as README says;
    ~ is the home folder; URLs, webcam:N and - are kept as they are."""
    from app.cli import main
    from app.source_list import read_sources

    samples = Path(__file__).resolve().parents[1] / "sample_videos"
    setup = tmp_path / "setup"
    (setup / "clips").mkdir(parents=True)
    (setup / "clips" / "door.mp4").write_bytes((samples / "cuts_640x360_30fps.mp4").read_bytes())
    (setup / "cams.txt").write_text("Door = clips/door.mp4\nHome = ~/yard.mp4\nAbs = /srv/a.mp4\n"
                                    "Cam = webcam:1\nPi = -\nGate = rtsp://10.0.0.5/live\n")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert read_sources(str(setup / "cams.txt")).named == {
        "Door": str(setup / "clips" / "door.mp4"), "Home": str(tmp_path / "home" / "yard.mp4"), "Abs": "/srv/a.mp4",
        "Cam": "webcam:1", "Pi": "-", "Gate": "rtsp://10.0.0.5/live"}
    assert read_sources("../setup/cams.txt").named["Door"] == "../setup/clips/door.mp4"
    assert main(["live", "--sources", "../setup/cams.txt", "Door", "--model", str(small_folder), "--duration", "1",
                 "--max-tokens", "2"]) == 0
    assert "frames captioned" in capsys.readouterr().err


def test_one_source_under_two_names_is_said_by_its_names(tmp_path, capsys):
    """A list that names one camera twice (`Front door` and `Entrance`, for the web UI's viewers):
    `live --sources cams.txt`, which plays all of them, said "a source is listed twice", with no
    word of which (the command line named none)."""
    from app.cli import main

    cams = tmp_path / "cams.txt"
    cams.write_text("Front door = rtsp://admin:s3cret@10.0.0.5/live\nYard = rtsp://10.0.0.6/live\n"
                    "Entrance = rtsp://admin:s3cret@10.0.0.5/live\n")
    assert main(["live", "--sources", str(cams)]) == 2
    err = capsys.readouterr().err
    assert err == "vlmstream: error: a source is listed twice: Front door and Entrance are the same source\n"


def test_a_listed_source_that_cannot_be_opened_is_said_by_its_name(tmp_path, capsys):
    """`live --sources cams.txt` plays every entry: one that could not be opened was said by what
    it stands for alone ("no camera at webcam:9", "video not found: clips/door.mp4"), not by the
    name the run gives it everywhere else."""
    from app.cli import main

    cams = tmp_path / "cams.txt"
    cams.write_text("Back door = webcam:9\nLobby = no/such/door.mp4\n")
    for name, said in [("Back door", "Back door: no camera at webcam:9"), ("Lobby", "Lobby: video not found")]:
        assert main(["live", "--sources", str(cams), name]) == 2
        assert capsys.readouterr().err.startswith(f"vlmstream: error: {said}")
