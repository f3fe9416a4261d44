"""A live source's outages in what a user reviews afterwards: the -o log's "outage" lines and the
--annotate recording's card over the gap and note after it; and a hung camera given up at
--max-outage, not a read timeout or two later."""

import json
import time
from pathlib import Path

import av
import numpy as np
import pytest

from app.cli import main
from engine.types import RequestOutput
from pipelines.connection import Connection
from pipelines.live_result import LiveResult
from pipelines.outage import Outage
from pipelines.recorder import NOTE_S, Recorder
from pipelines.sources import Frame, SourceError, StreamSource


def _decoded(path: Path) -> tuple[list[float], list[np.ndarray]]:
    with av.open(str(path)) as c:
        frames = list(c.decode(video=0))
    return [float(f.time) for f in frames], [f.to_ndarray(format="rgb24") for f in frames]


def _red_top(rgb: np.ndarray) -> bool:
    """The note's band: the top rows mostly the note's dark red."""
    top = rgb[:6].reshape(-1, 3).astype(int)
    return bool(((top[:, 0] > 120) & (top[:, 1] < 60) & (top[:, 2] < 60)).mean() > 0.6)


def _result(i: int, captured_at: float, rgb: np.ndarray) -> LiveResult:
    return LiveResult(Frame("cam", i, float(i), rgb, captured_at=captured_at), [RequestOutput("a door", [], "stop")],
                      20.0, [{"caption": "short"}])


def test_a_recording_shows_an_outage_as_a_card_over_the_gap_and_a_note_after_it(tmp_path):
    """A camera gone 4.1 s: the recording had its last picture frozen for those 4.1 s, live-looking,
    then went on; nothing told a reviewer the picture was not live."""
    rgb = np.full((120, 160, 3), 150, np.uint8)
    rec = Recorder(tmp_path / "r.mp4")
    for i in range(10):  # 0.0 to 0.9 s
        rec.add(_result(i, 100.0 + i / 10, rgb))
    lost = Outage("cam", start=100.9, reason="nothing came for 3.0 s")
    rec.outage(lost)  # found 3 s later; nothing more comes meanwhile
    rec.outage(lost.closed(105.0))  # the first frame after it: 4.1 s without frames
    for i in range(30):  # 5.0 to 7.9 s
        rec.add(_result(10 + i, 105.0 + i / 10, rgb))
    rec.close()
    times, frames = _decoded(tmp_path / "r.mp4")
    assert rec.error is None and rec.written == len(times) == 41
    card = times.index(0.901)  # the last frame's time (ms apart): the card from the outage's start
    assert times[:card] == [round(i / 10, 3) for i in range(10)] and times[card + 1] == 5.0
    assert _red_top(frames[card]) and frames[card][40:80].mean() < 0.5 * 150  # the last picture, darkened
    noted = [t for t, f in zip(times, frames) if _red_top(f)]
    # the card, then the frames captured in the NOTE_S after the outage, at full brightness
    assert noted == [0.901] + [round(5.0 + i / 10, 3) for i in range(int(NOTE_S * 10))], noted
    assert all(f[40:80].mean() > 140 for t, f in zip(times, frames) if t >= 5.0)


def test_a_recording_that_ends_in_an_outage_or_at_its_giving_up_ends_with_its_card(tmp_path):
    rgb = np.full((120, 160, 3), 150, np.uint8)
    now = time.perf_counter()
    rec = Recorder(tmp_path / "r.mp4")  # the run ended (--duration) 1 s into an outage
    for i in range(5):
        rec.add(_result(i, now - 1.5 + i / 10, rgb))
    rec.outage(Outage("cam", start=now - 1.1, reason="the stream ended"))
    rec.close()
    times, frames = _decoded(tmp_path / "r.mp4")
    with av.open(str(tmp_path / "r.mp4")) as c:
        seconds = c.duration / 1_000_000
    assert times[-1] == 0.4 + 0.001 and _red_top(frames[-1]) and not any(_red_top(f) for f in frames[:-1])
    assert 1.5 <= seconds < 1.5 + 5  # the card to the recording's end

    # given up (--max-outage 2): a source that ended before the run ends its recording when it did
    gave_up = Recorder(tmp_path / "g.mp4")
    for i in range(5):
        gave_up.add(_result(i, now - 10 + i / 10, rgb))
    lost = Outage("cam", start=now - 9.6, reason="nothing came for 3.0 s")
    gave_up.outage(lost)
    gave_up.outage(lost.given_up(now - 7.6))
    gave_up.hold_to_close = False  # app/live_run.py: ended_early
    gave_up.close()
    times, frames = _decoded(tmp_path / "g.mp4")
    with av.open(str(tmp_path / "g.mp4")) as c:
        assert c.duration / 1_000_000 == pytest.approx(2.4, abs=0.01)  # to the giving up, not the close
    assert _red_top(frames[-1]) and len(times) == 6


