"""A live stream decoded slower than it comes: keyframes only until caught up (pipelines/catch_up.py)."""

import re
import socket
import subprocess
import time
from pathlib import Path

import pytest

from pipelines.catch_up import CATCH_UP_S, GIVE_UP_S, CatchUp
from pipelines.sources import SourceError, StreamSource

CLIP = Path(__file__).resolve().parents[1] / "sample_videos" / "cuts_640x360_30fps.mp4"


class Codec:
    skip_frame = "DEFAULT"


def test_a_backlog_skips_to_keyframes_until_the_edge_then_decodes_all_again():
    codec = Codec()
    guard = CatchUp(codec)
    for i in range(30):  # in time: each frame decoded as it comes
        guard.frame(i / 30, 100.0 + i / 30)
    assert codec.skip_frame == "DEFAULT" and guard.late < 1e-6
    for i in range(30, 120):  # decoded at 20 fps of a 30 fps stream: half a second later each second
        guard.frame(i / 30, 100.0 + 1.0 + (i - 30) / 20)
        # a second late after 60 frames (late by a sixtieth of a second a frame)
        assert codec.skip_frame == ("NONKEY" if guard.late > CATCH_UP_S else "DEFAULT")
    assert codec.skip_frame == "NONKEY" and guard.catch_ups == 1 and guard.max_late > CATCH_UP_S
    guard.frame(6.0, 106.05)  # a keyframe at the edge again
    assert codec.skip_frame == "DEFAULT" and guard.late < 0.1


def _behind(guard: CatchUp) -> float:
    """A 30 fps stream decoded in time for a second, then at 20 fps for three: ~1.5 s behind, skipping."""
    for i in range(30):
        guard.frame(i / 30, 100.0 + i / 30)
    for i in range(30, 120):
        guard.frame(i / 30, 100.0 + 1.0 + (i - 30) / 20)
    assert guard.skipping and guard.late > CATCH_UP_S
    return 101.0 + 89 / 20 - 119 / 30  # the last frame's wall time minus its stream time


def test_skipping_goes_on_until_the_stream_is_nearly_caught_up():
    """Every frame is decoded again only within CAUGHT_UP_S of the edge, not as soon as the
    stream is under CATCH_UP_S late: it would hover a second behind, catching up again and again."""
    codec = Codec()
    guard = CatchUp(codec)
    _behind(guard)
    guard.frame(5.5, 106.0)  # half a second late: still skipping
    assert 0.4 < guard.late < 0.6 and codec.skip_frame == "NONKEY"
    guard.frame(5.95, 106.05)
    assert codec.skip_frame == "DEFAULT" and guard.catch_ups == 1


def test_a_stream_given_up_on_takes_where_it_is_as_its_edge():
    """After GIVE_UP_S of keyframes only (none came), the next frame is the edge: measured against
    the old one it was as late as before, and the decoder went back to skipping for another
    GIVE_UP_S, again and again."""
    codec = Codec()
    guard = CatchUp(codec)
    offset = _behind(guard)
    guard.packet(105.45 + GIVE_UP_S + 0.1)
    guard.frame(4.0, 4.0 + offset)  # as far behind as it was
    assert codec.skip_frame == "DEFAULT" and guard.late < 0.01 and guard.catch_ups == 1


def test_a_slow_camera_clock_a_timestamp_jump_and_a_stream_without_keyframes_do_not_stall_decoding():
    codec = Codec()
    guard = CatchUp(codec)
    for i in range(30 * 3600):  # an hour of a camera clock 0.05 % slow against this one
        guard.frame(i / 30 * 0.9995, 100.0 + i / 30)
    assert codec.skip_frame == "DEFAULT" and guard.catch_ups == 0
    guard.frame(-500.0, 100.0 + 3600.1)  # the timestamps restart (a discontinuity): a new edge
    guard.frame(-499.9, 100.0 + 3600.2)
    assert codec.skip_frame == "DEFAULT" and guard.late < 0.01
    guard.frame(-499.8 + 3.0, 100.0 + 3600.3)  # they jump ahead: the edge follows
    guard.frame(-499.7 + 3.0, 100.0 + 3602.9)  # the sender paused 2.5 s (or restarted with timestamps
    guard.frame(-499.6 + 3.0, 100.0 + 3603.0)  # a few seconds on): no backlog, no skipping
    assert codec.skip_frame == "DEFAULT" and guard.late < 0.01 and guard.catch_ups == 0
    for i in range(1, 60):  # then decoded at 15 fps of a 30 fps stream: late...
        guard.frame(-499.6 + 3.0 + i / 30, 100.0 + 3603.0 + i / 15)
    assert codec.skip_frame == "NONKEY" and guard.catch_ups == 1  # ...keyframes only...
    guard.packet(100.0 + 3607.0 + GIVE_UP_S + 0.1)  # ...but none comes: everything again
    assert codec.skip_frame == "DEFAULT"


