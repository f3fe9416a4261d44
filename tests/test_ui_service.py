"""The web UI's service layer and views, without a browser: feeds, settings, video jobs, errors."""

import contextlib
import gc
import io
import itertools
import json
import re
import threading
import time
import weakref
from datetime import datetime
from pathlib import Path

import av
import numpy as np
import pytest
from PIL import Image

from app.service import SAMPLES_DIR, Service, Settings, UIError, sample_videos
from app.task import make_constraint, make_task


def threads_named(*names: str) -> set:
    """The live threads of these names. Tests compare sets, not counts: a thread an earlier test
    left winding down may end during a test, and a count would then never come back to its start."""
    return {t for t in threading.enumerate() if t.name in names and t.is_alive()}
from app.view import chart_svg, counters_html, frame_html, log_text, shots_html
from engine import Choice, JsonSchema, Regex, SamplingParams, VlmstreamError
from pipelines.changes import answer_key
from pipelines.caption_log import extend_log
from pipelines.feed import LiveFeed
from pipelines.feed_snapshot import LatencyPoint
from pipelines.shot import SHOT_WIDTH, Shot


@pytest.fixture(scope="module")
def service():
    s = Service(Settings(max_tokens=12))
    yield s
    s.close()
    s.remove_outputs()  # its scratch folder: none left in /tmp


@pytest.fixture(scope="module")
def untrained(untrained_folder):
    """A service on a model whose region head was never trained: detect and point refuse it."""
    s = Service(Settings(model=str(untrained_folder), max_tokens=12))
    yield s
    s.close()
    s.remove_outputs()  # its scratch folder: none left in /tmp


