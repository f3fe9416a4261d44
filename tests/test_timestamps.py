"""Frame times of files whose containers store them oddly: AVI with B-frames, damaged MPEG-TS,
audio files with a cover picture (pipelines/timestamps.py, FileSource)."""

import subprocess
from fractions import Fraction
from types import SimpleNamespace

import pytest

from app.cli import main
from pipelines.frame import SourceError
from pipelines.sources import FileSource
from pipelines.timestamps import BestEffort, Continuous


def ffmpeg(*args: str) -> None:
    subprocess.run(["ffmpeg", "-loglevel", "error", "-y", *args], check=True, timeout=120)


def times(path) -> tuple[list[float], str | None]:
    with FileSource(path) as src:
        return [f.pts for f in src.frames(need_rgb=lambda i: False)], src.error


def test_best_effort_takes_the_decode_times_where_the_frames_own_go_backwards():
    best = BestEffort()
    # frames in display order that carry their packets' times in decode order (AVI), then two
    # the decoder gives at the end without a packet
    got = [best(pts, dts) for pts, dts in [(1, 0), (4, 1), (3, 2), (5, 3), (2, 4), (6, 5), (None, None), (None, None)]]
    assert got == [1, 4, 2, 3, 4, 5, 6, 7]
    ordinary = BestEffort()  # B-frames in MP4: the frames' own times, in order
    assert [ordinary(pts, dts) for pts, dts in [(2, 0), (3, 1), (4, 2), (5, 3)]] == [2, 3, 4, 5]
    # Two frames from each packet (deinterlaced to the field rate) repeat their dts: counted
    # faulty as ffmpeg counts them, so one glitch of the frames' own times keeps them (taken for
    # a dts, every other frame had the time of the one before it)
    doubled = BestEffort()
    pairs = [(0, 0), (.02, 0), (.04, .04), (.06, .04), (.03, .08), (.10, .08), (.12, .12), (.14, .12)]
    assert [doubled(pts, dts) for pts, dts in pairs] == [0, .02, .04, .06, .03, .10, .12, .14]
    # frames that all carry one time (a muxer that stamped them so): a repeat is faulty, as in
    # ffmpeg, and the decode times are taken; counted as in order, every frame was at 0 s
    stuck = BestEffort()
    assert [stuck(pts, dts) for pts, dts in [(0, 0), (0, 1), (0, 2), (0, 3)]] == [0, 1, 2, 3]


def test_continuous_removes_jumps_from_the_packets_in_read_order():
    clock = Continuous(Fraction(1, 90000), 1 / 30, threshold_s=10.0)
    packets = [SimpleNamespace(pts=p, dts=d, duration=3000) for p, d in
               [(6000, 3000), (15000, 6000), (9000, 9000), (12000, 12000),  # reordered pts, dts in order
                (3600 * 90000 + 6000, 3600 * 90000 + 3000),  # an hour on: recordings joined
                (30000, 27000)]]  # then 0.1 s+ before the furthest time read: a clock reset
    for p in packets:
        clock(p)
    assert [p.dts for p in packets] == [3000, 6000, 9000, 12000, 15000, 18000]
    assert [p.pts for p in packets] == [6000, 15000, 9000, 12000, 18000, 21000]
    assert clock.jumps == 2
    # a clock reset 3 s back: within the threshold either way, but behind the furthest time read
    reset = SimpleNamespace(pts=24000 - 3 * 90000 + 3000, dts=24000 - 3 * 90000, duration=3000)
    clock(reset)
    assert (reset.dts, reset.pts, clock.jumps, clock.jumped) == (21000, 24000, 3, True)
    after = SimpleNamespace(pts=None, dts=24000 - 3 * 90000 + 3000, duration=None)
    clock(after)
    assert (after.dts, clock.jumps, clock.jumped) == (24000, 3, False)