def test_a_live_stream_consumed_too_slowly_stays_recent():
    """What a 4K camera at 60 fps does to two cores beside the model: decoding fell 6 s behind in
    12 s, and kept falling, over UDP; over TCP without bound."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        url = f"udp://127.0.0.1:{s.getsockname()[1]}"
    sender = subprocess.Popen(["ffmpeg", "-loglevel", "quiet", "-re", "-i", str(CLIP), "-t", "6", "-c:v", "libx264",
                               "-preset", "ultrafast", "-g", "10", "-f", "mpegts", url + "?pkt_size=1316"])
    try:
        src = StreamSource(url, reconnect=False, pace=False)
        said = []
        src.connection.on_event = said.append
        frames, t0 = 0, time.monotonic()
        for _ in src.frames():
            frames += 1
            time.sleep(0.08)  # a consumer at 12 frames a second of a 30 fps stream
            if time.monotonic() - t0 > 4.5:  # a second late after ~2 s, without the catch-up 2.7 s at the end
                break
    finally:
        sender.kill()
        sender.wait(30)
    assert frames > 20 and src.catch_ups >= 1
    assert src.max_late < CATCH_UP_S + 1.0  # a keyframe's worth past the threshold at most
    # said when it happens, once a minute at most however often it skips (a stream too heavy skips
    # every few seconds)
    assert len(said) == 1 and re.fullmatch(r"decoding is 1\.\d s behind the stream: skipping to its newest keyframe "
                                           r"\(1 time so far; a lighter stream would keep up\)", said[0]), said


def test_only_streams_pushed_with_their_clock_are_watched():
    """HLS comes a segment (seconds) at a time: its frames look late by up to a segment, and
    skipping them would leave keyframes only. A pipe's raw H.264 has no clock."""
    watched = {url: StreamSource(url)._clocked for url in ("rtsp://cam/1", "rtmp://h/live", "udp://127.0.0.1:5000",
                                                          "http://h/live.m3u8", "https://h/cam.mjpg")}
    assert watched == {"rtsp://cam/1": True, "rtmp://h/live": True, "udp://127.0.0.1:5000": True,
                       "http://h/live.m3u8": False, "https://h/cam.mjpg": False}
    assert StreamSource("-")._clocked is False


def test_waiting_for_the_sender_is_no_backlog():
    """Timestamps by frame count at a nominal 60 fps, frames sent at 5 (a program's frames piped
    to an encoder): each frame 0.18 s later than the one before it by its timestamps, while the
    reader waited ~0.2 s for each packet. It was taken for a backlog: keyframes only."""
    codec = Codec()
    guard = CatchUp(codec)
    for i in range(100):
        guard.packet(100.0 + i / 5 - 0.002, waited=0.195 if i else 0.0)
        guard.frame(i / 60, 100.0 + i / 5)
    assert codec.skip_frame == "DEFAULT" and guard.catch_ups == 0 and guard.max_late < 0.05
    for i in range(100, 190):  # then a backlog (decoded at 20 fps of a 30 fps stream), read without waiting
        guard.packet(120.0 + (i - 100) / 20, waited=0.002)
        guard.frame(100 / 60 + (i - 100) / 30, 120.0 + (i - 100) / 20)
    assert codec.skip_frame == "NONKEY" and guard.catch_ups == 1


def test_a_stream_with_timestamps_slower_than_it_sends_is_decoded_whole():
    """Over UDP: a 60 fps clock in the timestamps, 5 frames a second sent (one keyframe, at the start;
    noise, so that every frame fills datagrams of its own).
    It was decoded at its keyframes only, with 'decoding is 1.2 s behind' said."""
    import sys

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        url = f"udp://127.0.0.1:{s.getsockname()[1]}"
    code = ("import sys, time, av, numpy as np\n"
            "c = av.open(sys.argv[1], mode='w', format='mpegts')\n"
            "s = c.add_stream('libx264', rate=60)\n"
            "s.width, s.height, s.pix_fmt = 320, 240, 'yuv420p'\n"
            "s.options = {'preset': 'ultrafast', 'tune': 'zerolatency', 'g': '300', 'bf': '0'}\n"
            "t0 = time.time()\n"
            "for i in range(60):\n"
            "    img = np.random.default_rng(i).integers(0, 255, (240, 320, 3), np.uint8)\n"
            "    f = av.VideoFrame.from_ndarray(img, format='rgb24'); f.pts = i\n"
            "    [c.mux(p) for p in s.encode(f)]\n"
            "    time.sleep(max(0, t0 + (i + 1) / 5 - time.time()))\n"
            "[c.mux(p) for p in s.encode()]\n"
            "c.close()\n")
    sender = subprocess.Popen([sys.executable, "-c", code, url + "?pkt_size=1316"])
    try:
        src = StreamSource(url, read_timeout=1, max_wait=30, max_outage=1)
        said, frames = [], 0
        src.connection.on_event = said.append
        with pytest.raises(SourceError, match="^gave up on .*: no frame for "):  # once the sender is done
            for _ in src.frames():
                frames += 1
    finally:
        sender.kill()
        sender.wait(30)
    assert src.catch_ups == 0 and not [e for e in said if "behind" in e], said
    assert frames >= 50  # of 60