def test_a_connection_hands_each_outage_over_when_found_over_and_given_up():
    told = []
    c = Connection("rtsp://cam", max_wait=1.0, max_outage=0.3)
    c.on_outage = told.append
    c.frame()
    c.lost("nothing came for 3.0 s")
    assert c.outage is told[0] and not told[0].over and told[0].start == c.last_frame
    time.sleep(0.05)
    c.frame()
    assert told[1].end == c.last_frame and 0.045 <= told[1].duration() < 0.25 and c.outage is None
    c.lost("Connection refused")
    time.sleep(0.35)
    with pytest.raises(SourceError, match="gave up on"):
        c.retry("Connection refused", time.perf_counter())
    assert told[3].gave_up is not None and told[3].end is None and told[3].duration() >= 0.3 and c.outage is None
    records = [o.record(s) for o, s in zip(told, ["began", "ended", "began", "gave_up"])]
    assert [(r["state"], r["end"] is None, "duration_s" in r) for r in records] == [
        ("began", True, False), ("ended", False, True), ("began", True, False), ("gave_up", True, True)]
    assert records[1]["duration_s"] == round(told[1].end - told[1].start, 3) and records[0]["source"] == "rtsp://cam"


@pytest.mark.parametrize("ends_in_it, detect", [(False, False), (True, False), (False, True)])
def test_live_logs_and_records_a_cameras_outage(monkeypatch, capsys, small_folder, tmp_path, ends_in_it, detect):
    """`live -o LOG.jsonl --annotate OUT.mp4` of a camera gone 1.2 s: the log said nothing of it
    (the frames' lines just skip the time) and the recording held the last picture, as if live.
    The same with --detect (its run's outputs are made elsewhere: app/live_locate_run.py)."""
    def frames(self):
        rgb = np.full((120, 160, 3), 150, np.uint8)
        for i in range(80):
            if i == 15:
                self.connection.lost("nothing came for 3.0 s")
                time.sleep(1.2)
                if ends_in_it:
                    while not self.connection.stopped:  # to the run's --duration
                        time.sleep(0.05)
                    return
            time.sleep(1 / 30)
            self.connection.frame()
            yield Frame(self.source_id, i, i / 30, rgb)

    monkeypatch.setattr(StreamSource, "_frames", frames)
    log, rec = tmp_path / "cam.jsonl", tmp_path / "cam.mp4"
    url = "rtsp://user:secret@127.0.0.1:9/cam"
    assert main(["live", url, "--model", str(small_folder), "--json", "-o", str(log), "--annotate", str(rec),
                 *(["--detect", "star"] if detect else ["--max-tokens", "2"]),
                 *(["--duration", "3"] if ends_in_it else [])]) == 0
    stats = json.loads(capsys.readouterr().out)
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    events = [x for x in lines if x.get("event") == "outage"]
    assert [x["state"] for x in events] == ["began", "unfinished" if ends_in_it else "ended"]
    assert all(x["source"] == "rtsp://***@127.0.0.1:9/cam" and x["reason"] == "nothing came for 3.0 s" for x in events)
    assert events[0]["start"] == events[1]["start"] and events[0]["end"] is None
    # in the log's order: the frames after it come after its lines (those in flight when it was found may not)
    assert all(x["index"] < 15 for x in lines[:lines.index(events[-1])] if "event" not in x)
    assert any(x["index"] >= 15 for x in lines if "event" not in x) != ends_in_it
    if ends_in_it:
        assert events[1]["end"] is None and 1.2 < events[1]["duration_s"] < 3.0
    else:
        assert events[1]["end"] > events[1]["start"] and 1.2 <= events[1]["duration_s"] < 1.2 + 0.5
    assert stats["recording"]["frames"] > 10
    _, pictures = _decoded(rec)
    assert sum(_red_top(p) for p in pictures) >= 1 + (not ends_in_it)  # the card, and a frame after it


def test_a_hung_camera_is_found_lost_at_the_read_timeout_and_given_up_at_max_outage():
    """A camera whose RTSP server answers every try and then sends nothing. Its timed-out read got
    a packet the demuxer held, which started the read timeout over: found lost after two (said
    as one); then its last try ran a whole open and read timeout past --max-outage (9.6 s of 2,
    13 s of 10)."""
    from rtsp_camera import RtspCamera

    with RtspCamera() as cam:
        src = StreamSource(cam.url, read_timeout=1.5, max_outage=2.5)
        lost = []
        src.connection.on_event = lambda line: lost.append((time.perf_counter() - src.connection.last_frame, line))
        with pytest.raises(SourceError, match=r"^gave up on .*: no frame for 2\.\d s, more than the 2\.5 s allowed$"):
            for i, _ in enumerate(src.frames()):
                if i == 5:
                    cam.stalled = True
        took = time.perf_counter() - src.connection.last_frame
    assert [line for _, line in lost] == ["lost (nothing came for 1.5 s); reconnecting"]
    assert 1.5 <= lost[0][0] < 1.5 + 0.7, lost  # not at 3.0
    assert 2.5 <= took < 2.5 + 1.0, took  # 5.0 before