def test_h264_with_b_frames_in_avi_and_asf_is_timed_in_order(tmp_path):
    """Their frames had come with times 0.033, 0.133, 0.1, 0.167, 0.067 s: subtitles backwards."""
    for name in ("bf.avi", "bf.wmv"):
        ffmpeg("-f", "lavfi", "-i", "testsrc=s=96x64:r=30:d=2", "-c:v", "libx264", "-bf", "3", "-pix_fmt", "yuv420p",
               str(tmp_path / name))
        pts, error = times(tmp_path / name)
        assert len(pts) == 60 and error is None
        # in order: the first two are the frames' own, the first backward step tells the decode times to take
        assert all(b >= a for a, b in zip(pts, pts[1:])) and all(b > a for a, b in zip(pts[2:], pts[3:])), pts
        assert pts[-1] == pytest.approx(2.033, abs=0.002)


def test_interlaced_h264_with_b_frames_in_avi_is_timed_in_order_once_deinterlaced(tmp_path):
    """The deinterlacer's frames carry its time base (1/50) and their packets' dts the stream's
    (1/25): mixed, the times ran backwards (0.52, 0.56, 0.3, 0.32 ...)."""
    ffmpeg("-f", "lavfi", "-i", "testsrc=size=160x120:rate=25", "-t", "2", "-vf", "setfield=tff", "-c:v", "libx264",
           "-flags", "+ilme+ildct", "-x264opts", "tff=1", "-bf", "2", str(tmp_path / "i.avi"))
    pts, error = times(tmp_path / "i.avi")
    assert len(pts) == 50 and error is None
    assert all(b > a for a, b in zip(pts, pts[1:])) and pts[-1] == pytest.approx(2.04, abs=0.002), pts


def test_a_corrupt_mark_just_before_a_jump_is_a_join_not_lost_data():
    """cat a.ts b.ts: the demuxer marks corrupt the packet of a.ts it was assembling when b.ts's
    continuity counters restarted, and hands it out two packets ahead of b.ts's first (whose
    jump the clock sees): "data lost at 1 point" of two clean recordings."""
    from pipelines.timestamps import JOIN_PACKETS

    clock = Continuous(Fraction(1, 90000), 1 / 30, threshold_s=10.0)
    dts = 0

    def packets(n: int, jump: int = 0, mark_at: int | None = None) -> None:
        nonlocal dts
        dts += jump
        for i in range(n):
            clock(SimpleNamespace(pts=dts, dts=dts, duration=3000))
            dts += 3000
            if i == mark_at:
                clock.mark_corrupt()

    packets(30, mark_at=27)  # the join's mark, two packets before the end of the first
    packets(30, jump=3600 * 90000)
    assert clock.jumps == 1 and clock.lost() == 0
    packets(JOIN_PACKETS + 5, mark_at=0)  # lost data mid-recording: no jump follows it
    packets(30, jump=3600 * 90000)
    assert clock.jumps == 2 and clock.lost() == 1
    packets(3, mark_at=1)  # at the very end: no jump can follow
    assert clock.lost() == 2


def test_an_hls_recordings_segments_are_no_lost_data(tmp_path):
    """Each segment restarts MPEG-TS's continuity counters: "data lost at 3 points" of a clean playlist."""
    ffmpeg("-f", "lavfi", "-i", "testsrc=s=96x64:r=25", "-t", "6", "-c:v", "libx264", "-g", "25", "-pix_fmt",
           "yuv420p", "-f", "segment", "-segment_time", "2", "-segment_list", str(tmp_path / "p.m3u8"),
           "-segment_format", "mpegts", str(tmp_path / "s%d.ts"))
    pts, error = times(tmp_path / "p.m3u8")
    assert error is None and pts == pytest.approx([i / 25 for i in range(150)], abs=1e-3)


def test_cover_pictures_are_told_on_every_pyav_the_package_takes():
    """Stream.disposition came with PyAV 14.1 (a Flag, later an IntFlag): on 14.0 every video had
    failed to open."""
    import enum

    from pipelines.frame import video_streams

    class Flag(enum.Flag):
        default = 1
        attached_pic = 0x400

    film, cover = SimpleNamespace(disposition=Flag.default), SimpleNamespace(disposition=Flag.attached_pic)
    old, int_cover = SimpleNamespace(), SimpleNamespace(disposition=0x401)  # PyAV 14.0; an IntFlag
    container = SimpleNamespace(streams=SimpleNamespace(video=[film, cover, old, int_cover]))
    assert video_streams(container) == [film, old]