def wait_for(pred, timeout=60.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(0.05)
    raise AssertionError("condition not met in time")


def test_the_upload_fields_take_every_video_the_cli_reads():
    from gradio_client.utils import is_valid_file

    from app.tabs import video_file_types
    from pipelines.sources import VIDEO_EXTENSIONS

    # through Gradio's own check: "video" alone turned away .ts, .mts, .m2ts, .3gp and raw .h264
    assert all(is_valid_file(f"clip{ext}", video_file_types()) for ext in VIDEO_EXTENSIONS)
    assert all(is_valid_file(f"CLIP{ext.upper()}", video_file_types()) for ext in VIDEO_EXTENSIONS)
    assert not is_valid_file("notes.txt", video_file_types())


def test_tasks_and_constraints_from_form_fields():
    assert make_task("normal") == {"caption": "normal"}
    assert make_task("question", " How many shapes are there? ") == {"question": "How many shapes are there?"}
    assert make_task("question", "Is there a star?", "choices", "yes, no") == {
        "question": "Is there a star?", "constraint": Choice(["yes", "no"])}
    assert make_constraint("choices", "yes\nno\n") == Choice(["yes", "no"])  # one a line, as the box says
    assert make_constraint("regex", "(one|two)") == Regex("(one|two)")
    assert make_constraint("json schema", '{"type": "string"}') == JsonSchema({"type": "string"})
    assert make_task("question", "How many?\n\n Is there a star? \n", "choices", "yes, no, one") == [
        {"question": "How many?", "constraint": Choice(["yes", "no", "one"])},
        {"question": "Is there a star?", "constraint": Choice(["yes", "no", "one"])}]  # one a line
    # a question line may carry its own constraint, which replaces the form's for it
    assert make_task("question", "Is the door open? [yes, no]\nHow many? /[0-9]+/\nWhat colour is it?\n"
                     "Is it? Really? [a,b]\nWhich? /(one|two)?/\nWhat is [this]", "choices", "red, blue") == [
        {"question": "Is the door open?", "constraint": Choice(["yes", "no"])},
        {"question": "How many?", "constraint": Regex("[0-9]+")},
        {"question": "What colour is it?", "constraint": Choice(["red", "blue"])},
        {"question": "Is it? Really?", "constraint": Choice(["a", "b"])},
        {"question": "Which?", "constraint": Regex("(one|two)?")},
        {"question": "What is [this]", "constraint": Choice(["red", "blue"])}]  # no question mark before it
    assert make_task("question", "Is there a star? [yes, no]") == {"question": "Is there a star?",
                                                                   "constraint": Choice(["yes", "no"])}
    with pytest.raises(UIError, match="choices constraint is empty"):
        make_task("question", "Is there a star? [ ]")
    for bad in [("question", ""), ("medium", ""), ("question", "Why?\nWhy?"), ("question", "Why? [a]\nWhy? /b/")]:
        with pytest.raises(UIError):
            make_task(*bad)
    # a frame's questions fit one batch: one page's thousands of lines had held up every other page
    many = [f"Is there a shape number {i}?" for i in range(33)]
    assert len(make_task("question", "\n".join(many[:32]))) == 32
    with pytest.raises(UIError, match="33 questions: at most 32"):
        make_task("question", "\n".join(many))
    with pytest.raises(UIError, match="not valid JSON"):
        make_constraint("json schema", "{oops")
    with pytest.raises(UIError, match="empty"):
        make_constraint("regex", "  ")


def test_live_feed_on_a_sample_gives_captions_for_the_frames_they_describe(service):
    assert "shapes_640x360_60fps.mp4" in sample_videos()
    # each frame's own greedy answer (a sticky one depends on the frames before: tests/test_sticky.py)
    service.apply(Settings(max_tokens=12, sticky=0.0))
    feed = service.start_live("tab-a", "shapes_640x360_60fps.mp4", make_task("short"))
    try:
        snap = wait_for(lambda: (s := feed.snapshot()).counters["completed"] >= 5 and s)
        assert snap.running and snap.error is None and snap.text and snap.frame_rgb.shape == (360, 640, 3)
        assert snap.log[-1].text == snap.text and snap.log[-1].index == snap.index
        # the caption shown is the one for the frame shown: the same frame alone gets the same words
        assert service.caption_image(snap.frame_rgb, make_task("short"))["text"] == snap.text
        assert all(set(p.stages_ms) == {"queue", "vision", "prefill", "decode"} for p in snap.latency)
        assert all(p.end_to_end_ms > 0 for p in snap.latency)
        assert service.feed("tab-a") is feed and service.feed("tab-b") is None
        busy = wait_for(lambda: (e := service.engine_stats())["tokens_per_s"] > 0 and e["device_busy_pct"] > 0
                        and e["vision_busy_pct"] > 0 and e)  # frames are encoded on the CPU's vision thread
        assert busy["mode"] == "pipelined" and busy["kv_pages_total"] > 0
    finally:
        service.stop_live("tab-a")
        service.apply(Settings(max_tokens=12))
    assert not feed.running and service.feed("tab-a") is None
    wait_for(lambda: service.engine().stats().kv_pages_in_use == 0)
    # the figures are current, not averages since start: idle now means 0 tokens/s
    wait_for(lambda: service.engine_stats()["tokens_per_s"] == 0, timeout=20)


def test_a_live_feed_keeps_a_picture_of_each_change_of_its_answers(service):
    from PIL import Image

    # the scene-cut sample: its captions change at every cut, and as objects come and go
    feed = service.start_live("tab-s", "cuts_640x360_30fps.mp4", make_task("short"))
    try:
        snap = wait_for(lambda: len((s := feed.snapshot()).shots) >= 3 and s)
    finally:
        service.stop_live("tab-s")
    # a run's line takes its newest wording (the same things named in another order: one run)
    runs = {line.first_pts: line for line in snap.log}
    numbers = [shot.number for shot in snap.shots]
    assert numbers == list(range(numbers[0], numbers[0] + len(numbers)))  # every change, in order
    assert len(snap.log) >= numbers[-1]  # a run that did not hold is in the log, not a change
    for shot in snap.shots:  # the frame where a run of identical answers began, with those answers,
        run = runs[shot.pts]
        assert answer_key(run.text) == answer_key(shot.text) and run.frames >= Settings().hold  # once it held
        assert Image.open(io.BytesIO(shot.jpeg)).size == (SHOT_WIDTH, SHOT_WIDTH * 360 // 640)
    assert all(a.text != b.text for a, b in zip(snap.shots, snap.shots[1:]))  # each is a change
    # all of them at full size in one download, also after Stop, each with its answers and times
    import zipfile

    with zipfile.ZipFile(service.export_shots("tab-s")) as z:
        rows = [json.loads(line) for line in z.read("changes.jsonl").decode().splitlines()]
        ended = service.live._ended["tab-s", "pull"].snapshot().shots  # a result may have come after snap
        assert [(r["number"], r["index"], r["pts"], r["text"]) for r in rows] \
            == [(x.number, x.index, round(x.pts, 6), x.text) for x in ended]
        assert sorted(z.namelist()) == sorted([r["file"] for r in rows] + ["changes.jsonl"])
        for r, shot in zip(rows, ended):
            full = Image.open(io.BytesIO(z.read(r["file"])))
            assert full.format == "JPEG" and full.size == (640, 360)
            # named to sort in the order of the changes, in any file manager
            assert r["file"] == f"change_{shot.number:04d}_frame_{shot.index}.jpg"
            # UTC, and said so: a time without its offset reads as the reader's local time
            assert r["time"].endswith("+00:00")
            assert abs(datetime.fromisoformat(r["time"]).timestamp() - shot.wall) < 0.001
    service.close_session("tab-s")
    with pytest.raises(UIError, match="no changes yet: start a live source first"):
        service.export_shots("tab-s")
    with pytest.raises(UIError, match="no changes yet: start your camera first"):
        service.export_shots("tab-s", "push")


def test_a_double_click_on_start_leaves_one_feed_and_its_recording(service):
    """Two Starts of one session at once (the page runs both): one feed plays, Stop stops it, and
    nothing keeps playing for nobody; the recording is the playing feed's, whole."""

    import av

    before = threads_named("vlmstream-feed")
    for _ in range(2):
        gate = threading.Barrier(2)
        errors = []

        def start():
            gate.wait()
            try:
                service.start_live("tab-dbl", "shapes_640x360_60fps.mp4", make_task("short"), record=True)
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=start) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors and len(threads_named("vlmstream-feed") - before) == 1
        feed = service.feed("tab-dbl")
        wait_for(lambda: feed.snapshot().counters["completed"] >= 5)
        service.stop_live("tab-dbl")
        wait_for(lambda: threads_named("vlmstream-feed") <= before, timeout=15)
        with av.open(str(service.recording("tab-dbl"))) as c:
            assert sum(1 for _ in c.decode(video=0)) >= 5
    service.close_session("tab-dbl")


def test_a_tab_closing_while_its_start_opens_the_source_leaves_no_feed(service, monkeypatch):

    import pipelines.sources

    opened = threading.Event()
    real = pipelines.sources.open_live

    def slow_open(source, **kwargs):  # a network source takes its time to answer
        opened.set()
        time.sleep(1.0)
        return real(source, **kwargs)

    monkeypatch.setattr(pipelines.sources, "open_live", slow_open)
    before = threads_named("vlmstream-feed")
    start = threading.Thread(target=service.start_live, args=("tab-gone", "shapes_640x360_60fps.mp4",
                                                              make_task("short")))
    start.start()
    assert opened.wait(30)
    service.close_session("tab-gone")  # the page went away meanwhile
    start.join(30)
    assert service.feed("tab-gone") is None
    wait_for(lambda: threads_named("vlmstream-feed") <= before, timeout=15)


def test_a_feed_keeps_only_its_last_change_pictures(service):
    frames = [np.asarray(Image.open(SAMPLES_DIR / "scene.png").convert("RGB")), np.zeros((120, 160, 3), np.uint8)]
    plain = SamplingParams(max_tokens=12)  # each frame's own answer, not one kept from the frame before
    feed = LiveFeed(service.engine(), make_task("short"), plain, shots=2)
    try:
        for i in range(6):  # two pictures with different captions, in turn: every answer is a change
            feed.push(frames[i % 2])
            wait_for(lambda i=i: feed.snapshot().counters["completed"] == i + 1)
        snap = feed.snapshot()
        assert [line.frames for line in snap.log] == [1] * 6
        assert [s.number for s in snap.shots] == [5, 6] and [s.index for s in snap.shots] == [4, 5]
    finally:
        feed.close()
    # with a hold, an answer that comes one frame only is in the log but gets no picture; one that
    # holds gets the picture of its first frame
    steady = LiveFeed(service.engine(), make_task("short"), plain, hold=2)
    try:
        for i, k in enumerate([0, 0, 1, 0, 0, 1, 1]):
            steady.push(frames[k])
            wait_for(lambda i=i: steady.snapshot().counters["completed"] == i + 1)
        snap = steady.snapshot()
        assert [line.frames for line in snap.log] == [2, 1, 2, 2]
        assert [(s.number, s.index) for s in snap.shots] == [(1, 0), (2, 5)]
        assert snap.shots[1].text == snap.log[-1].text != snap.shots[0].text
    finally:
        steady.close()
    none = LiveFeed(service.engine(), make_task("short"), plain, shots=0)  # the CLI's: none kept
    none.push(frames[0])
    wait_for(lambda: none.snapshot().counters["completed"] == 1)
    assert none.snapshot().shots == [] and len(none.snapshot().log) == 1
    none.close()


def test_closing_a_tab_cancels_its_requests_and_leaves_other_tabs_running(service):
    # tabs of its own: a closed session stays closed for the shared service (the first live test
    # uses "tab-a", and run after this one it had found its page closed)
    from pipelines.live import DEFAULT_MAX_INFLIGHT

    a = service.start_live("tab-closing-a", "shapes_640x360_60fps.mp4", make_task("long"))
    assert a.snapshot().counters["max_inflight"] == DEFAULT_MAX_INFLIGHT
    b = service.start_live("tab-closing-b", "cuts_640x360_30fps.mp4", make_task("short"))
    try:
        # two viewers share the frames in flight one had: the same frames a second, no longer waits
        assert [f.snapshot().counters["max_inflight"] for f in (a, b)] == [DEFAULT_MAX_INFLIGHT // 2] * 2
        wait_for(lambda: a.snapshot().counters["completed"] >= 2 and b.snapshot().counters["completed"] >= 2)
        service.close_session("tab-closing-a")
        assert not a.running and b.running
        assert b.snapshot().counters["max_inflight"] == DEFAULT_MAX_INFLIGHT
        done = b.snapshot().counters["completed"]
        wait_for(lambda: b.snapshot().counters["completed"] > done + 3)
        assert a.session.in_flight == 0
    finally:
        service.close_session("tab-closing-b")
    wait_for(lambda: service.engine().stats().kv_pages_in_use == 0)


def test_a_live_session_exports_its_captions_even_after_stop(service):
    with pytest.raises(UIError, match="nothing captioned yet: start a live source"):
        service.export_log("tab-e")
    with pytest.raises(UIError, match="nothing captioned yet: start your camera"):
        service.export_log("tab-e", "push")
    feed = service.start_live("tab-e", "cuts_640x360_30fps.mp4", make_task("short"))
    wait_for(lambda: feed.snapshot().counters["completed"] >= 5)
    service.stop_live("tab-e")
    completed = feed.snapshot().counters["completed"]
    text = service.export_log("tab-e").read_text()
    assert text.endswith("}\n")  # JSON lines, each ended: another file's lines appended stay lines
    rows = [json.loads(line) for line in text.splitlines()]
    assert len(rows) == completed  # every result, after Stop too
    assert [r["index"] for r in rows] == sorted({r["index"] for r in rows})
    assert rows[-1]["text"].strip() + ("…" if rows[-1]["finish_reason"] == "length" else "") == feed.snapshot().text
    assert all(r["source"].endswith("cuts_640x360_30fps.mp4") and r["timings_ms"]["end_to_end"] > 0 for r in rows)
    assert {r["model"] for r in rows} == {"tiny"}  # as `live -o`'s lines
    service.close_session("tab-e")  # a closed tab's captions go with it
    with pytest.raises(UIError):
        service.export_log("tab-e")


def test_a_live_session_records_its_captioned_frames_for_a_download(service):
    import av

    with pytest.raises(UIError, match="nothing recorded"):
        service.recording("tab-r")
    feed = service.start_live("tab-r", "cuts_640x360_30fps.mp4", make_task("short"), record=True)
    recorder = service.live._recorders[("tab-r", "pull")]
    # The recorder's own count: a frame is counted completed a moment before it reaches the
    # recorder, and one that comes after the recording ended is not in it.
    wait_for(lambda: recorder.written >= 10)
    path = service.recording("tab-r")  # ends the recording; the feed goes on
    # Its name says nothing of the session (a session's id closes it through Gradio's heartbeat
    # route, which asks for no login).
    assert "tab-r" not in path.name and path.name.startswith("live-") and path.suffix == ".mp4"
    with av.open(str(path)) as c:
        times = [float(f.time) for f in c.decode(video=0)]
    assert len(times) == recorder.written >= 10 and times == sorted(times)
    assert recorder.written + recorder.skipped <= feed.snapshot().counters["completed"]
    assert feed.running and service.recording("tab-r") == path  # the same finished file again
    # a new Start with Record replaces it; one without keeps the last for a download
    feed = service.start_live("tab-r", "cuts_640x360_30fps.mp4", make_task("short"), record=True)
    assert not path.exists()
    wait_for(lambda: feed.snapshot().counters["completed"] >= 3)
    service.stop_live("tab-r")  # Stop finishes the file
    assert service.recording("tab-r").stat().st_size > 0
    service.start_live("tab-r", "cuts_640x360_30fps.mp4", make_task("short"))
    assert service.recording("tab-r").exists()
    service.close_session("tab-r")  # a closed tab's recording goes with it
    assert not path.exists()
    with pytest.raises(UIError, match="nothing recorded"):
        service.recording("tab-r")


def test_the_stopped_feeds_and_recordings_of_sessions_that_never_close_stay_bounded(service, monkeypatch):
    import app.live_sessions

    # An API client without Gradio's heartbeat never unloads: each call is a session whose stopped
    # feed and recording had stayed until the server stopped.
    monkeypatch.setattr(app.live_sessions, "STOPPED_KEPT", 2)
    live, sessions, files = service.live, [f"tab-api-{i}" for i in range(5)], []
    running = service.push_frame("tab-api-cam", np.zeros((64, 64, 3), np.uint8), make_task("short"), record=True)
    try:
        for i, sid in enumerate(sessions):
            if i == 1:  # stopped long ago, but its camera runs on: that feed and its recording stay
                service.push_frame("tab-api-cam", np.zeros((64, 64, 3), np.uint8), make_task("normal"), record=True)
            service.start_live(sid, "cuts_640x360_30fps.mp4", make_task("short"), record=True)
            recorder = live._recorders[(sid, "pull")]
            wait_for(lambda: recorder.written >= 1)
            service.stop_live(sid)
            files.append(recorder.path)
        assert {s for s, _ in live._ended} | {s for s, _ in live._recorders} == {*sessions[-2:], "tab-api-cam"}
        assert [f.exists() for f in files] == [False, False, False, True, True]
        assert service.export_log(sessions[-1]).exists()
        with pytest.raises(UIError, match="nothing recorded"):
            service.recording(sessions[0])
        assert service.feed("tab-api-cam", "push") is not running and ("tab-api-cam", "push") in live._recorders
    finally:
        for sid in (*sessions, "tab-api-cam"):
            service.close_session(sid)
    assert not live._stopped and all(not f.exists() for f in files)


def test_a_camera_records_while_its_record_box_is_ticked(service):
    import av
    import cv2

    cap = cv2.VideoCapture(str(SAMPLES_DIR / "cuts_640x360_30fps.mp4"))
    frames = [cv2.cvtColor(cap.read()[1], cv2.COLOR_BGR2RGB) for _ in range(30)]
    sent = [0]

    def stream(task, record, until):  # the browser's camera: ten frames a second until `until` holds
        while True:
            feed = service.push_frame("tab-w", frames[sent[0] % len(frames)], task, record=record)
            sent[0] += 1
            if until(feed):
                return feed
            time.sleep(0.1)

    with pytest.raises(UIError, match="while your camera streams"):
        service.recording("tab-w", "push")
    feed = stream(make_task("short"), False, lambda f: f.snapshot().counters["completed"] >= 2)
    assert ("tab-w", "push") not in service.live._recorders  # not ticked: nothing recorded
    feed = stream(make_task("short"), True, lambda f: f.snapshot().counters["completed"] >= 6)
    recorder = service.live._recorders[("tab-w", "push")]
    wait_for(lambda: recorder.written >= 2)
    # a new prompt starts a new feed; the recording goes on across it
    written = recorder.written
    new = stream(make_task("normal"), True, lambda f: f.snapshot().counters["completed"] >= 3)
    assert new is not feed and service.live._recorders[("tab-w", "push")] is recorder
    stream(make_task("normal"), False, lambda f: True)  # unticked: the file is finished
    path = service.recording("tab-w", "push")
    assert "tab-w" not in path.name and path.name.startswith("camera-")
    with av.open(str(path)) as c:
        times = [float(f.time) for f in c.decode(video=0)]
    assert len(times) == recorder.written > written and times == sorted(times) and recorder.error is None
    # ticked again: a new recording replaces that one; a download ends it, and it stays ended
    import os

    with open(path, "rb") as finished:  # the same name: the new recording's file is opened as it starts
        stream(make_task("normal"), True, lambda f: service.live._recorders[("tab-w", "push")].written >= 1)
        assert os.fstat(finished.fileno()).st_nlink == 0  # the finished one was removed
    # the camera stopped; the download comes 2 s later: the last frame had lasted those 2 s (the
    # recording closed at the download), up to 600 s for a download much later
    time.sleep(2.0)
    path = service.recording("tab-w", "push")
    with av.open(str(path)) as c:
        last = max(float(f.time) for f in c.decode(video=0))
        assert c.duration / 1_000_000 < last + 1.5
    done = service.live._recorders[("tab-w", "push")].written
    stream(make_task("normal"), True, lambda f: f.snapshot().counters["completed"] >= 6)
    assert path.exists() and service.live._recorders[("tab-w", "push")].written == done
    with pytest.raises(UIError, match="nothing recorded: tick Record, then Start"):
        service.recording("tab-w")  # the Live tab's recording is another one
    service.close_session("tab-w")
    assert not path.exists()


def _quiet_udp_url() -> str:
    """A stream that never sends a frame: a feed on it connects for as long as it runs."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as quiet:  # a UDP port nothing is sent to
        quiet.bind(("127.0.0.1", 0))
        return f"udp://127.0.0.1:{quiet.getsockname()[1]}"


def test_a_new_start_that_has_nothing_yet_leaves_the_last_feeds_exports(service):
    """Stop, then Start again (another source, one still connecting): until the new feed has
    captions of its own, Export and the pictures' download give the last feed's, as after a Stop."""
    import zipfile

    feed = service.start_live("tab-again", "cuts_640x360_30fps.mp4", make_task("short"))
    try:
        wait_for(lambda: feed.snapshot().shots and feed.records())
    finally:
        service.stop_live("tab-again")
    try:
        new = service.start_live("tab-again", _quiet_udp_url(), make_task("short"))
        assert new is not feed and not new.records() and not new.snapshot().shots
        assert service.export_log("tab-again").read_text().splitlines() == feed.records()
        with zipfile.ZipFile(service.export_shots("tab-again")) as z:
            rows = [json.loads(line) for line in z.read("changes.jsonl").decode().splitlines()]
        assert [r["number"] for r in rows] == [x.number for x in feed.snapshot().shots]
    finally:
        service.close_session("tab-again")


def test_a_recording_that_failed_or_has_no_frame_is_said_not_handed_over(service, tmp_path, monkeypatch):
    """Download recording: a recording whose file could not be written says why, and one that has
    no frame yet (a source still connecting) says so; neither hands the page a broken MP4."""
    feed = service.start_live("tab-rec0", _quiet_udp_url(), make_task("short"), record=True)
    try:
        assert feed.snapshot().counters["completed"] == 0
        with pytest.raises(UIError, match="nothing recorded yet: no frame was captioned"):
            service.recording("tab-rec0")
    finally:
        service.close_session("tab-rec0")
    monkeypatch.setattr(service.jobs, "recording_path", lambda kind: tmp_path / "gone" / f"{kind}.mp4")
    feed = service.start_live("tab-rec1", "cuts_640x360_30fps.mp4", make_task("short"), record=True)
    try:
        recorder = service.live._recorders["tab-rec1", "pull"]
        wait_for(lambda: recorder.error is not None)  # its first frame found no folder to go to
        with pytest.raises(UIError, match="the recording failed: "):
            service.recording("tab-rec1")
    finally:
        service.close_session("tab-rec1")


def test_unticking_a_cameras_record_box_ends_its_recording_there(service):
    """The camera's recording holds what came while Record was ticked: frames captioned after the
    box was unticked (and before the download) are not in it."""
    import av

    rgb = np.asarray(Image.open(SAMPLES_DIR / "scene.png").convert("RGB"))
    task = make_task("short")
    try:
        feed = service.push_frame("tab-untick", rgb, task, record=True)
        recorder = service.live._recorders["tab-untick", "push"]
        wait_for(lambda: service.push_frame("tab-untick", rgb, task, record=True) and recorder.written >= 2)
        service.push_frame("tab-untick", rgb, task, record=False)  # unticked: the file is finished now
        written, done = recorder.written, feed.snapshot().counters["completed"]
        wait_for(lambda: service.push_frame("tab-untick", rgb, task, record=False)
                 and feed.snapshot().counters["completed"] >= done + 3)
        assert recorder.written == written
        with av.open(str(service.recording("tab-untick", "push"))) as c:
            assert sum(1 for _ in c.decode(video=0)) == written
    finally:
        service.close_session("tab-untick")


def test_a_tab_closed_last_stays_closed_when_the_oldest_are_forgotten(service, monkeypatch):
    """Closed tabs are remembered up to CLOSED_KEPT, the oldest forgotten first: the ones closed
    last are those whose late camera frames still come, and must not start a feed for nobody."""
    import app.feed_gate

    monkeypatch.setattr(app.feed_gate, "CLOSED_KEPT", 2)
    grey = np.full((64, 64, 3), 128, np.uint8)
    for tab in ("gone-1", "gone-2", "gone-3"):
        service.close_session(tab)
    for tab in ("gone-2", "gone-3"):
        with pytest.raises(UIError, match="closed"):
            service.push_frame(tab, grey, make_task("short"))
    assert "gone-1" not in service.live._gate._closed and service.feed("gone-3", "push") is None


def test_several_questions_in_every_tab(service, tmp_path):
    questions = "How many shapes are there?\nIs there a star?"
    rgb = np.asarray(Image.open(SAMPLES_DIR / "scene.png").convert("RGB"))
    alone = [service.caption_image(rgb, make_task("question", q))["text"] for q in questions.splitlines()]
    both = service.caption_image(rgb, make_task("question", questions))
    assert [a["text"] for a in both["answers"]] == alone
    assert [a["asked"] for a in both["answers"]] == [{"question": q} for q in questions.splitlines()]
    # the page shows what the model was asked: a reworded question, or a caption for "what do you see"
    assert service.caption_image(rgb, make_task("question", "is there a star"))["asked"] == {
        "question": "Is there a star?"}
    seen = service.caption_image(rgb, make_task("question", "What do you see?"))
    assert seen["asked"] == {"caption": "normal"}
    assert seen["text"] == service.caption_image(rgb, make_task("normal"))["text"]
    assert "asked" not in service.caption_image(rgb, make_task("short"))
    assert both["text"].splitlines() == [f"{q}: {a}" for q, a in zip(questions.splitlines(), alone)]
    feed = service.start_live("tab-q", "cuts_640x360_30fps.mp4", make_task("question", questions))
    try:
        snap = wait_for(lambda: (s := feed.snapshot()).counters["completed"] >= 2 and s)
        assert [line.split(": ")[0] for line in snap.text.splitlines()] == questions.splitlines()
    finally:
        service.stop_live("tab-q")
    rows = [json.loads(line) for line in service.export_log("tab-q").read_text().splitlines()]
    assert len(rows) == 2 * feed.snapshot().counters["completed"]
    assert [r["question"] for r in rows[:2]] == questions.splitlines() and rows[0]["index"] == rows[1]["index"]
    service.close_session("tab-q")
    seen = []
    out = service.caption_video(str(SAMPLES_DIR / "cuts_640x360_30fps.mp4"), make_task("question", questions),
                                tmp_path / "job", every_n=120, on_progress=lambda done, total: seen.append(done))
    assert len(out["rows"]) == 2 * out["frames"] and out["rows"][0]["text"].startswith("How many shapes are there?: ")
    # the progress counts frames, not answers: two questions a frame do not bring it to its end twice as fast
    assert seen == sorted(seen) and seen[-1] == 120 * out["frames"]
    lines = [json.loads(line) for line in Path(out["paths"]["jsonl"]).read_text().splitlines()]
    assert [r["question"] for r in lines[:2]] == questions.splitlines()
    # each question with a constraint of its own: each answer keeps to its own
    own = service.caption_image(rgb, make_task("question", "How many shapes are there? /[0-9]/\n"
                                                           "Is there a star? [no way, of course]"))
    count, star = [a["text"] for a in own["answers"]]
    assert count in list("0123456789") and star in ("no way", "of course")
    assert [a["question"] for a in own["answers"]] == questions.splitlines()


def test_browser_camera_frames_are_pushed_and_the_latest_wins(service):
    rgb = np.asarray(Image.open(SAMPLES_DIR / "scene.png").convert("RGB"))
    feed = None
    for _ in range(40):  # faster than the engine: some are dropped at intake, never queued up
        feed = service.push_frame("tab-c", rgb, make_task("short"))
    snap = wait_for(lambda: (s := feed.snapshot()).counters["completed"] >= 1 and s)
    assert snap.counters["dropped"] > 0 and snap.counters["submitted"] <= 40
    assert snap.text == service.caption_image(rgb, make_task("short"))["text"]
    assert service.push_frame("tab-c", rgb, make_task("normal")) is not feed  # a new prompt, a new feed
    service.close_session("tab-c")


def test_a_silent_camera_gives_its_share_of_the_frames_in_flight_back(service):
    """A browser camera that stopped sending (its Stop, the page back on Live) had kept its share
    of the frames in flight until its tab closed: the viewer beside it ran on 2 of the 4."""
    from app.inflight_share import CAMERA_SILENT_S
    from pipelines.live import DEFAULT_MAX_INFLIGHT

    rgb = np.asarray(Image.open(SAMPLES_DIR / "scene.png").convert("RGB"))
    a = service.start_live("tab-share", "shapes_640x360_60fps.mp4", make_task("short"))
    try:
        cam = service.push_frame("tab-cam", rgb, make_task("short"))
        assert [f.snapshot().counters["max_inflight"] for f in (a, cam)] == [DEFAULT_MAX_INFLIGHT // 2] * 2
        cam.pushed_at -= 2 * CAMERA_SILENT_S  # as if its last frame came that long ago
        service.live.camera_silent("tab-cam")  # what the page's timer calls once it says so
        assert a.snapshot().counters["max_inflight"] == DEFAULT_MAX_INFLIGHT
        assert service.push_frame("tab-cam", rgb, make_task("short")) is cam  # it streams again
        assert [f.snapshot().counters["max_inflight"] for f in (a, cam)] == [DEFAULT_MAX_INFLIGHT // 2] * 2
    finally:
        service.close_session("tab-cam")
        service.close_session("tab-share")


def test_a_server_plays_at_most_its_max_feeds_at_once():
    """Every page or API client that pressed Start opened its source on threads of its own and
    took frames in flight from every viewer: without a bound, enough of them left none live. Past
    `max_feeds` a Start (or a camera's first frame) is refused in one line; a page's new Start
    replaces its own feed, and a camera that stopped sending holds no place."""
    from app.inflight_share import CAMERA_SILENT_S

    rgb = np.asarray(Image.open(SAMPLES_DIR / "scene.png").convert("RGB"))
    s = Service(Settings(max_tokens=4), max_feeds=2)
    try:
        a = s.start_live("tab-1", "shapes_640x360_60fps.mp4", make_task("short"))
        cam = s.push_frame("tab-cam", rgb, make_task("short"))
        with pytest.raises(UIError, match=r"^this server plays 2 live feeds, its limit \(vlmstream ui "
                                          r"--max-feeds 2\): try again when one stops$"):
            s.start_live("tab-2", "cuts_640x360_30fps.mp4", make_task("short"))
        assert s.feed("tab-2") is None and a.running
        with pytest.raises(UIError, match="--max-feeds 2"):
            s.push_frame("tab-cam2", rgb, make_task("short"))
        again = s.start_live("tab-1", "cuts_640x360_30fps.mp4", make_task("short"))  # its own, replaced
        assert again is not a and not a.running and again.running
        assert s.push_frame("tab-cam", rgb, make_task("normal")) is not cam  # a new prompt: replaced too
        s.feed("tab-cam", "push").pushed_at -= 2 * CAMERA_SILENT_S  # the camera stopped sending
        b = s.start_live("tab-2", "cuts_640x360_30fps.mp4", make_task("short"))
        assert b.running
        with pytest.raises(UIError, match="--max-feeds 2"):  # it sends again: no room for it now
            s.push_frame("tab-cam", rgb, make_task("normal"))
        s.stop_live("tab-2")
        assert s.push_frame("tab-cam", rgb, make_task("normal")).running
    finally:
        for sid in ("tab-1", "tab-2", "tab-cam", "tab-cam2"):
            s.close_session(sid)
        s.close()
        s.remove_outputs()


def test_the_activity_log_says_who_started_what_and_why_it_stopped(tmp_path):
    """An operator of a shared server could not tell afterwards who had played what, or why a
    feed had stopped: the server printed nothing of its feeds, jobs or Settings. A line each now,
    with the user (--auth-file) and the page; a URL's password never in it."""
    import logging
    import types

    from app import activity
    from app.page_events import PageEvents

    lines = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: lines.append(record.getMessage())
    activity.log.addHandler(handler)
    level = activity.log.level
    activity.log.setLevel(logging.INFO)  # with setLevel: the logger caches what its level allowed
    rgb = np.asarray(Image.open(SAMPLES_DIR / "scene.png").convert("RGB"))
    s = Service(Settings(max_tokens=4), max_feeds=1)
    try:
        activity.seen("logA1234-x", "alice")
        a = s.start_live("logA1234-x", "shapes_640x360_60fps.mp4", make_task("short"))
        wait_for(lambda: a.snapshot().counters["completed"] >= 3)
        with pytest.raises(UIError):
            s.start_live("logB1234-x", "cuts_640x360_30fps.mp4", make_task("short"))
        s.stop_live("logA1234-x", why="Stop")
        s.push_frame("logB1234-x", rgb, make_task("question", "Is there a star?"))
        s.close_session("logB1234-x")
        events = PageEvents(s, settings_by=frozenset({"alice"}))
        settings = events.settings
        with pytest.raises(Exception, match="only alice"):
            settings.apply("tiny", "cpu", 0.0, 4, True, request=types.SimpleNamespace(session_hash="logC", username="bob"))
        alice = types.SimpleNamespace(session_hash="logA1234-x", username="alice")
        settings.apply("tiny", "cpu", 0.5, 4, True, request=alice)
        events.video(str(SAMPLES_DIR / "cuts_640x360_30fps.mp4"), "short", "", 120, request=alice)
    finally:
        activity.log.removeHandler(handler)
        activity.log.setLevel(level)
        s.close()
        s.remove_outputs()
    assert len(lines) == 9, lines
    assert lines[0] == "alice (page logA1234) started a live feed: shapes_640x360_60fps.mp4, caption short"
    assert lines[1].startswith("page logB1234: Start refused: this server plays 1 live feed, its limit"), lines[1]
    m = re.fullmatch(r"alice \(page logA1234\) live feed stopped \(Stop\) after \d+\.\d s: (\d+) frames captioned, "
                     r"[\d.]+ fps, p50 \d+ ms", lines[2])
    assert m and int(m[1]) >= 3, lines[2]
    assert lines[3] == "page logB1234 started the browser camera: question 'Is there a star?'"
    assert re.fullmatch(r"page logB1234 camera stopped \(the tab closed\) after .*", lines[4]), lines[4]
    assert lines[5:8] == ["bob (page logC): Settings refused (--settings-by)",
                          "alice (page logA1234) applied Settings: temperature 0.0 -> 0.5 (settings applied)",
                          "alice (page logA1234) video job: cuts_640x360_30fps.mp4, caption short, one frame in 120"]
    assert re.fullmatch(r"alice \(page logA1234\) video job done: cuts_640x360_30fps.mp4, 4 frames in [\d.]+ s "
                        r"\([\d.]+x real time\)", lines[8]), lines[8]
    assert activity.source_text("rtsp://user:secret@cam.local:554/live?token=abc") == \
        "rtsp://***@cam.local:554/live?token=***"


def test_a_listed_camera_plays_by_its_name_and_its_password_never_reaches_the_page(tmp_path):
    """`ui --sources cams.txt`: a team's cameras set up once. Each viewer had typed the camera's URL,
    its password in it, and every page's Export and frames named it; now a page chooses "Front
    door" and sees that name alone."""
    import types

    from app.page_events import PageEvents
    from app.source_list import read_sources
    from rtsp_camera import RtspCamera

    with RtspCamera(password="s3cret") as cam:
        listed = tmp_path / "cams.txt"
        listed.write_text(f"# the team's cameras\nFront door = rtsp://admin:s3cret@127.0.0.1:{cam.port}/cam\n")
        s = Service(Settings(max_tokens=4), sources=read_sources(str(listed)))
        request = types.SimpleNamespace(session_hash="tab-listed", username=None)
        try:
            updates = PageEvents(s).live("Front door", None, "short", "", "none", "", False, request)
            shown = [next(updates)]
            feed = s.feed("tab-listed")
            wait_for(lambda: len(feed.records()) >= 3)
            shown += [next(updates) for _ in range(30)]
            assert {json.loads(r)["source"] for r in feed.records()} == {"Front door"}
            assert "s3cret" not in repr(shown) and "admin" not in repr(shown)
            updates.close()
            assert {json.loads(line)["source"] for line in s.export_log("tab-listed").read_text().splitlines()} \
                == {"Front door"}
        finally:
            s.close_session("tab-listed")
            s.close()
            s.remove_outputs()


def test_with_listed_only_a_page_plays_no_path_or_url_of_its_own():
    """`ui --sources cams.txt --listed-only`: a page on a shared server could play any file or URL
    the server reaches (a path on its disk, a host of its network); now only the listed sources,
    the samples and the page's own uploads."""
    import types

    from app.page_events import PageEvents
    from app.source_list import SourceList

    s = Service(Settings(max_tokens=4), sources=SourceList({"Lobby": str(SAMPLES_DIR / "cuts_640x360_30fps.mp4"),
                                                            "Gone": "/srv/cams/gone.mp4"}, only=True))
    request = types.SimpleNamespace(session_hash="tab-only", username=None)
    try:
        for typed in ("/etc/hosts", "rtsp://10.0.0.9/stream", "webcam:0"):
            frame, counters, *_ = next(PageEvents(s).live(typed, None, "short", "", "none", "", False, request))
            assert "this server plays only its listed sources (Lobby, Gone) and the samples, or an uploaded file" in frame
            assert s.feed("tab-only") is None
        frame, *_ = next(PageEvents(s).live("Gone", None, "short", "", "none", "", False, request))
        assert "no such file: Gone" in frame and "/srv/cams" not in frame  # the server's path not the page's to see
        for choice in ("Lobby", "shapes_640x360_60fps.mp4"):
            updates = PageEvents(s).live(choice, None, "short", "", "none", "", False, request)
            next(updates)
            assert s.feed("tab-only").running
            updates.close()
        from app.ui import build  # the page's source list: the names and samples, nothing to type in

        picker = next(b for b in build(s, "Lobby").blocks.values()
                      if type(b).__name__ == "Dropdown" and (b.label or "").startswith("Source"))
        assert [c[0] for c in picker.choices] == ["Lobby", "Gone", *sample_videos()] and not picker.allow_custom_value
    finally:
        s.close_session("tab-only")
        s.close()
        s.remove_outputs()


def test_a_new_feed_of_a_slow_model_starts_one_frame_at_a_time(service, monkeypatch):
    """With 4 frames in flight a slow model's first answer came ~4x late (they shared the
    machine). The server's first feed asks one frame until its first answer says how long they
    take (the tiny model's: fast, its frames back at once); a feed opened beside others starts
    from the answer time they saw."""
    import pipelines.live

    started = []  # each session's one_at_a_time when made, before its first frame is offered
    made = pipelines.live.LiveSession.__init__

    def init(self, *a, **k):
        made(self, *a, **k)
        started.append(self.one_at_a_time)

    monkeypatch.setattr(pipelines.live.LiveSession, "__init__", init)
    # "Slow" from 10 s here: the tiny model's answer (~10 ms) is timed by the engine from submit,
    # queue included, and on a busy 2-core CI a stall of a second would keep a's feed (and b) one
    # at a time; what is asserted is the choice each feed makes, not the machine's speed
    monkeypatch.setattr(pipelines.live, "SLOW_ANSWER_S", 10.0)
    rgb = np.asarray(Image.open(SAMPLES_DIR / "scene.png").convert("RGB"))
    try:
        a = service.push_frame("tab-slow", rgb, make_task("short"))  # one frame: then no answer comes
        wait_for(lambda: a.session.last_answer_s is not None)
        assert started == [True]  # from its start: no answer time was known
        assert not a.session.one_at_a_time  # its first answer was fast
        b = service.push_frame("tab-slow-cam", rgb, make_task("short"))
        assert started[-1] is False and not b.session.one_at_a_time  # a's answer was fast
        a.session.last_answer_s = 12.0  # as Moondream 2 on two CPU cores answers: over the 10 s
        service.push_frame("tab-slow-cam2", rgb, make_task("short"))
        assert started == [True, False, True]  # (its own fast answer may have given its frames back since)
    finally:
        for tab in ("tab-slow-cam", "tab-slow-cam2", "tab-slow"):
            service.close_session(tab)


def test_a_cameras_export_goes_on_across_a_new_prompt(service):
    """The camera's stream goes on when its prompt changes, but its Export held the new prompt's
    answers alone: the earlier ones were gone from the page's one download."""
    rgb = np.asarray(Image.open(SAMPLES_DIR / "scene.png").convert("RGB"))
    for task, kind in ((make_task("short"), "caption"), (make_task("question", "Is there a star?"), "question")):
        wait_for(lambda: (service.push_frame("tab-camera-export", rgb, task).records()
                          and any(kind in json.loads(line) for line in service.export_log("tab-camera-export", "push")
                                  .read_text().splitlines())))
    lines = [json.loads(line) for line in service.export_log("tab-camera-export", "push").read_text().splitlines()]
    kinds = ["caption" if "caption" in x else "question" for x in lines]
    assert kinds == sorted(kinds) and set(kinds) == {"caption", "question"}  # the first prompt's, then the next's
    service.close_session("tab-camera-export")


def test_bad_sources_are_one_line_errors(service, tmp_path, monkeypatch):
    import pipelines.stream

    monkeypatch.setattr(pipelines.stream, "STREAM_MAX_WAIT_S", 3.0)  # the stream below gives up sooner
    junk = tmp_path / "junk.mp4"
    junk.write_bytes(b"not a video at all" * 100)
    for source, kind in [("", UIError), (str(tmp_path / "missing.mp4"), UIError), (str(junk), VlmstreamError),
                         ("ftp://example.com/x", VlmstreamError), ("s" * 5000, UIError)]:
        with pytest.raises(kind) as e:
            service.start_live("tab-d", source, make_task("short"))
        # one line, and short: a name past the file system's limit was its [Errno 36] and all 5000 letters
        assert "\n" not in str(e.value) and str(e.value) and len(str(e.value)) < 200
    # an unreachable stream fails in the feed, which reports it instead of dying silently
    feed = service.start_live("tab-d", "udp://127.0.0.1:9?timeout=300000", make_task("short"))
    # meanwhile the frame's place says it is still trying, for how long, and why the last try failed
    trying = wait_for(lambda: (s := feed.snapshot()).counters["stream"].get("reason") and s, timeout=30)
    assert re.search(r">connecting \(\d+ s\); the last try: [^<]+<", frame_html(trying))
    snap = wait_for(lambda: (s := feed.snapshot()).error and s, timeout=90)
    assert not snap.running and "\n" not in snap.error
    health = snap.counters["stream"]  # the page's "stream" cell: how the network source is doing
    assert health["state"] == "failed" and health["outages"] == 0
    assert 'data-name="connection"><b>failed<' in counters_html(snap.counters, service.engine_stats(), False)
    service.close_session("tab-d")


def test_video_job_writes_every_output_and_reports_progress(service, tmp_path):
    seen = []
    out = service.caption_video(str(SAMPLES_DIR / "cuts_640x360_30fps.mp4"), make_task("short"), tmp_path / "job",
                                every_n=15, on_progress=lambda done, total: seen.append((done, total)))
    n = len(out["rows"])
    assert n >= 10 and out["frames"] == n and [r["index"] for r in out["rows"]] == list(range(0, 15 * n, 15))
    assert seen[-1][0] >= seen[0][0] and seen[-1][1] >= 15 * (n - 1)
    paths = {k: Path(v) for k, v in out["paths"].items()}
    rows = [json.loads(line) for line in paths["jsonl"].read_text().splitlines()]
    assert [r["text"].strip() for r in rows] == [r["text"] for r in out["rows"]]
    assert paths["srt"].read_text().startswith("1\n00:00:00,000 --> ")
    assert paths["vtt"].read_text().startswith("WEBVTT")
    import av

    with av.open(str(paths["mp4"])) as c:
        assert sum(1 for _ in c.decode(video=0)) == n
    with pytest.raises(VlmstreamError):
        service.caption_video(str(tmp_path / "job" / "captions.srt"), make_task("short"), tmp_path / "bad")


def test_a_video_job_can_keep_only_the_answers_that_change(service, tmp_path):
    clip, task = str(SAMPLES_DIR / "cuts_640x360_30fps.mp4"), make_task("question", "How many shapes are there?")
    full = service.caption_video(clip, task, tmp_path / "all", every_n=15)
    seen = []
    events = service.caption_video(clip, task, tmp_path / "events", every_n=15, changes=True,
                                   on_progress=lambda done, total: seen.append(done))
    kept, last = [], None
    for r in full["rows"]:  # the changes of the full run, by the definition
        if r["text"] != last:
            kept.append((r["index"], r["text"] + ("" if last is None else f"  (was: {last})")))
        last = r["text"]
    assert [(r["index"], r["text"]) for r in events["rows"]] == kept and 2 <= len(kept) < len(full["rows"])
    lines = [json.loads(line) for line in Path(events["paths"]["jsonl"]).read_text().splitlines()]
    assert [(x["index"], x["previous"]) for x in lines] == [(i, None if j == 0 else kept[j - 1][1].split("  (was")[0])
                                                            for j, (i, _) in enumerate(kept)]
    assert events["frames"] == full["frames"] and seen[-1] == seen[-1] // 15 * 15 >= 15 * (full["frames"] - 1)
    # the other downloads are those of a full run
    assert Path(events["paths"]["srt"]).read_text() == Path(full["paths"]["srt"]).read_text()


def test_a_video_job_stops_on_cancel_or_when_its_tab_closes_and_keeps_what_is_done(service, tmp_path):

    clip = str(SAMPLES_DIR / "cuts_640x360_30fps.mp4")
    seen = []

    def on_progress(done, total):
        seen.append(done)
        if len(seen) == 5:
            assert service.jobs.cancel("tab-v")

    out = service.caption_video(clip, make_task("short"), tmp_path / "job", every_n=2, on_progress=on_progress,
                                stop=service.jobs.stop_flag("tab-v"))
    assert out["cancelled"] and 5 <= out["frames"] < 240 and len(out["rows"]) == out["frames"]
    lines = Path(out["paths"]["jsonl"]).read_text().splitlines()
    assert [json.loads(line)["index"] for line in lines] == [r["index"] for r in out["rows"]]
    assert Path(out["paths"]["srt"]).read_text().startswith("1\n")
    # the annotated copy ends where the subtitles do, a frame's time (2 of 30 fps) after the last
    # frame done: it had lasted to where decoding had read ahead to
    with av.open(out["paths"]["mp4"]) as c:
        assert c.duration / 1_000_000 == pytest.approx(out["rows"][-1]["pts"] + 2 / 30, abs=0.005)
    assert not service.jobs.cancel("tab-v")  # nothing running any more
    # a tab that closes stops its job
    started, result = threading.Event(), {}
    job = threading.Thread(target=lambda: result.update(service.caption_video(
        clip, make_task("short"), tmp_path / "job2", on_progress=lambda d, t: started.set(),
        stop=service.jobs.stop_flag("tab-w"))))
    job.start()
    assert started.wait(60)
    service.close_session("tab-w")
    job.join(60)
    assert not job.is_alive() and result["cancelled"] and result["frames"] < 480


def test_cancel_stops_every_video_job_of_its_session_not_only_the_newest(service, tmp_path):

    clip = str(SAMPLES_DIR / "cuts_640x360_30fps.mp4")
    started = [threading.Event() for _ in range(3)]
    results: list[dict] = [{}, {}, {}]

    def job(i: int, session: str) -> threading.Thread:
        t = threading.Thread(target=lambda: results[i].update(service.caption_video(
            clip, make_task("short"), tmp_path / f"job{i}", on_progress=lambda d, n: started[i].set(),
            stop=service.jobs.stop_flag(session))))
        t.start()
        return t

    jobs = [job(0, "tab-x"), job(1, "tab-x"), job(2, "tab-y")]  # two in one tab (or API client), one elsewhere
    assert all(e.wait(60) for e in started)
    assert service.jobs.cancel("tab-x") == 2
    for t in jobs[:2]:
        t.join(60)
        assert not t.is_alive()
    assert results[0]["cancelled"] and results[1]["cancelled"]
    assert jobs[2].is_alive() or not results[2]["cancelled"]  # the other tab's job goes on
    assert service.jobs.cancel("tab-y") in (0, 1)
    jobs[2].join(60)
    assert not jobs[2].is_alive() and service.jobs.cancel("tab-y") == 0
    with pytest.raises(UIError):  # a job refused at once leaves no stop flag behind
        service.caption_video(clip, make_task("short"), tmp_path / "bad", every_n=0, stop=service.jobs.stop_flag("tab-z"))
    assert service.jobs.cancel("tab-z") == 0


def test_video_job_outputs_are_bounded_and_removed_when_the_server_stops():
    from app.video_jobs import VIDEO_JOBS_KEPT

    s = Service()
    jobs = []
    for i in range(VIDEO_JOBS_KEPT + 3):
        jobs.append(s.jobs.new_folder())
        (jobs[-1] / "captions.jsonl").write_text(str(i))
    assert len(set(jobs)) == len(jobs)
    assert [j.exists() for j in jobs] == [False] * 3 + [True] * VIDEO_JOBS_KEPT
    assert (jobs[-1] / "captions.jsonl").read_text() == str(len(jobs) - 1)
    s.close()  # a settings change closes the engine but keeps the results on the page downloadable
    assert jobs[-1].exists()
    s.remove_outputs()
    assert not jobs[-1].parent.exists()
    assert s.jobs.new_folder().exists()  # usable again (a new scratch folder)
    s.remove_outputs()


def test_other_viewers_exports_never_remove_a_running_video_jobs_folder(service):
    """Each export takes a job folder and the oldest beyond VIDEO_JOBS_KEPT go; a long video job
    must still find its folder when it writes its last frames."""
    import av

    from app.video_jobs import VIDEO_JOBS_KEPT

    job = service.jobs.new_folder()
    others = []

    def on_progress(done, total):
        if not others:  # while the job runs, more exports than the folders kept
            others.extend(service.jobs.new_folder() for _ in range(VIDEO_JOBS_KEPT + 2))
            assert job.exists() and not others[0].exists()

    out = service.caption_video(str(SAMPLES_DIR / "cuts_640x360_30fps.mp4"), make_task("short"), job, every_n=16,
                                on_progress=on_progress)
    assert out["frames"] == 30 and not out["cancelled"]
    with av.open(out["paths"]["mp4"]) as c:
        assert sum(1 for _ in c.decode(video=0)) == 30
    service.jobs.new_folder()  # done: now it is the oldest, and goes like any other
    assert not job.exists()


def test_video_jobs_read_their_file_as_the_server_reads(small_folder, tmp_path, monkeypatch):
    """`ui --no-deinterlace --no-tonemap` (a film flagged interlaced, SDR tagged HDR) holds for
    the Video file tab's jobs, captions and detect alike, as for its live feeds."""
    import pipelines.sources
    from pipelines.frame import Reading
    from pipelines.sources import FileSource

    read = []

    class Recorded(FileSource):
        def __init__(self, path, *args, **kwargs):
            read.append(kwargs.get("reading"))
            super().__init__(path, *args, **kwargs)

    monkeypatch.setattr(pipelines.sources, "FileSource", Recorded)
    as_stored = Reading(deinterlace=False, tonemap=False)
    s = Service(Settings(model=str(small_folder), max_tokens=2, dtype="float32"), reading=as_stored)
    try:
        clip = str(SAMPLES_DIR / "cuts_640x360_30fps.mp4")
        s.caption_video(clip, make_task("short"), tmp_path / "captions", every_n=240)
        s.caption_video(clip, {"detect": "star"}, tmp_path / "places", every_n=240)
    finally:
        s.close()
        s.remove_outputs()
    decoded = [r for r in read if r is not None]  # (the probe of its fields reads no frame)
    assert decoded == [as_stored, as_stored], read


def test_a_video_job_cut_short_by_a_model_reload_says_so_and_hands_over_what_it_did(tmp_path):
    """Another page's Settings reload the model mid-job: the job says so, and its downloads hold
    the frames done (it had been an error, those frames, written and closed, never handed over)."""
    s = Service(Settings(max_tokens=12, dtype="float32"))
    try:
        started, result = threading.Event(), {}

        def job():
            result.update(s.caption_video(str(SAMPLES_DIR / "cuts_640x360_30fps.mp4"), make_task("short"),
                                          tmp_path / "job", on_progress=lambda done, total: started.set()))

        thread = threading.Thread(target=job)
        thread.start()
        assert started.wait(60)
        assert s.apply(Settings(max_tokens=12, dtype="bfloat16")) == "engine reloaded"  # another viewer, Settings
        thread.join(60)
        assert result["cancelled"] and 1 <= result["frames"] < 480
        # how far it got (a frame was done before the reload: its progress came first)
        assert result["warnings"] == [f"the engine was reloaded (Settings) after {result['frames']} frames: run the "
                                      "job again for the rest"]
        lines = Path(result["paths"]["jsonl"]).read_text().splitlines()
        assert [json.loads(line)["index"] for line in lines] == [r["index"] for r in result["rows"]]
        assert len(lines) == result["frames"] and Path(result["paths"]["srt"]).read_text().startswith("1\n")
    finally:
        s.close()
        s.remove_outputs()


def test_a_storm_of_viewers_leaves_nothing_running(tmp_path):
    """Three viewers at once, each doing what a page can, at random (seeded), for a few seconds:
    Start and Stop, camera frames of changing sizes and prompts, exports, recordings, video jobs
    and their Cancel, settings, tabs closing. Every call ends with its answer or a UIError, and
    once the tabs are closed no feed runs and every KV page is free. (Longer storms of this kind
    found the double Start, the tab closed during a Start and the video folder removed under a
    job.)"""
    import random

    s = Service(Settings(max_tokens=8))
    tasks = [make_task("short"), make_task("question", "How many shapes are there?", "choices", "one,two,three,four")]
    frames = [np.random.default_rng(i).integers(0, 255, (120 + 40 * i, 160 + 60 * i, 3), dtype=np.uint8)
              for i in range(3)]
    clip = str(SAMPLES_DIR / "cuts_640x360_30fps.mp4")
    failures: list[str] = []
    stop = threading.Event()
    # A closed tab's id never comes back (its page reloads as a new session): each close gives
    # its slot a fresh id, and every id used is closed at the end.
    tabs, used, reloads = ["tab-1", "tab-2"], {"tab-1", "tab-2"}, itertools.count()

    def close(t: str) -> None:
        s.close_session(t)
        with contextlib.suppress(ValueError):  # another viewer closed it first
            new = f"tab-{next(reloads) + 3}"
            used.add(new)
            tabs[tabs.index(t)] = new

    def viewer(seed: int) -> None:
        rng = random.Random(seed)
        calls = [
            lambda t: s.start_live(t, rng.choice(sample_videos()), rng.choice(tasks), record=rng.random() < 0.3),
            lambda t: s.stop_live(t, rng.choice(["pull", "push"])),
            lambda t: s.push_frame(t, rng.choice(frames), rng.choice(tasks), record=rng.random() < 0.2),
            lambda t: s.push_frame(t, rng.choice(frames), rng.choice(tasks)),
            lambda t: s.export_log(t, rng.choice(["pull", "push"])),
            lambda t: s.export_shots(t, rng.choice(["pull", "push"])),
            lambda t: s.recording(t, rng.choice(["pull", "push"])),
            close,
            lambda t: s.apply(Settings(max_tokens=8, pipelined=rng.random() < 0.7, sticky=rng.choice([0.0, 2.0]))),
            lambda t: s.caption_video(clip, rng.choice(tasks), s.jobs.new_folder(), every_n=24, stop=s.jobs.stop_flag(t)),
            lambda t: s.jobs.cancel(t),
        ]
        while not stop.is_set():
            try:
                rng.choice(calls)(rng.choice(tabs))
            except UIError:
                pass
            except Exception as e:  # noqa: BLE001 - any other is the failure this test looks for
                failures.append(f"{type(e).__name__}: {e}")
            time.sleep(rng.random() * 0.03)

    before = threads_named("vlmstream-feed", "vlmstream-live")
    try:
        viewers = [threading.Thread(target=viewer, args=(seed,)) for seed in range(3)]
        for v in viewers:
            v.start()
        time.sleep(8.0)
        stop.set()
        for v in viewers:
            v.join(60)
        assert not any(v.is_alive() for v in viewers) and not failures, failures[:3]
        for tab in list(used):
            s.close_session(tab)
        wait_for(lambda: threads_named("vlmstream-feed", "vlmstream-live") <= before, timeout=15)
        wait_for(lambda: s.engine().stats().kv_pages_in_use == 0, timeout=15)
    finally:
        stop.set()
        s.close()
        s.remove_outputs()

def test_settings_switch_blocking_and_reject_a_bad_model(service, tmp_path):
    service.engine()
    assert service.apply(Settings(max_tokens=12, pipelined=False)) == "settings applied"
    assert service.engine_stats()["mode"] == "blocking"
    rgb = np.zeros((120, 160, 3), np.uint8)
    blocking = service.caption_image(rgb, make_task("short"))["text"]
    service.apply(Settings(max_tokens=12, pipelined=True))
    assert service.caption_image(rgb, make_task("short"))["text"] == blocking  # same tokens either way
    engine = service.engine()
    feed = service.start_live("tab-set", "shapes_640x360_60fps.mp4", make_task("short"))
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    for model, device in ((str(tmp_path / "nope"), "cpu"), (str(broken), "cpu"), ("tiny", "tpu")):
        with pytest.raises(VlmstreamError):
            service.apply(Settings(model=model, device=device, max_tokens=12))
    # said before anything stopped: it closed the engine, and every tab's feeds and video jobs
    assert service.settings.model == "tiny" and service.engine() is engine
    assert service.feed("tab-set") is feed and feed.running
    # a setting that needs no reload reaches the feed that runs (it had waited for a new Start)
    wait_for(lambda: feed.snapshot().counters["completed"] >= 1)
    service.apply(Settings(max_tokens=2, sticky=0.0))
    n = feed.snapshot().counters["completed"]
    wait_for(lambda: feed.snapshot().counters["completed"] >= n + 6)
    assert all(len(json.loads(line)["token_ids"]) <= 2 for line in feed.records()[-3:])
    service.apply(Settings(max_tokens=12))
    service.close_session("tab-set")
    with pytest.raises(UIError):
        service.apply(Settings(max_tokens=0))
    for bad in (dict(max_tokens=float("nan")), dict(max_tokens=2.5), dict(max_tokens="ten"),
                dict(temperature="hot"), dict(temperature=float("inf")), dict(hold=None)):
        with pytest.raises(UIError):  # NaN max tokens was taken, and every caption failed after it
            service.apply(Settings(**{"max_tokens": 12, **bad}))
    with pytest.raises(UIError, match="steadiness"):
        service.apply(Settings(max_tokens=12, sticky=-1.0))
    with pytest.raises(UIError, match="frames a change holds"):
        service.apply(Settings(max_tokens=12, hold=0))
    assert service.settings.hold == Settings.hold  # a refused change leaves the settings as they were
    # live answers are sticky by default; sampled ones cannot be
    assert service.params().sticky == Settings.sticky > 0
    service.apply(Settings(max_tokens=12, temperature=0.5))
    assert service.params().sticky == 0 and service.params().temperature == 0.5
    service.apply(Settings(max_tokens=12))


def test_the_caption_log_has_a_line_per_run_of_identical_answers():
    from collections import deque

    log = deque(maxlen=3)
    # the same things named in another order continue a run, which takes the newest wording
    answers = ["a red circle"] * 50 + ["a blue star"] + ["a red circle"] * 2 + ["two circles, a star"] * 2 \
        + ["a star and two circles"]
    for i, text in enumerate(answers):
        extend_log(log, 1000.0 + i / 60, i / 60, i, text, 20.0 + i)
    assert [(x.text, x.frames, x.index) for x in log] == [("a blue star", 1, 50), ("a red circle", 2, 52),
                                                          ("a star and two circles", 3, 55)]
    assert log[-1].first_pts == 53 / 60 and log[-1].end_to_end_ms == 75.0  # the run's start, its last latency
    newest, _, oldest = log_text(list(log)).splitlines()
    assert "a star and two circles  (3 frames to t=0.92s)" in newest and "t=   0.88s" in newest
    assert oldest.endswith("a blue star")  # one frame: no run


def test_views_render_what_the_snapshot_holds():
    pts = [LatencyPoint(100.0 + i, i, {"queue": 1.0, "vision": 5.0, "prefill": 3.0, "decode": 20.0 + i}, 30.0 + i)
           for i in range(300)]
    svg = chart_svg(pts, 30.0)

    bars = int(re.search(r'data-bars="(\d+)"', svg).group(1))
    assert 60 <= bars <= 120 and svg.count('class="vs-bar"') == 4 * bars  # thinned, every stage stacked
    assert "last 30 s" in svg
    assert 'data-bars="0"' in chart_svg([], 30.0)
    # a screen reader reads the chart as a picture with its numbers in words, not as its loose labels
    label = re.search(r'<svg [^>]*role="img" [^>]*aria-label="([^"]*)"', svg).group(1)
    assert label == ("latency per frame, the last 30 s (300 frames): end to end 329 ms for the newest "
                     "(queue 1, vision 5, prefill 3, decode 319), median 180 ms, highest 329 ms"), label
    assert re.search(r'<svg [^>]*role="img" [^>]*aria-label="latency per frame: no latency data yet"',
                     chart_svg([], 30.0))
    assert frame_html(None, "error: no such file").count("error: no such file") == 1
    html = counters_html({"completed": 7, "in_flight": 2, "cancelled_stale": 3, "dropped": 1, "rolling_fps": 59.5},
                         {"batch": 4, "tokens_per_s": 800.0, "device_busy_pct": 91.0, "vision_busy_pct": 47.5,
                          "kv_pages_in_use": 10,
                          "kv_pages_total": 700, "mode": "pipelined"}, True)
    for shown in ("59.5", ">7<", ">3<", "91.0 %", "47.5 %", "10 / 700", "pipelined"):
        assert shown in html
    assert 'data-name="connection"' not in html  # a file: no connection to report on
    # a slow model (Moondream 2 on a CPU, an answer every ~15 s): its rate, not "0.0"
    slow = counters_html({"completed": 4, "rolling_fps": 1 / 15}, {}, True)
    assert '<div class="vs-counter" data-name="fps"><b>0.067</b><span>fps: an answer every 15 s</span>' in slow
    assert 'data-name="fps"><b>0.0</b><span>fps</span>' in counters_html({"rolling_fps": 0.0}, {}, True)
    for health, shown in [({"state": "live", "late_s": 0.1, "outages": 0}, "live"),
                          ({"state": "live", "late_s": 1.34, "outages": 1}, "1.3 s behind, 1 outage"),
                          ({"state": "reconnecting", "for_s": 7.2, "outages": 2}, "reconnecting (7 s)"),
                          ({"state": "live", "late_s": 0.0, "outages": 2}, "live, 2 outages")]:
        cell = counters_html({"stream": health}, {}, True)
        assert f'data-name="connection"><b>{shown}</b>' in cell
    shots = [Shot(n, 1000.0 + n, n / 30, 3 * n, f"a <red> circle {n}", b"\xff\xd8jpeg") for n in (4, 5, 6)]
    gallery = shots_html(shots)
    assert 'data-count="3"' in gallery and 'data-newest="6"' in gallery
    assert [int(x) for x in re.findall(r'data-number="(\d+)"', gallery)] == [6, 5, 4]  # newest first
    assert "a &lt;red&gt; circle 6" in gallery and "<red>" not in gallery
    assert 'download="frame_18.jpg"' in gallery and gallery.count("data:image/jpeg;base64,/9hqcGVn") == 3  # each picture once
    assert 'data-count="0"' in shots_html([])
    # a page gets the pictures only when it lacks some, across the feeds it follows (a new prompt
    # on the webcam tab starts a new feed, whose changes count from 1 again)
    from app.page_values import new_shots

    sent, shown = new_shots(shots, None)
    assert sent == shots and shown == 1006.0
    assert new_shots(shots, shown) == (None, shown) and new_shots([], shown) == (None, shown)
    other = [Shot(6, 2000.0, 0.2, 6, "two stars", b"jpeg")]  # the same number in another feed
    assert new_shots(other, shown) == (other, 2000.0)



def test_importing_the_ui_loads_nothing_heavy():
    import subprocess
    import sys

    code = ("import sys, app.ui, app.service; "
            "print(sorted(m for m in ('torch', 'gradio', 'av', 'cv2') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout  # gradio and the engine load when the UI is built


def test_large_frames_are_scaled_down_for_the_page():
    import base64
    import io

    from PIL import Image

    from app.view import MAX_PAGE_WIDTH, jpeg_data_uri

    uri = jpeg_data_uri(np.zeros((1080, 1920, 3), np.uint8))
    img = Image.open(io.BytesIO(base64.b64decode(uri.split(",", 1)[1])))
    assert img.size == (MAX_PAGE_WIDTH, 540)
    small = Image.open(io.BytesIO(base64.b64decode(jpeg_data_uri(np.zeros((360, 640, 3), np.uint8)).split(",")[1])))
    assert small.size == (640, 360)


def test_ui_command_mistakes_are_one_line_before_the_model_loads(capsys):
    import socket

    from app.cli import main

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["ui", "--port", str(port), "--model", "/no/such/model"]) == 2
    with socket.socket() as probe:  # a free port: the default one may be taken on this machine
        probe.bind(("127.0.0.1", 0))
        free = str(probe.getsockname()[1])
    assert main(["ui", "--source", "/no/such/video.mp4", "--model", "/no/such/model", "--port", free]) == 2
    assert main(["ui", "--host", "no-such-host.invalid", "--model", "/no/such/model", "--port", free]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 3 and all(line.startswith("vlmstream: error: ") for line in lines), err
    assert "already in use" in lines[0] and "video not found" in lines[1] and "no-such-host.invalid" in lines[2]


def test_the_image_tab_detects_and_points_through_the_engines_model(small_folder, untrained):
    """Detect and point in the Image tab: the region decoder on the engine's own model gives the
    places the decoder alone gives, in pixels and drawn; the tiny model's untrained head is a
    clear error, not boxes at random."""
    from engine.errors import RequestError
    from engine.models.loader import load_model
    from engine.region_decoder import RegionDecoder

    rgb = np.random.default_rng(5).integers(0, 256, (90, 160, 3), dtype=np.uint8)
    with pytest.raises(RequestError, match="region head was not trained"):
        untrained.locate_image(rgb, "star")
    s = Service(Settings(model=str(small_folder), dtype="float32"))
    try:
        out = s.locate_image(rgb, " red circle ")
        want = RegionDecoder(load_model(str(small_folder), device="cpu", dtype="float32")).locate(rgb, "red circle")
        assert out["detect"] == "red circle" and out["objects"] == want["objects"]
        assert (out["width"], out["height"]) == (160, 90) and len(out["pixels"]) == len(want["objects"])
        if out["pixels"]:  # the last box's top edge (drawn last), in the overlay colour
            x0, y0, x1, _ = out["pixels"][-1]
            assert out["picture"][y0, (x0 + x1) // 2].tolist() == [255, 60, 200]
        points = s.locate_image(rgb, "star", "point")
        assert points["points"] == RegionDecoder(s.engine().loaded).locate(rgb, "star", "point")["points"]
        assert points["timings_ms"]["total"] > 0
    finally:
        s.close()
        s.remove_outputs()  # its scratch folder: none left in /tmp


def test_odd_inputs_from_a_page_are_one_line_errors_and_leave_nothing_behind(service, tmp_path):
    """What an audit of the page's callbacks found: conversions that escaped as TypeError or
    ValueError, a source name that is not text, a camera frame that is no picture (a cv2 error of
    several lines), a video job's stop flag left behind by a job that never started, and a
    camera frame after its page closed that started a feed nobody would close."""
    from app.ui import build

    demo = build(service)
    fn = {f.name: f.fn for f in demo.fns.values()}
    apply, video = fn["apply"], fn["video"]
    with pytest.raises(gr_error()) as e:
        apply("tiny", "cpu", "hot", 12, True)
    assert "temperature must be a number" in str(e.value)
    before = service.settings
    assert apply("tiny", "cpu", None, None, True, None, None) == "settings applied"  # empty boxes: as they were
    assert service.settings == before
    clip = str(SAMPLES_DIR / "cuts_640x360_30fps.mp4")
    for every, question in ((float("nan"), "x"), ("x", "x"), (2, "  ")):
        with pytest.raises(gr_error()):
            video(clip, "question", question, every)
    assert service.jobs._stops.get("api") is None
    # an upload that is no video is named by its name, not by Gradio's scratch path
    upload = tmp_path / "gradio" / "be5207d615" / "fake.mp4"
    upload.parent.mkdir(parents=True)
    upload.write_bytes(b"not a video" * 50)
    with pytest.raises(gr_error()) as e:
        video(str(upload), "short", "", 1)
    assert "fake.mp4 is not a readable video" in str(e.value) and "be5207d615" not in str(e.value)
    for source in ("/tmp/\ud800.mp4", "/tmp/a\x00b.mp4"):
        with pytest.raises(VlmstreamError):
            service.start_live("tab-odd", source, make_task("short"))
    for frame in (np.zeros((64, 64), np.float32), np.zeros((0, 0, 3), np.uint8), None):
        with pytest.raises(VlmstreamError):
            service.push_frame("tab-odd", frame, make_task("short"))
    grey = np.full((64, 64), 128, np.uint8)  # a grey frame is a picture
    assert service.push_frame("tab-odd", grey, make_task("short")) is service.feed("tab-odd", "push")
    service.close_session("tab-odd")
    with pytest.raises(UIError, match="closed"):
        service.push_frame("tab-odd", grey, make_task("short"))
    with pytest.raises(UIError, match="closed"):
        service.start_live("tab-odd", "shapes_640x360_60fps.mp4", make_task("short"))
    assert service.feed("tab-odd", "push") is None and ("tab-odd", "push") not in service.live._feeds
    with pytest.raises(UIError, match="no video given"):
        service.caption_video(None, make_task("short"), tmp_path / "job", stop=service.jobs.stop_flag("tab-v2"))
    with pytest.raises(UIError, match="whole number"):
        service.caption_video(clip, make_task("short"), tmp_path / "job", every_n=2.5, stop=service.jobs.stop_flag("tab-v2"))
    assert "tab-v2" not in service.jobs._stops


def gr_error():
    import gradio as gr

    return gr.Error


def test_the_detect_and_point_endpoints_return_the_places_drawn(small_folder, tmp_path, client_downloads):
    """/detect_image and /point_image (the Image tab's buttons): a line of places in pixels, the
    picture with them drawn, and the record, as a client gets them."""
    import socket

    from gradio_client import Client, handle_file

    from app.ui import build

    s = Service(Settings(model=str(small_folder), dtype="float32"))
    demo = build(s)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    try:
        demo.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True, ssr_mode=False)
        rgb = np.random.default_rng(6).integers(0, 256, (72, 128, 3), dtype=np.uint8)
        path = tmp_path / "frame.png"
        Image.fromarray(rgb).save(path)
        # httpx waits 5 s by default: a file download timed out once on a busy 2-core machine
        client = Client(f"http://127.0.0.1:{port}/", verbose=False, httpx_kwargs={"timeout": 60},
                        download_files=client_downloads)
        text, picture, record = client.predict(handle_file(str(path)), "red circle", api_name="/detect_image")
        want = s.locate_image(rgb, "red circle")
        assert record["objects"] == want["objects"] and record["pixels"] == want["pixels"]
        assert text.startswith("red circle: ") and text.count("(") == 2 * len(want["pixels"])
        drawn = np.asarray(Image.open(picture["value"] if isinstance(picture, dict) else picture).convert("RGB"))
        assert np.array_equal(drawn, want["picture"])  # PNG: the lines as drawn
        text, _, record = client.predict(handle_file(str(path)), "star", api_name="/point_image")
        assert record["points"] == s.locate_image(rgb, "star", "point")["points"] and text.startswith("star: ")
        # the Video file tab with the prompt detect: places, the JSONL and the MP4 with them drawn
        note, table, files, _ = client.predict(handle_file(str(SAMPLES_DIR / "cuts_640x360_30fps.mp4")), "detect",
                                               "red circle", 160, api_name="/caption_video")
        assert "3 frames located" in note and [r[0] for r in table["data"]] == [0, 160, 320]
        assert all(r[2].startswith("red circle: ") for r in table["data"])
        assert sorted(Path(f).name for f in files) == ["annotated.mp4", "places.jsonl", "places.srt", "places.vtt"]
    finally:
        demo.close()
        s.close()
        s.remove_outputs()  # its scratch folder: none left in /tmp


def test_the_live_tab_detects_an_object_in_each_newest_frame(small_folder, untrained, tmp_path):
    """Live tab, Detect: the region head on the newest frame at its own pace. The page's frame is
    drawn with the boxes, the log and the change pictures follow the count found, the export holds
    each frame's places as the decoder gives them on that frame alone, and a recording has the
    boxes drawn; the tiny model's untrained head and an unnamed object are clear errors."""
    from engine.errors import RequestError
    from engine.models.loader import load_model
    from engine.region_decoder import RegionDecoder
    from pipelines.sources import FileSource

    assert make_task("detect", " red circle \n", regions=True) == {"detect": "red circle"}
    for kind, question, ckind in (("detect", "  ", "none"), ("point", "a\nb", "none"), ("detect", "a", "regex")):
        with pytest.raises(UIError):
            make_task(kind, question, ckind, "x", regions=True)
    with pytest.raises(UIError):
        make_task("detect", "star")  # the other tabs ask no region task
    sample = "shapes_640x360_60fps.mp4"
    with pytest.raises(RequestError, match="region head was not trained"):
        untrained.start_live("t", sample, {"detect": "star"})
    assert untrained.feed("t") is None
    s = Service(Settings(model=str(small_folder), dtype="float32"))
    try:
        feed = s.start_live("a", sample, {"detect": "red circle"}, record=True)
        wait_for(lambda: feed.snapshot().counters.get("completed", 0) >= 4)
        snap = feed.snapshot()
        assert snap.running and snap.error is None and snap.text.startswith("red circle: ")
        assert snap.counters["rolling_fps"] > 0 and snap.counters["latency_ms"]["end_to_end"]["p50"] > 0
        assert snap.log and snap.log[-1].text == snap.text and snap.shots[0].text.startswith("red circle: ")
        assert snap.latency[-1].stages_ms["decode"] > 0
        rows = [json.loads(x) for x in feed.records()]
        assert len(rows) >= 4 and all(r["detect"] == "red circle" for r in rows)
        decoder = RegionDecoder(load_model(str(small_folder), device="cpu", dtype="float32"))
        wanted = {r["index"] for r in rows[:2]}
        frames = {f.index: f.rgb for f in FileSource(SAMPLES_DIR / sample).frames(pick=lambda i, _: i in wanted)}
        for r in rows[:2]:
            want = decoder.locate(frames[r["index"]], "red circle")["objects"]
            assert r["objects"] == [{k: round(v, 4) for k, v in o.items()} for o in want]
            assert (r["width"], r["height"]) == (640, 360) and len(r["pixels"]) == len(want)
        shown = next(r for r in rows if r["index"] == snap.index)  # the records were read after the snapshot
        if shown["pixels"]:  # the page's frame has its boxes drawn (the last one on top)
            x0, y0, x1, _ = shown["pixels"][-1]
            assert snap.frame_rgb[y0, (x0 + x1) // 2].tolist() == [255, 60, 200]
        exported = s.export_log("a").read_text().splitlines()
        assert [json.loads(x)["index"] for x in exported[:4]] == [r["index"] for r in rows[:4]]
        s.stop_live("a")
        assert not feed.running
        import av

        with av.open(str(s.recording("a"))) as c:
            assert sum(1 for _ in c.decode(video=0)) >= 4
        point = s.start_live("a", sample, {"point": "star"})
        wait_for(lambda: point.records())
        assert "points" in json.loads(point.records()[0]) and point.snapshot().text.startswith("star: ")
        # the browser's camera: pushed frames, the newest located when the decoder is ready
        rgb = np.random.default_rng(7).integers(0, 256, (90, 160, 3), dtype=np.uint8)
        cam = s.push_frame("a", rgb, {"point": "star"})

        def located():  # the camera keeps sending until one of its frames is located
            cam.push(rgb)
            return cam.records()

        wait_for(located)
        row = json.loads(cam.records()[0])
        assert row["points"] == [{k: round(v, 4) for k, v in p.items()}
                                 for p in decoder.locate(rgb, "star", "point")["points"]]
        assert s.push_frame("a", rgb, {"point": "star"}) is cam  # the same prompt: the same feed
        s.stop_live("a", "push")
        assert not cam.running and not cam.push(rgb)
        with pytest.raises(RequestError, match="region head was not trained"):
            untrained.push_frame("t", rgb, {"detect": "star"})
    finally:
        s.close()
        s.remove_outputs()  # its scratch folder: none left in /tmp


def test_a_video_job_detects_an_object_in_every_nth_frame(small_folder, untrained, tmp_path):
    """Video file tab, Detect: every n-th frame's places as the decoder gives them on that frame
    alone, in the rows, the JSONL (the lines of `video --detect -o`) and drawn on the MP4; with
    the changes box, the frames where the count found changes; Cancel keeps what is done."""
    import av

    from engine.errors import RequestError
    from engine.models.loader import load_model
    from engine.region_decoder import RegionDecoder
    from pipelines.sources import FileSource

    clip = str(SAMPLES_DIR / "cuts_640x360_30fps.mp4")
    with pytest.raises(RequestError, match="region head was not trained"):
        untrained.caption_video(clip, {"detect": "star"}, tmp_path / "tiny")
    s = Service(Settings(model=str(small_folder), dtype="float32"))
    try:
        out = s.caption_video(clip, {"detect": "red circle"}, tmp_path / "all", every_n=40)
        assert out["frames"] == 12 and not out["cancelled"] and [r["index"] for r in out["rows"]] == list(range(0, 480, 40))
        lines = [json.loads(x) for x in Path(out["paths"]["jsonl"]).read_text().splitlines()]
        decoder = RegionDecoder(load_model(str(small_folder), device="cpu", dtype="float32"))
        frames = {f.index: f.rgb for f in FileSource(clip).frames(pick=lambda i, _: i in (0, 200))}
        for line in (lines[0], lines[5]):
            want = decoder.locate(frames[line["index"]], "red circle")["objects"]
            assert line["detect"] == "red circle" and line["objects"] == [
                {k: round(v, 4) for k, v in o.items()} for o in want]
        assert [r["text"] for r in out["rows"]] == [
            "red circle: " + (" ".join(f"({a},{b})-({c},{d})" for a, b, c, d in x["pixels"]) or "none found")
            for x in lines]
        with av.open(out["paths"]["mp4"]) as c:
            assert sum(1 for _ in c.decode(video=0)) == 12
        counts = [len(x["pixels"]) for x in lines]
        assert [x["batch"] for x in lines] == [4] * 12  # located LOCATE_BATCH frames a call
        # subtitles: a cue per run of frames with the same number found
        runs = [n for i, n in enumerate(counts) if i == 0 or n != counts[i - 1]]
        cues = Path(out["paths"]["srt"]).read_text().strip().split("\n\n")
        assert [c.splitlines()[2] for c in cues] == [f"red circle: {n} found" if n else "red circle: none found"
                                                    for n in runs]
        assert Path(out["paths"]["vtt"]).read_text().startswith("WEBVTT\n\n00:00:00.000 --> ")
        events = s.caption_video(clip, {"detect": "red circle"}, tmp_path / "events", every_n=40, changes=True)
        assert [r["index"] for r in events["rows"]] == [
            x["index"] for i, x in enumerate(lines) if i == 0 or counts[i] != counts[i - 1]]
        stop = threading.Event()
        cut = s.caption_video(clip, {"point": "star"}, tmp_path / "cut", every_n=40,
                              on_progress=lambda done, total: done > 100 and stop.set(), stop=stop)
        assert cut["cancelled"] and 0 < cut["frames"] < 12 and "points" in json.loads(
            Path(cut["paths"]["jsonl"]).read_text().splitlines()[0])
    finally:
        s.close()
        s.remove_outputs()  # its scratch folder: none left in /tmp


def test_a_reload_tells_each_page_why_its_feed_stopped_and_keeps_its_captions(small_folder):
    """Another viewer's Settings (a new model) ended every live page with no reason given, and
    its captions could no longer be exported."""
    s = Service(Settings(model=str(small_folder), max_tokens=4))
    try:
        feed = s.start_live("tab-r", "shapes_640x360_60fps.mp4", make_task("short"))
        wait_for(lambda: feed.snapshot().counters["completed"] >= 3)
        old = weakref.ref(s.engine())
        assert s.apply(Settings(model="tiny", max_tokens=4)) == "engine reloaded"
        gc.collect()
        assert old() is None  # the feed kept for Export does not keep the old engine (weights, KV pool)
        snap = feed.snapshot()
        assert not snap.running and "the engine was reloaded" in snap.error
        assert s.feed("tab-r") is None
        assert len(s.export_log("tab-r").read_text().splitlines()) >= 3
    finally:
        s.close()
        s.remove_outputs()


def test_a_cameras_recording_goes_on_across_a_reload_while_record_is_ticked(untrained_folder):
    """Another viewer's Settings (a new model): the camera's next frame started a feed on the new
    engine and its captions went on, but its recording had ended there, Record still ticked."""
    import av

    rgb = np.asarray(Image.open(SAMPLES_DIR / "scene.png").convert("RGB"))
    s = Service(Settings(max_tokens=4))
    try:
        def stream(until):  # the browser's camera, Record ticked, ten frames a second until `until` holds
            deadline = time.time() + 60
            while not until() and time.time() < deadline:
                s.push_frame("tab-c", rgb, make_task("short"), record=True)
                time.sleep(0.1)

        stream(lambda: ("tab-c", "push") in s.live._recorders and s.live._recorders[("tab-c", "push")].written >= 3)
        recorder = s.live._recorders[("tab-c", "push")]
        before = recorder.written
        assert s.apply(Settings(model=str(untrained_folder), max_tokens=4)) == "engine reloaded"
        stream(lambda: recorder.written >= before + 3)
        assert recorder.written >= before + 3 and s.live._recorders[("tab-c", "push")] is recorder
        with av.open(str(s.recording("tab-c", "push"))) as c:
            assert sum(1 for _ in c.decode(video=0)) == recorder.written
    finally:
        s.close()
        s.remove_outputs()


def test_record_ticked_without_start_records_no_autoplayed_sample():
    """"Record from Start": ticked, no Start pressed, the page gone to another tab and back, the
    sample it plays by itself had restarted with a recording."""
    import types

    from app import ui

    service = Service(Settings(max_tokens=4))
    try:
        handlers = {f.name: f.fn for f in ui.build(service).fns.values()}
        page = types.SimpleNamespace(session_hash="tab")
        form = ("shapes_640x360_60fps.mp4", None, "short", "", "none", "")
        updates = [handlers["autoplay"](*form, False, request=page)]  # kept open, as Gradio keeps them
        next(updates[-1])
        handlers["leave_live"](request=page)
        updates.append(handlers["back_to_live"](*form, True, request=page))  # Record ticked meanwhile
        next(updates[-1])
        feed = service.feed("tab")
        assert feed is not None and feed.running
        wait_for(lambda: feed.snapshot().counters["completed"] >= 2)
        with pytest.raises(UIError, match="nothing recorded: tick Record, then Start"):
            service.live.recording("tab")
        updates.append(handlers["live"](*form, True, request=page))  # a Start records
        next(updates[-1])
        wait_for(lambda: service.feed("tab").snapshot().counters["completed"] >= 2)
        assert service.live.recording("tab").stat().st_size > 0
        handlers["closed"](request=page)
    finally:
        service.close()
        service.remove_outputs()


def test_a_hold_applied_in_settings_reaches_the_running_camera():
    """The Changes hold applied in Settings had reached a browser's camera only at its next
    prompt: it has no Start to take it from. It counts from the camera's next answer."""
    frames = [np.asarray(Image.open(SAMPLES_DIR / "scene.png").convert("RGB")), np.zeros((120, 160, 3), np.uint8)]
    s = Service(Settings(max_tokens=12, sticky=0.0, hold=3))  # each frame's own answer
    try:
        def push(rgb, n):
            s.push_frame("tab-x", rgb, make_task("short"))
            wait_for(lambda: s.live.feed("tab-x", "push").snapshot().counters["completed"] == n)

        push(frames[0], 1)
        push(frames[1], 2)  # each answer held one frame: no picture with a hold of 3
        assert s.live.feed("tab-x", "push").snapshot().shots == []
        assert s.apply(Settings(max_tokens=12, sticky=0.0, hold=1)) == "settings applied"
        push(frames[0], 3)
        snap = s.live.feed("tab-x", "push").snapshot()
        assert [(shot.index, shot.text) for shot in snap.shots] == [(2, snap.log[-1].text)]
    finally:
        s.close()
        s.remove_outputs()


def test_a_cameras_export_goes_on_across_a_reload(untrained_folder):
    """A reload keeps every page's captions for Export; but the camera's next frame started a
    new feed on the new engine, and its Export then held the answers since the reload alone."""
    rgb = np.asarray(Image.open(SAMPLES_DIR / "scene.png").convert("RGB"))
    s = Service(Settings(max_tokens=4))

    def lines() -> int:
        try:
            return len(s.export_log("tab-x", "push").read_text().splitlines())
        except UIError:  # nothing captioned yet
            return 0

    def stream(until):  # the browser's camera, ten frames a second until `until` holds
        deadline = time.time() + 60
        while not until() and time.time() < deadline:
            s.push_frame("tab-x", rgb, make_task("short"))
            time.sleep(0.1)

    try:
        stream(lambda: lines() >= 10)
        before = lines()
        assert s.apply(Settings(model=str(untrained_folder), max_tokens=4)) == "engine reloaded"
        assert s.live.feed("tab-x", "push") is None
        # the new engine's first few answers: the export holds them after the old engine's
        stream(lambda: s.live.feed("tab-x", "push") is not None
               and s.live.feed("tab-x", "push").snapshot().counters["completed"] >= 3)
        assert lines() >= before + 3
    finally:
        s.close()
        s.remove_outputs()


def test_a_reload_lets_go_of_the_old_model_through_a_stopped_detect_feed(small_folder):
    """A detect feed kept for Export (a tab's Live view, stopped by another viewer's Settings)
    held the region decoder, and through it the old model's weights, until the tab closed."""
    s = Service(Settings(model=str(small_folder), max_tokens=4))
    try:
        feed = s.start_live("tab-d", "shapes_640x360_60fps.mp4", make_task("detect", "circle", regions=True))
        wait_for(lambda: feed.snapshot().counters["completed"] >= 2)
        old = weakref.ref(s.engine().loaded.model)
        assert s.apply(Settings(model="tiny", max_tokens=4)) == "engine reloaded"
        gc.collect()
        assert old() is None
        assert "the engine was reloaded" in feed.snapshot().error
    finally:
        s.close()
        s.remove_outputs()


def test_an_export_the_servers_disk_cannot_take_is_said(small_folder, tmp_path):
    """Export captions / Download change pictures on a full disk: the page showed a bare
    "[Errno 28]", the server logged a traceback, and a part file was left to be served."""
    s = Service(Settings(model=str(small_folder), max_tokens=4))
    try:
        feed = s.start_live("tab-x", "shapes_640x360_60fps.mp4", make_task("short"))
        wait_for(lambda: feed.snapshot().counters["completed"] >= 3 and feed.snapshot().shots)
        full = tmp_path / "full"
        full.mkdir()
        for name in ("live-captions.jsonl", "live-changes.zip"):
            (full / name).symlink_to("/dev/full")
        s.jobs.new_folder = lambda: full
        with pytest.raises(UIError, match="cannot write live-captions.jsonl on the server: No space left on device"):
            s.export_log("tab-x")
        with pytest.raises(UIError, match="cannot write live-changes.zip on the server: No space left on device"):
            s.export_shots("tab-x")
        assert not list(full.iterdir())
    finally:
        s.close()
        s.remove_outputs()


def test_a_detect_job_stops_when_the_model_is_reloaded(small_folder, tmp_path):
    """A caption job stops at a reload; a detect job ran on to its end on the old model, holding
    its weights meanwhile. It stops as a caption job does, its frames so far handed over."""
    s = Service(Settings(model=str(small_folder), max_tokens=4))
    try:
        old = weakref.ref(s.engine().loaded.model)
        reloaded = []

        def progress(done, total):
            if not reloaded:  # another viewer's Settings, while the job runs
                reloaded.append(s.apply(Settings(model="tiny", max_tokens=4)))

        out = s.caption_video(str(SAMPLES_DIR / "cuts_640x360_30fps.mp4"), make_task("detect", "circle", regions=True),
                              tmp_path / "job", every_n=30, on_progress=progress)
        assert out["cancelled"] and out["frames"] == 4 and out["warnings"] == [
            "the engine was reloaded (Settings) after 4 frames: run the job again for the rest"]
        assert len(Path(out["paths"]["jsonl"]).read_text().splitlines()) == 4
        gc.collect()
        assert reloaded == ["engine reloaded"] and old() is None
    finally:
        s.close()
        s.remove_outputs()


def test_the_default_settings_let_a_long_caption_finish():
    """The page's default answer limit was 32 tokens: "long" captions of three or four objects
    ended mid-sentence ("... a large green square in the"), with nothing on the page to say so."""
    from tinyvlm.world import render, sample_scene

    s = Service(Settings())
    try:
        for i in range(3):
            rgb = render(sample_scene(np.random.default_rng([99, i]), 640, 360, n_objects=4))
            out = s.caption_image(rgb, {"caption": "long"})
            assert out["finish_reason"] == "stop", out["text"]
    finally:
        s.close()
        s.remove_outputs()


def test_a_folder_or_a_missing_file_as_the_live_source_says_which(service, tmp_path):
    with pytest.raises(UIError, match="is a folder, not a video"):  # it said "no such file" of a folder there
        service.start_live("s-folder", str(tmp_path), make_task("short"))
    with pytest.raises(UIError, match="no such file"):
        service.start_live("s-folder", str(tmp_path / "none.mp4"), make_task("short"))


def test_a_feed_whose_page_reads_nothing_pauses_its_updates_then_stops(service, monkeypatch):
    """A Live started through the API by a client that never read its stream ran until the server
    stopped: the engine busy for nobody, its updates piling up in Gradio's memory (3,000 in a few
    minutes). A page behind on its updates gets none until it catches up; one that reads nothing
    for ORPHAN_S stops its feed."""
    import asyncio
    import types

    import app.page_events as events
    import app.ui as ui

    monkeypatch.setattr(events, "ORPHAN_S", 1.5)
    demo = ui.build(service)
    live = next(f.fn for f in demo.fns.values() if f.name == "live")
    request = types.SimpleNamespace(session_hash="tab-orphan")
    unread = asyncio.Queue()
    demo._queue.pending_messages_per_session["tab-orphan"] = unread
    updates = live("cuts_640x360_30fps.mp4", None, "short", "", "none", "", False, request)
    next(updates)  # the page's first update: it reads nothing from here on
    for _ in range(events.BACKLOG_MAX):
        unread.put_nowait("an update")
    feed = service.feed("tab-orphan")
    assert feed is not None and feed.running
    t0 = time.monotonic()
    assert list(updates) == []  # none more, and the generator ends
    assert 1.5 <= time.monotonic() - t0 < 10
    assert service.feed("tab-orphan") is None and not feed.running
    # a page that reads slowly is behind for longer than ORPHAN_S and keeps its feed
    while not unread.empty():
        unread.get_nowait()
    updates = live("cuts_640x360_30fps.mp4", None, "short", "", "none", "", False, request)
    next(updates)
    for _ in range(events.BACKLOG_MAX + 8):  # behind until the last read, 3 s from now
        unread.put_nowait("an update")

    def read_slowly():
        for _ in range(6):
            time.sleep(0.5)
            unread.get_nowait()
        while not unread.empty():
            unread.get_nowait()

    reader = threading.Thread(target=read_slowly)
    reader.start()
    t0 = time.monotonic()
    next(updates)  # held back while the page was behind, then on
    assert time.monotonic() - t0 >= 2.5 and service.feed("tab-orphan").running
    reader.join()
    updates.close()
    assert service.feed("tab-orphan") is None


def test_an_image_asked_across_a_reload_is_an_error_not_empty_answers(small_folder, monkeypatch):
    """Settings' reload cancels what is in flight: an Image-tab answer caught by it came back as
    answers, all empty ('q0?: \\nq1?: '), finish_reason 'length'; one asked as the engine closed
    said 'the engine is closed'. Both now say what happened and what to do."""
    import engine.engine as engine_module
    import pipelines.prompts

    from test_engine_properties import FakeRunner

    monkeypatch.setattr(engine_module, "Runner", FakeRunner)  # steps of a few ms, never EOS: still running
    service = Service(Settings(model=str(small_folder), max_tokens=400))
    rgb = np.zeros((48, 64, 3), np.uint8)
    ask = pipelines.prompts.ask

    def ask_then_reload(engine, *args, **kwargs):
        handles = ask(engine, *args, **kwargs)
        engine.close(cancel=True)  # what apply() does to the engine when the model changes
        return handles

    try:
        monkeypatch.setattr(pipelines.prompts, "ask", ask_then_reload)
        for task in ({"caption": "short"}, [{"question": "q0?"}, {"question": "q1?"}]):
            with pytest.raises(UIError, match=r"reloaded \(Settings\) while this image was asked: ask again"):
                service.caption_image(rgb, task)
            service.close()
        engine = service.engine()
        monkeypatch.setattr(pipelines.prompts, "ask", ask)
        engine.close()  # closed between the page's look at it and the question
        monkeypatch.setattr(service, "engine", lambda: engine)
        with pytest.raises(UIError, match="reloaded"):
            service.caption_image(rgb, {"caption": "short"})
    finally:
        service.close()


def test_a_video_job_waiting_for_a_slot_answers_cancel():
    """Two video jobs run at once; a third waited in Gradio's queue, where its stop flag did not
    exist yet: Cancel did nothing, and it ran to its end once a slot freed."""
    from app.video_jobs import VIDEO_SLOTS

    service = Service(Settings())
    running = [service.jobs.stop_flag(f"tab-{i}") for i in range(VIDEO_SLOTS)]
    assert all(service.jobs.wait_turn(stop, lambda: None) for stop in running)
    waiting, waited, got = service.jobs.stop_flag("tab-w"), [], []
    t = threading.Thread(target=lambda: got.append(service.jobs.wait_turn(waiting, lambda: waited.append(1))))
    t.start()
    time.sleep(0.6)
    assert t.is_alive() and waited  # waiting, and the page is told so
    assert service.jobs.cancel("tab-w") == 1
    t.join(2)
    assert not t.is_alive() and got == [False]
    service.jobs.end_turn()  # a slot frees: the next job takes it at once
    assert service.jobs.wait_turn(service.jobs.stop_flag("tab-n"), lambda: None)
    for _ in range(VIDEO_SLOTS):
        service.jobs.end_turn()


def test_a_video_job_cancelled_as_its_turn_comes_neither_runs_nor_keeps_the_slot():
    """Cancel that lands as a slot frees: the job must not run, and the slot it took must come
    back (kept, every later job of every tab waited for it, for good)."""
    from app.video_jobs import VideoJobs

    jobs = VideoJobs(slots=1)
    stop = jobs.stop_flag("tab-c")
    assert jobs.cancel("tab-c") == 1
    assert jobs.wait_turn(stop, lambda: None) is False
    # the next job finds the slot free: it never waits (waiting ends it, should the slot be gone)
    nxt, waited = jobs.stop_flag("tab-n"), []
    assert jobs.wait_turn(nxt, lambda: (waited.append(1), nxt.set())) is True and not waited
    jobs.end_turn()


def _cut_after_its_header(tmp_path: Path) -> Path:
    """The sample cut off right after its header: a video stream and no frame."""
    import shutil
    import subprocess

    whole, cut = tmp_path / "whole.mkv", tmp_path / "cut.mkv"
    subprocess.run([shutil.which("ffmpeg"), "-y", "-loglevel", "error", "-i",
                    str(SAMPLES_DIR / "cuts_640x360_30fps.mp4"), "-t", "1", "-c", "copy", str(whole)], check=True)
    cut.write_bytes(whole.read_bytes()[:1500])
    return cut


def test_video_jobs_on_odd_files_say_what_happened_and_keep_what_is_done(small_folder, tmp_path):
    """What the Video file tab tells of a file with no frame (an error, not an AttributeError nor
    a job of 0 frames), of one cut short (its frames, and a warning), and of a job stopped before
    its first frame (cancelled, not "the video has no frames"); captions and detect alike."""
    clip = SAMPLES_DIR / "cuts_640x360_30fps.mp4"
    short = tmp_path / "short.mp4"
    short.write_bytes(clip.read_bytes()[:60_000])  # 242 of its 480 frames decode
    cut = _cut_after_its_header(tmp_path)
    s = Service(Settings(model=str(small_folder), max_tokens=4, dtype="float32"))
    try:
        for task in (make_task("short"), {"detect": "red circle"}):
            with pytest.raises(UIError, match="no frame") as e:
                s.caption_video(str(cut), task, tmp_path / "none")
            assert "\n" not in str(e.value)
            out = s.caption_video(str(short), task, tmp_path / "short", every_n=60)
            assert out["frames"] == 5 and not out["cancelled"]
            assert len(out["warnings"]) == 1 and "decoding ended after 242 of the 480 frames" in out["warnings"][0]
            assert len(Path(out["paths"]["jsonl"]).read_text().splitlines()) == 5
            stop = threading.Event()
            stop.set()  # Cancel, between the job's turn and its first frame
            out = s.caption_video(str(clip), task, tmp_path / "stopped", every_n=60, stop=stop)
            assert out["cancelled"] and out["frames"] == 0 and out["rows"] == []
    finally:
        s.close()
        s.remove_outputs()


def test_a_sampled_jobs_last_cue_ends_with_the_video_and_its_speed_is_the_videos_over_the_jobs(small_folder,
                                                                                             tmp_path):
    """Every 70th (100th) frame of a 16 s clip: each answer's cue lasts until the next sample, the
    last one until the video ends (not one frame's time, nor a whole sample's past the end); the
    page's "x real time" is the video's seconds over the job's."""
    clip = str(SAMPLES_DIR / "cuts_640x360_30fps.mp4")
    s = Service(Settings(model=str(small_folder), max_tokens=4, dtype="float32"))
    try:
        for task, every in ((make_task("short"), 70), ({"detect": "red circle"}, 100)):
            out = s.caption_video(clip, task, tmp_path / str(every), every_n=every)
            srt = Path(out["paths"]["srt"]).read_text().strip().split("\n\n")
            vtt = Path(out["paths"]["vtt"]).read_text().strip().split("\n\n")
            assert srt[-1].splitlines()[1].endswith(" --> 00:00:16,000"), srt[-1]
            assert vtt[-1].splitlines()[0].endswith(" --> 00:00:16.000"), vtt[-1]
            if len(srt) > 1:  # a cue's end is the next one's start
                assert srt[-2].splitlines()[1].split(" --> ")[1] == srt[-1].splitlines()[1].split(" --> ")[0]
            # both figures are rounded to 0.01: 16 s of video over the job's seconds, within that
            secs, speed = out["seconds"], out["x_real_time"]
            assert secs > 0.005 and 16.0 / (secs + 0.005) - 0.006 <= speed <= 16.0 / (secs - 0.005) + 0.006, out
    finally:
        s.close()
        s.remove_outputs()


@pytest.mark.parametrize("line", ["How many? /[0-9+/", "How many? /a^b/"])
def test_a_bad_regex_constraint_is_named_once_in_its_error(service, line):
    # The page said "the regex '[0-9+': the regex '[0-9+' is not in Python's syntax (...)": the
    # check's own error, already naming the regex, was wrapped again (engine/constraints.py to_regex)
    pattern = line.split("/")[1]
    try:
        feed = service.start_live("bad-regex", "shapes_640x360_60fps.mp4", make_task("question", line, "none", ""))
        deadline = time.monotonic() + 30
        while feed.snapshot().error is None and time.monotonic() < deadline:
            time.sleep(0.05)
        error = feed.snapshot().error
    except VlmstreamError as e:
        error = str(e)
    finally:
        service.stop_live("bad-regex")
    assert error and "regex" in error, error
    assert error.count(repr(pattern)) == 1, error


def test_a_feed_stopped_before_its_first_frame_says_stopped(service):
    """Stop while the source was still being reached: the counters said stopped, but the frame's
    place kept its "connecting (0 s)" for as long as the page stayed open."""
    import socket
    import types

    import app.ui as ui

    live = next(f.fn for f in ui.build(service).fns.values() if f.name == "live")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as quiet:  # a UDP port nothing is sent to
        quiet.bind(("127.0.0.1", 0))
        url = f"udp://127.0.0.1:{quiet.getsockname()[1]}"
    request = types.SimpleNamespace(session_hash="tab-connecting")
    updates = live(url, None, "short", "", "none", "", False, request)
    deadline = time.monotonic() + 30
    frame = next(updates)[0]
    while "connecting" not in str(frame) and time.monotonic() < deadline:
        frame = next(updates)[0]
    assert "connecting" in str(frame), frame
    service.stop_live("tab-connecting")
    said = [update[0] for update in updates]  # the generator ends once it has said so
    assert said and "stopped" in str(said[-1]) and "connecting" not in str(said[-1]), said


@pytest.mark.parametrize("bad", [dict(temperature=2.5), dict(sticky=10.5), dict(hold=601), dict(hold=2.5),
                                 dict(max_tokens=True), dict(hold=float("inf"))])
def test_settings_out_of_range_are_refused_as_the_cli_refuses_them(bad):
    """The Settings tab's numbers reach the engine unchecked otherwise: a page (or a request to the
    server's API) is not held to the sliders' ranges."""
    from app.settings import checked

    with pytest.raises(UIError):
        checked(Settings(**bad))


def test_settings_at_their_limits_are_taken_whole_where_they_count():
    from app.settings import checked

    s = checked(Settings(max_tokens=12.0, temperature=2, sticky=10, hold=600.0))
    assert (s.max_tokens, s.temperature, s.sticky, s.hold) == (12, 2.0, 10.0, 600)
    assert type(s.max_tokens) is int and type(s.hold) is int and type(s.temperature) is float


def test_a_very_large_image_upload_prints_no_warning_in_the_servers_console(tmp_path, monkeypatch, recwarn):
    """A 100-megapixel photo on the Image tab was captioned, but the server's console printed
    Pillow's DecompressionBombWarning (two lines of Pillow's source) for each upload: `vlmstream
    image` reads such a file without a word, and the page's user had made no mistake."""
    import gradio as gr
    from gradio.data_classes import ImageData

    from app.tabs import _read_in_one_line

    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 50)  # 8 x 8 is then past the warning size, not twice it
    Image.new("RGB", (8, 8), "red").save(tmp_path / "big.png")
    read = _read_in_one_line(gr.Image(type="pil", image_mode=None).preprocess)
    picture = read(ImageData(path=str(tmp_path / "big.png"), orig_name="big.png"))
    assert picture.size == (8, 8)
    assert not [w for w in recwarn if issubclass(w.category, Image.DecompressionBombWarning)]


def test_an_uploads_jsonl_names_the_upload_not_the_servers_scratch_copy(service, tmp_path):
    """The Video file tab's captions.jsonl (and the Live tab's Export of a file uploaded to play
    live) gave each line's "source" as Gradio's copy of the upload
    (/tmp/vlmstream-ui-.../gradio/<hash>/clip.mp4): a path on the server, gone once it stops, where
    `video clip.mp4 -o` writes clip.mp4. Errors and warnings already named the upload."""
    import shutil
    import types

    from app.page_events import PageEvents

    scratch = tmp_path / "gradio" / "0123abcd"
    scratch.mkdir(parents=True)
    upload = scratch / "my clip.mp4"
    shutil.copy(SAMPLES_DIR / "cuts_640x360_30fps.mp4", upload)
    note, rows, files, _ = PageEvents(service).video(str(upload), "short", "", 120,
                                                     request=types.SimpleNamespace(session_hash="tab-named"))
    lines = [json.loads(line) for line in Path(next(f for f in files if f.endswith(".jsonl"))).read_text().splitlines()]
    assert len(lines) == len(rows) >= 3, note
    assert {line["source"] for line in lines} == {"my clip.mp4"}
    request = types.SimpleNamespace(session_hash="tab-named")
    updates = PageEvents(service).live("shapes_640x360_60fps.mp4", str(upload), "short", "", "none", "", False, request)
    next(updates)
    wait_for(lambda: service.feed("tab-named").snapshot().counters["completed"] >= 3)
    updates.close()  # the page went away: its feed stops, its captions stay for Export
    lines = [json.loads(line) for line in service.export_log("tab-named").read_text().splitlines()]
    assert len(lines) >= 3 and {line["source"] for line in lines} == {"my clip.mp4"}
    service.close_session("tab-named")


def test_a_viewer_of_an_ip_camera_sees_it_reboot_and_come_back(service):
    """The Live tab on an RTSP camera: captions, then the camera off (the connection cell says
    "reconnecting"), then on again: captions go on from the new session, and the outage is counted,
    and marked in the tab's recording (it had held the last picture through the gap, live-looking)."""
    from app.view import stream_state
    from rtsp_camera import RtspCamera

    with RtspCamera() as cam:
        feed = service.start_live("tab-ipcam", cam.url, make_task("short"), record=True)
        try:
            wait_for(lambda: len(feed.records()) >= 3)
            cam.stop()
            health = wait_for(lambda: (h := feed.snapshot().counters.get("stream", {})).get("state") == "reconnecting"
                              and h)
            assert stream_state(health).startswith("reconnecting (")
            before = len(feed.records())
            cam.start()
            wait_for(lambda: len(feed.records()) >= before + 3)
            health = feed.snapshot().counters["stream"]
            assert health["state"] == "live" and health["outages"] == 1 and cam.sessions == 2
            assert stream_state(health) == "live, 1 outage"
            indices = [json.loads(r)["index"] for r in feed.records()]
            assert indices == sorted(set(indices))  # frames numbered on across the reboot, none twice
            with av.open(str(service.recording("tab-ipcam"))) as c:  # the band over the gap and after it
                tops = [f.to_ndarray(format="rgb24")[:6].reshape(-1, 3).astype(int) for f in c.decode(video=0)]
            red = [((t[:, 0] > 120) & (t[:, 1] < 60) & (t[:, 2] < 60)).mean() > 0.6 for t in tops]
            assert 0 < sum(red) < len(red) and not red[0], red
        finally:
            service.close_session("tab-ipcam")


def test_before_the_first_answer_the_frames_place_says_the_model_is_answering_not_no_frame():
    """A slow model (Moondream 2 on a CPU: ~60 s to the first answers) had left "no frame yet" on
    the page for that minute while the source played, as if the source sent nothing."""
    from pipelines.feed_snapshot import FeedSnapshot

    def snap(counters):
        return FeedSnapshot(version=0, running=True, error=None, frame_rgb=None, text="", pts=0.0, index=-1,
                            end_to_end_ms=0.0, counters=counters)

    asked = frame_html(snap({"frames_in": 300, "submitted": 4, "in_flight": 4}))
    assert "no frame yet" not in asked and "waiting for the first answer (4 frames in flight)" in asked
    assert "no frame yet" in frame_html(snap({"frames_in": 0, "submitted": 0, "in_flight": 0}))


def test_the_wait_for_a_first_answer_says_how_long_it_has_lasted():
    """Moondream 2 on a CPU: the page said "waiting for the first answer (1 frame in flight)" for
    ~30 s, the same words every second, as a page that hung does. A feed's counters carry how
    long it has run, and the wait says it."""
    import types

    from pipelines.feed_snapshot import FeedSnapshot

    class Held:  # an engine whose answers never come
        def submit(self, *a, **k):
            h = types.SimpleNamespace(add_done_callback=lambda fn: None, cancel=lambda: None)
            return h

    feed = LiveFeed(Held(), {"caption": "short"}, SamplingParams(), max_inflight=1)
    try:
        assert feed.push(np.zeros((48, 64, 3), np.uint8))
        snap = feed.snapshot()
    finally:
        feed.close(timeout=1.0)
    assert snap.counters["in_flight"] == 1 and snap.running_s >= 0
    assert "no frame yet" not in frame_html(snap)
    snap = FeedSnapshot(version=0, running=True, error=None, frame_rgb=None, text="", pts=0.0, index=-1,
                        end_to_end_ms=0.0, counters=snap.counters, running_s=21.4)
    assert "waiting for the first answer (1 frame in flight): 21 s so far" in frame_html(snap)


def test_the_activity_logs_user_names_are_safe_across_page_threads(monkeypatch):
    """Gradio runs page events on many threads: a session seen again (its entry updated in place,
    the least recent) while another page's `seen` dropped the least recent had its move_to_end
    find no key, a KeyError in that page's event. Here the second page's `seen` runs exactly
    between the first's update and its move; with the lock it waits for the first to finish."""
    import threading
    from collections import OrderedDict

    from app import activity

    class Interleaved(OrderedDict):
        armed = False

        def __setitem__(self, key, value):
            super().__setitem__(key, value)
            if self.armed and key == "old-page":
                self.armed = False
                other = threading.Thread(target=activity.seen, args=("new-page", "bob"))
                other.start()
                other.join(0.5)  # without the lock it drops "old-page" now; with it, it waits

    users = Interleaved([("old-page", "alice"), ("mid-page", "carol")])
    monkeypatch.setattr(activity, "_users", users)
    monkeypatch.setattr(activity, "USERS_KEPT", 2)
    users.armed = True
    activity.seen("old-page", "alice")  # a KeyError here without the lock
    for _ in range(100):
        if "new-page" in users:
            break
        time.sleep(0.01)
    assert list(users) == ["old-page", "new-page"]
    assert activity.who("old-page") == "alice (page old-page)"


def test_a_refused_camera_is_logged_once_not_for_each_frame_it_sends():
    """A camera refused for --max-feeds goes on sending a frame every 0.1 s, each refused: the
    activity log had a line for each, ten a second for as long as the page stayed open."""
    import logging

    from app import activity

    lines = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: lines.append(record.getMessage())
    activity.log.addHandler(handler)
    level = activity.log.level
    activity.log.setLevel(logging.INFO)
    rgb = np.asarray(Image.open(SAMPLES_DIR / "scene.png").convert("RGB"))
    s = Service(Settings(max_tokens=4), max_feeds=1)
    try:
        s.start_live("tab-full", "shapes_640x360_60fps.mp4", make_task("short"))
        for _ in range(5):
            with pytest.raises(UIError, match="its limit"):
                s.push_frame("tab-cam-refused", rgb, make_task("short"))
        s.stop_live("tab-full", why="Stop")
        s.push_frame("tab-cam-refused", rgb, make_task("short"))  # room again: it starts
    finally:
        activity.log.removeHandler(handler)
        activity.log.setLevel(level)
        for sid in ("tab-full", "tab-cam-refused"):
            s.close_session(sid)
        s.close()
        s.remove_outputs()
    refused = [line for line in lines if "refused" in line]
    assert len(refused) == 1, lines
    assert any("started the browser camera" in line for line in lines), lines