def test_only_the_wait_past_wait_s_moves_the_edge():
    """A busy machine's scheduling (a read that waits 15 ms where WAIT_S is 10) is no sender's
    pause: only the 5 ms past WAIT_S move the edge, and a backlog of 20 ms a frame still shows as
    15 ms a frame (had the whole wait moved it, 5 ms: a third of the lateness hidden)."""
    from pipelines.catch_up import DRIFT, WAIT_S

    codec = Codec()
    guard = CatchUp(codec)
    step = 1 / 30 + 0.02  # each frame decoded 20 ms later than the one before it by its timestamps
    for i in range(60):
        guard.packet(100.0 + i * step - 0.001, waited=WAIT_S + 0.005)
        guard.frame(i / 30, 100.0 + i * step)
    assert guard.late == pytest.approx(59 * (0.02 - 0.005 - DRIFT * step))
    assert codec.skip_frame == "DEFAULT" and guard.catch_ups == 0  # 0.88 s: not yet
    for i in range(60, 80):
        guard.packet(100.0 + i * step - 0.001, waited=WAIT_S + 0.005)
        guard.frame(i / 30, 100.0 + i * step)
    assert codec.skip_frame == "NONKEY" and guard.catch_ups == 1


def test_the_edge_creeps_slowly_enough_that_a_slow_backlog_is_still_caught_up():
    """The edge may creep by DRIFT (0.1 %) a second for clocks that differ; a decoder 1 % slower
    than the stream falls a second behind in under two minutes and skips ahead."""
    codec = Codec()
    guard = CatchUp(codec)
    for i in range(30 * 150):  # two and a half minutes of a 30 fps stream, decoded 1 % slower
        guard.frame(i / 30, 100.0 + i / 30 * 1.01)
        if guard.catch_ups:
            break
    assert guard.catch_ups == 1 and codec.skip_frame == "NONKEY" and 100 * 30 < i < 120 * 30


def test_the_most_a_stream_fell_behind_is_kept_once_it_catches_up():
    """`live`'s closing warning says how far decoding fell behind at most, after it caught up."""
    codec = Codec()
    guard = CatchUp(codec)
    _behind(guard)
    peak = guard.max_late
    assert peak > CATCH_UP_S
    guard.frame(6.0, 106.05)  # a keyframe at the edge again
    assert codec.skip_frame == "DEFAULT" and guard.late < 0.1 and guard.max_late == peak


def test_a_recording_over_a_clocked_scheme_is_not_skipped_to_keyframes(tmp_path, monkeypatch):
    """A recording (a stream that says how long it lasts: an RTSP server's file) is read at its
    consumer's pace: its frames come "late" because they were not asked for, and none is skipped
    (only a live stream's lateness says decoding falls behind)."""
    import av

    clip = tmp_path / "clip.mp4"
    subprocess.run(["ffmpeg", "-loglevel", "error", "-f", "lavfi", "-i", "testsrc=size=64x48:rate=60", "-frames:v", "60",
                    "-c:v", "libx264", "-g", "600", "-bf", "0", str(clip)], check=True, timeout=60)
    real_open = av.open
    monkeypatch.setattr(av, "open", lambda url, **kw: real_open(str(clip)))  # an RTSP server's recording
    src, got = StreamSource("rtsp://127.0.0.1:9/recording", pace=False), []
    for frame in src.frames():
        got.append(frame.index)
        time.sleep(0.05)  # a consumer at 20 frames a second of a 60 fps recording: 1.5 s "late" at its end
    assert got == list(range(60)) and src.catch_ups == 0


def test_the_times_a_stream_skipped_ahead_add_up_across_reconnects(tmp_path, monkeypatch):
    """`live`'s closing warning and the stream's health say how often decoding skipped ahead in
    the whole run: a reconnect (a new CatchUp) adds to the count, it does not start it over."""
    import av

    import pipelines.stream

    clip = tmp_path / "clip.ts"
    subprocess.run(["ffmpeg", "-loglevel", "error", "-f", "lavfi", "-i", "testsrc=size=64x48:rate=60", "-frames:v", "60",
                    "-c:v", "libx264", "-g", "600", "-bf", "0", str(clip)], check=True, timeout=60)
    real_open = av.open
    monkeypatch.setattr(av, "open", lambda url, **kw: real_open(str(clip)))  # a live camera, as far as it knows
    monkeypatch.setattr(pipelines.stream, "is_recording", lambda container, url: False)
    src, after = StreamSource("rtsp://127.0.0.1:9/cam", pace=False), 0
    for _ in src.frames():
        if src.reconnects == 0:
            time.sleep(0.05)  # too slow for its first run: it skips ahead (its one keyframe is past)
            continue
        after += 1
        if after == 5:  # the stream came back: in time now
            break
    assert src.reconnects == 1 and src.catch_ups >= 1 and src.health()["catch_ups"] == src.catch_ups