def test_lost_mpeg_ts_packets_are_said_and_do_not_shift_the_times_after_them(tmp_path, small_folder, capsys):
    """40 packets cut from a 6 s MPEG-TS: frames after them were timed 1 s, then 2 s late (the
    last at 7.9 s), without a word; zeroed bytes lost 6 frames without a word."""
    full = tmp_path / "full.ts"
    ffmpeg("-f", "lavfi", "-i", "testsrc=s=96x64:r=30:d=6", "-c:v", "libx264", "-g", "30", "-pix_fmt", "yuv420p",
           "-f", "mpegts", str(full))
    data = full.read_bytes()
    n = len(data) // 188
    gap = tmp_path / "gap.ts"
    gap.write_bytes(data[: 188 * (n // 2)] + data[188 * (n // 2 + 40):])
    pts, error = times(gap)
    assert pts[-1] == pytest.approx(5.967, abs=0.002) and max(pts) < 6.0
    assert error.endswith("data lost at 1 point (or files joined there): frames may be missing, or show decoding "
                          "damage until the next keyframe")
    assert main(["video", str(gap), "--every-n", "90", "-o", str(tmp_path / "gap.jsonl"), "--model", str(small_folder),
                 "--max-tokens", "2"]) == 0  # said, not a failure: every frame there was decoded
    assert "data lost at 1 point" in capsys.readouterr().err
    assert times(full) == (pytest.approx([i / 30 for i in range(180)], abs=1e-3), None)


@pytest.mark.parametrize("ext", ["mp4", "mp3"])
def test_an_audio_file_with_a_cover_picture_is_no_video(tmp_path, small_folder, capsys, ext):
    """Read as a one-frame video at 90000 fps (a 1 ms subtitle of the album art); `live` looped it."""
    ffmpeg("-f", "lavfi", "-i", "testsrc=s=64x48", "-frames:v", "1", str(tmp_path / "cover.png"))
    song = tmp_path / f"song.{ext}"
    ffmpeg("-f", "lavfi", "-i", "sine=d=2", "-i", str(tmp_path / "cover.png"), "-map", "0:a", "-map", "1",
           "-c:v", "png" if ext == "mp4" else "mjpeg", "-disposition:v:0", "attached_pic", str(song))
    with pytest.raises(SourceError, match=r"has no video stream \(only a cover picture\)"):
        FileSource(song)
    for command in ("video", "live"):
        assert main([command, str(song), "--model", str(small_folder), "--max-tokens", "2"]) == 2
        assert capsys.readouterr().err.strip().endswith("has no video stream (only a cover picture)")


def test_live_says_what_is_wrong_with_a_file_as_video_does(tmp_path, small_folder, capsys):
    """`live cut.mp4` played the frames there were and said nothing of the rest."""
    whole = tmp_path / "whole.mp4"
    ffmpeg("-f", "lavfi", "-i", "testsrc=s=96x64:r=30:d=3", "-c:v", "libx264", "-pix_fmt", "yuv420p",
           "-movflags", "+faststart", str(whole))
    cut = tmp_path / "cut.mp4"
    data = whole.read_bytes()
    cut.write_bytes(data[: len(data) * 2 // 3])  # the first 2 s or so
    with FileSource(cut) as src:
        for _ in src.frames(need_rgb=lambda i: False):
            pass
        said = src.error
    assert said
    assert main(["live", str(cut), "--duration", "1.5", "--model", str(small_folder), "--max-tokens", "2"]) == 0
    warnings = [x for x in capsys.readouterr().err.splitlines() if x.startswith("vlmstream: warning: ")]
    assert len(warnings) == 1 and warnings[0].startswith(f"vlmstream: warning: {cut}: ")
