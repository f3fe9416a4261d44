"""Video sources, sinks and batch captioning on generated media."""

import json
import os
import re
import time
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

from app.cli import main
from engine import Engine, EngineConfig, SamplingParams
from pipelines.batch import Sampling, caption_file
from pipelines.sinks import FrameResult, JsonlSink, SubtitleSink, done_frames
from pipelines.sources import FileSource, SourceError


def _frame(i: int, w: int, h: int) -> np.ndarray:
    img = np.zeros((h, w, 3), np.uint8)
    img[:, : max(1, (i * 7) % w)] = (200, 40, 40)
    img[: h // 2, :, 2] = 180
    return img


def write_video(path: Path, codec: str, n: int = 12, size=(64, 48), fps: int = 10, pix_fmt: str = "yuv420p",
                pts: list[int] | None = None, time_base=None) -> Path:
    import av

    w, h = size
    with av.open(str(path), mode="w") as c:
        s = c.add_stream(codec, rate=fps)
        s.width, s.height, s.pix_fmt = w, h, pix_fmt
        if time_base:
            s.time_base = s.codec_context.time_base = time_base
        for i in range(n):
            f = av.VideoFrame.from_ndarray(_frame(i, w, h), format="rgb24")
            f.pts = pts[i] if pts else i
            if time_base:
                f.time_base = time_base
            for p in s.encode(f):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    return path


@pytest.mark.parametrize("name, codec, pix_fmt, size", [
    ("a.mp4", "libx264", "yuv420p", (64, 48)),
    ("b.mkv", "mpeg4", "yuv420p", (64, 48)),
    ("c.webm", "libvpx-vp9", "yuv420p", (64, 48)),
    ("odd.mkv", "libx264", "yuv444p", (333, 251)),
])
def test_file_sources_decode_every_frame(tmp_path, name, codec, pix_fmt, size):
    import av

    if codec not in av.codecs_available:
        pytest.skip(f"{codec} not in this PyAV build")
    path = write_video(tmp_path / name, codec, pix_fmt=pix_fmt, size=size)
    with FileSource(path) as src:
        frames = list(src.frames())
        assert src.error is None
    assert [f.index for f in frames] == list(range(12))
    assert all(f.rgb.shape == (size[1], size[0], 3) and f.rgb.dtype == np.uint8 for f in frames)
    assert frames[3].pts == pytest.approx(0.3, abs=1e-6)


def test_a_raw_h264_stream_keeps_its_own_frame_rate(tmp_path):
    """A camera's export as a bare .h264/.h265 stream stores no timestamps: frame times come from
    the rate. FFmpeg's raw demuxer says 25 fps whatever the stream says (its SPS): a 10 fps
    camera's file had its times 2.5x too early, and `live` played it 2.5x fast."""
    import shutil
    import subprocess

    ffmpeg = shutil.which("ffmpeg")
    assert ffmpeg, "ffmpeg is missing: the README's test command installs it"
    mp4 = write_video(tmp_path / "cam.mp4", "libx264")  # 12 frames at 10 fps
    raw = tmp_path / "cam.h264"
    subprocess.run([ffmpeg, "-y", "-loglevel", "error", "-i", str(mp4), "-c", "copy", "-bsf:v", "h264_mp4toannexb",
                    str(raw)], check=True)
    with FileSource(raw) as src:
        assert src.fps == pytest.approx(10.0)
        frames = list(src.frames())
        assert src.error is None and src.seconds == pytest.approx(1.2)
    assert [round(f.pts, 6) for f in frames] == [round(i / 10, 6) for i in range(12)]
    # a stream that states nonsense (90000 fps: every frame at 0 s) gets FFmpeg's guess instead
    bogus = tmp_path / "bogus.h264"
    subprocess.run([ffmpeg, "-y", "-loglevel", "error", "-i", str(mp4), "-c", "copy", "-bsf:v",
                    "h264_mp4toannexb,h264_metadata=tick_rate=180000/1", str(bogus)], check=True)
    with FileSource(bogus) as src:
        assert 1 <= src.fps <= 60 and list(src.frames())[-1].pts > 0.1


def test_variable_frame_rate_keeps_timestamps(tmp_path):
    pts = [0, 40, 100, 110, 300, 330, 700]
    path = write_video(tmp_path / "vfr.mkv", "libx264", n=len(pts), pts=pts, time_base=Fraction(1, 1000))
    with FileSource(path) as src:
        got = [round(f.pts, 3) for f in src.frames()]
    assert got == [p / 1000 for p in pts]


def test_sampling_modes():
    frames = [type("F", (), {"index": i, "pts": i / 30})() for i in range(90)]
    assert [f.index for f in Sampling().select(frames)] == list(range(90))
    assert [f.index for f in Sampling(every_n=30).select(frames)] == [0, 30, 60]
    assert [f.index for f in Sampling(fps=2).select(frames)] == [0, 15, 30, 45, 60, 75]


def test_a_source_converts_only_the_frames_picked(tmp_path, monkeypatch):
    import av

    pts = [0, 40, 100, 110, 300, 330, 700, 760, 1000]  # variable frame rate: fps picks by time
    path = write_video(tmp_path / "vfr.mkv", "libx264", n=len(pts), pts=pts, time_base=Fraction(1, 1000))
    with FileSource(path) as src:
        every = list(src.frames())
    converted = []
    real = av.VideoFrame.to_ndarray
    monkeypatch.setattr(av.VideoFrame, "to_ndarray", lambda self, **kw: converted.append(1) or real(self, **kw))
    for sampling in (Sampling(fps=4), Sampling(every_n=3), Sampling()):
        converted.clear()
        with FileSource(path) as src:
            picked = list(src.frames(pick=sampling.picker()))
            assert src.decoded == len(pts)
        expected = list(sampling.select(every))
        assert [(f.index, f.pts) for f in picked] == [(f.index, f.pts) for f in expected]
        assert all(np.array_equal(a.rgb, b.rgb) for a, b in zip(picked, expected))
        assert len(converted) == len(expected) < len(pts) or sampling == Sampling()
    assert [f.index for f in Sampling(fps=4).select(every)] == [0, 4, 6, 7, 8]  # at or after 0, .25, .5, .75, 1 s


def test_fps_sampling_takes_the_first_frame_at_or_after_each_slot():
    """Slots at t0 + k / fps; each picks the first frame at or after it, and a frame stands for
    every slot it is past. Checked against exact fractions; and a rate far above the video's takes
    every frame at once (it stepped a period at a time: --fps 1e9 took 25 s on a 1 s clip, and at
    1e20 the period fell below the float spacing of pts and it never ended)."""

    def exact(fps, times):
        fps, picked, first, slot = Fraction(fps), [], None, None
        for i, pts in enumerate(map(Fraction, times)):
            if first is None:
                first = slot = pts
            if pts >= slot:
                slot = first + ((pts - first) * fps // 1 + 1) / fps  # the first slot after this frame
                picked.append(i)
        return picked

    rng = np.random.default_rng(5)
    for fps in (0.5, 3, 4, 7.3, 29.97, 60, 250):
        # whole numbers of milliseconds, away from the slots' boundaries by more than 1e-6 s
        times = (np.cumsum(rng.choice([17, 33, 40, 100, 2500], size=300)) / 1000 + 1e-4).tolist()
        pick = Sampling(fps=fps).picker()
        assert [i for i, t in enumerate(times) if pick(i, t)] == exact(fps, times), fps
    # an MPEG-TS frame 0.3 us early (its start time rounded to the microsecond) is on time
    pick = Sampling(fps=2).picker()
    assert [i for i, t in enumerate([0.0, 0.4666664, 0.4999997, 0.5333331]) if pick(i, t)] == [0, 2]
    times = [i / 30 for i in range(300)] + [3600 + i / 30 for i in range(30)]
    t0 = time.perf_counter()
    pick = Sampling(fps=1e6).picker()
    assert all(pick(i, t) for i, t in enumerate(times)) and time.perf_counter() - t0 < 1


@pytest.mark.parametrize("make, needle", [
    (lambda p: None, "not found"),
    (lambda p: p.write_bytes(b""), "empty"),
    (lambda p: p.write_text("just text, no video"), "not a readable video"),
])
def test_bad_files(tmp_path, make, needle):
    path = tmp_path / "x.mp4"
    make(path)
    with pytest.raises(SourceError, match=needle):
        FileSource(path)


def test_an_mp4_without_its_index_says_it_may_be_recording(tmp_path):
    """An MP4 whose index comes last (a recording still being written, or one cut off before it
    ends) was FFmpeg's bare "Invalid data found when processing input", as for any junk."""
    whole = write_video(tmp_path / "whole.mp4", "libx264", n=20).read_bytes()
    assert whole[4:8] == b"ftyp" and whole.rfind(b"moov") > len(whole) // 2
    (tmp_path / "rec.mp4").write_bytes(whole[: len(whole) // 2])
    (tmp_path / "junk.mp4").write_bytes(b"\x00\x01junk" * 100)
    with pytest.raises(SourceError, match=r"Invalid data .* \(an MP4 without its index: a recording still being "
                                          r"written, or one cut off before its end\)$"):
        FileSource(tmp_path / "rec.mp4")
    with pytest.raises(SourceError) as e:
        FileSource(tmp_path / "junk.mp4")
    assert str(e.value).endswith("Invalid data found when processing input")


@pytest.mark.parametrize("name", ["users.txt", "notes.nfo", "x.ans", "list.ffconcat"])
def test_text_is_not_read_as_a_video(tmp_path, name):
    """FFmpeg draws text of a few hundred bytes named .txt, .nfo, .ans ... as frames (its tty
    demuxer): a web UI user played the server's --auth-file and read its passwords in the picture.
    A playlist of other files (concat) is refused too."""
    clip = Path(__file__).resolve().parents[1] / "sample_videos" / "cuts_640x360_30fps.mp4"
    path = tmp_path / name
    if name.endswith(".ffconcat"):  # files beside it (FFmpeg refuses absolute names in one)
        (tmp_path / "clip.mp4").write_bytes(clip.read_bytes())
        path.write_text("ffconcat version 1.0\nfile 'clip.mp4'\n")
    else:
        path.write_text("alice:correct-horse-battery-staple\n" * 40)
    what = "a list of other files (ffconcat)" if name.endswith(".ffconcat") else "text"
    with pytest.raises(SourceError, match=f"^{re.escape(str(path))} is not a readable video: FFmpeg reads it as "
                                          f"{re.escape(what)}$"):
        FileSource(path)


def test_a_truncated_file_gives_every_frame_its_decoder_threads_made(tmp_path):
    """PyAV ends its drain at the first frame the decoder says is damaged (a truncated file's last
    packet): the frames the other decoder threads held after it were lost, 240 of the 242 that
    FFmpeg, or one thread, gives of this cut sample."""
    sample = Path(__file__).resolve().parents[1] / "sample_videos" / "cuts_640x360_30fps.mp4"
    cut = tmp_path / "cut.mp4"
    cut.write_bytes(sample.read_bytes()[:60_000])
    with FileSource(cut, threads=False) as one:
        alone = list(one.frames())
    with FileSource(cut) as src:  # frame threads, as batch jobs read
        threaded = list(src.frames())
    assert len(alone) > 200 and [(f.index, f.pts) for f in threaded] == [(f.index, f.pts) for f in alone]
    assert all(np.array_equal(a.rgb, b.rgb) for a, b in zip(alone[-4:], threaded[-4:]))
    assert f"after {len(alone)} of the 480 frames" in src.error


def test_a_truncated_file_read_in_one_thread_says_it_was_cut_short(tmp_path):
    """`live FILE` reads in one decoder thread, where a truncated file's last packet is rejected:
    the only warning had been "1 damaged packets skipped" (its 238 missing frames unsaid, and the
    file not incomplete), where `video`, with decoder threads, says the file ended early."""
    sample = Path(__file__).resolve().parents[1] / "sample_videos" / "cuts_640x360_30fps.mp4"
    cut = tmp_path / "cut.mp4"
    cut.write_bytes(sample.read_bytes()[:60_000])
    with FileSource(cut, threads=False) as one:
        frames = list(one.frames(lazy=True))
    assert one.damaged == 1 and one.incomplete
    assert "decoding ended" in one.error and "truncated" in one.error and "1 damaged packet" in one.error
    assert 200 < len(frames) < 300 and f"at {frames[-1].pts + 1 / 30:.1f} s of the 16.0 s" in one.error


def test_audio_only_file(tmp_path):
    import av

    path = tmp_path / "a.wav"
    with av.open(str(path), "w") as c:
        s = c.add_stream("pcm_s16le", rate=8000)
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 800), np.int16), format="s16", layout="mono")
        frame.sample_rate = 8000
        for p in s.encode(frame):
            c.mux(p)
        for p in s.encode():
            c.mux(p)
    with pytest.raises(SourceError, match="no video stream"):
        FileSource(path)


def test_truncated_file_yields_what_decodes_and_says_it_ended_early(tmp_path):
    path = write_video(tmp_path / "t.mkv", "mpeg4", n=40)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) * 2 // 3])
    with FileSource(path) as src:
        frames = list(src.frames())
    assert 5 < len(frames) < 40
    assert f"ended at {len(frames) / 10:.1f} s of the 4.0 s" in src.error and "truncated" in src.error and src.incomplete
    # an MP4 whose index comes first (as the samples are written) and whose data is cut off
    sample = Path(__file__).resolve().parents[1] / "sample_videos" / "cuts_640x360_30fps.mp4"
    cut = tmp_path / "cut.mp4"
    cut.write_bytes(sample.read_bytes()[:60_000])
    with FileSource(cut) as src:
        frames = list(src.frames())
    assert 0 < len(frames) < 480 and f"after {len(frames)} of the 480 frames" in src.error
    # a short clip cut the same way (40 frames announced, its index first): said, though only ~18 are missing
    import subprocess

    short = tmp_path / "short.mp4"
    subprocess.run(["ffmpeg", "-loglevel", "error", "-i", str(write_video(tmp_path / "s.mkv", "libx264", n=40)), "-c",
                    "copy", "-movflags", "+faststart", str(short)], check=True, timeout=60)
    short.write_bytes(short.read_bytes()[: short.stat().st_size * 8 // 10])
    with FileSource(short) as src:
        frames = list(src.frames())
    assert 10 < len(frames) < 35 and f"after {len(frames)} of the 40 frames" in src.error and src.incomplete
    with FileSource(sample) as src:  # a whole file says nothing
        assert sum(1 for _ in src.frames()) == 480 and src.error is None and not src.incomplete
    # nor does a clip cut without re-encoding: its edit list hides the frames back to the keyframe
    # before its start, which its container still counts (360 of them here, 315 shown)
    trimmed = tmp_path / "trimmed.mp4"
    subprocess.run(["ffmpeg", "-loglevel", "error", "-ss", "5.5", "-i", str(sample), "-c", "copy", str(trimmed)],
                   check=True, timeout=60)
    with FileSource(trimmed) as src:
        assert src.frame_count == 315 and sum(1 for _ in src.frames(need_rgb=lambda i: False)) == 315
        assert src.error is None
    # nor do an MKV of variable frame rate (slowed to a third after 2 s) and one whose video starts
    # 7 s in: their durations' worth of frames at the average rate made "decoding ended after 480
    # of the 1038 (690) frames" and exit 1 for complete files; a cut MKV is still said to be cut
    vfr, late = tmp_path / "vfr.mkv", tmp_path / "late.mkv"
    subprocess.run(["ffmpeg", "-loglevel", "error", "-f", "lavfi", "-t", "4", "-i", "testsrc=size=64x48:rate=30",
                    "-vf", "setpts='if(lt(N,60),PTS,PTS*3-2*60/30/TB)'", "-fps_mode", "vfr", "-c:v", "libx264",
                    "-preset", "ultrafast", str(vfr)], check=True, timeout=60)
    subprocess.run(["ffmpeg", "-loglevel", "error", "-itsoffset", "7", "-i", str(vfr), "-c", "copy", str(late)],
                   check=True, timeout=60)
    for path in (vfr, late):
        with FileSource(path) as src:
            assert sum(1 for _ in src.frames(need_rgb=lambda i: False)) == 120 and src.error is None, src.error
    data = late.read_bytes()
    late.write_bytes(data[: len(data) // 2])
    with FileSource(late) as src:
        assert sum(1 for _ in src.frames(need_rgb=lambda i: False)) < 100 and "s its container announces" in src.error


def test_a_raw_dv_file_plays_at_its_frame_rate(tmp_path):
    """A camcorder tape's capture (raw DV): FFmpeg gave its stream an "average" rate of 60000
    fps, its time base's, for 25: a progress bar to 120000 frames, and its subtitles and
    annotated video ended where the last frame processed began."""
    import subprocess

    dv = tmp_path / "tape.dv"
    subprocess.run(["ffmpeg", "-loglevel", "error", "-f", "lavfi", "-i", "testsrc=size=720x576:rate=25", "-frames:v",
                    "10", "-c:v", "dvvideo", "-pix_fmt", "yuv420p", "-f", "dv", str(dv)], check=True, timeout=60)
    with FileSource(dv) as src:
        assert (src.fps, src.frame_count) == (25.0, 10)
        assert [round(f.pts, 2) for f in src.frames(need_rgb=lambda i: False)] == [i / 25 for i in range(10)]
    # NTSC's: 30 frames at 30000/1001 fps, 1.001 s to the microsecond, were 29.999999 frames, said as 29
    subprocess.run(["ffmpeg", "-loglevel", "error", "-y", "-f", "lavfi", "-i", "testsrc=size=720x480:rate=30000/1001",
                    "-frames:v", "30", "-c:v", "dvvideo", "-pix_fmt", "yuv411p", "-f", "dv", str(dv)], check=True,
                   timeout=60)
    with FileSource(dv) as src:
        assert (src.frame_count, sum(1 for _ in src.frames(need_rgb=lambda i: False))) == (30, 30)


def test_frame_count_of_a_video_that_starts_after_its_sound(tmp_path):
    """An MKV or TS recording's video starts at its first keyframe, after its sound: the
    container's duration (3 s here, from the sound's start) counted a second too many, and the
    progress bar of a 60-frame video ran to 90."""
    import subprocess

    for name in ("late.mkv", "late.ts"):
        path = tmp_path / name
        subprocess.run(["ffmpeg", "-loglevel", "error", "-f", "lavfi", "-t", "3", "-i", "sine", "-itsoffset", "1",
                        "-f", "lavfi", "-t", "2", "-i", "testsrc=size=64x48:rate=30", "-map", "1:v", "-map", "0:a",
                        "-c:v", "libx264", "-preset", "ultrafast", "-c:a", "mp2", str(path)], check=True, timeout=60)
        with FileSource(path) as src:
            assert (src.frame_count, sum(1 for _ in src.frames(need_rgb=lambda i: False))) == (60, 60), name


def _parse_subs(text: str) -> list[tuple[str, str, str]]:
    return re.findall(r"(\d\d:\d\d:\d\d[,.]\d\d\d) --> (\d\d:\d\d:\d\d[,.]\d\d\d)\n(.+)", text)


@pytest.mark.parametrize("fmt", ["srt", "vtt"])
def test_subtitles_merge_and_parse_back(tmp_path, fmt):
    path = tmp_path / f"s.{fmt}"
    sink = SubtitleSink(path, fmt, frame_duration=0.5)
    for i, text in enumerate(["a red circle", "a red circle", "a blue star", "", "a blue star"]):
        sink.write(FrameResult("v", i, i * 0.5, text, [], "stop", {}))
    sink.close()
    body = path.read_text()
    assert body.startswith("WEBVTT") == (fmt == "vtt")
    sep = "," if fmt == "srt" else "."
    assert _parse_subs(body) == [
        (f"00:00:00{sep}000", f"00:00:01{sep}000", "a red circle"),
        (f"00:00:01{sep}000", f"00:00:01{sep}500", "a blue star"),
        (f"00:00:02{sep}000", f"00:00:02{sep}500", "a blue star"),
    ]


@pytest.mark.parametrize("fmt", ["srt", "vtt"])
def test_cues_past_an_hour_and_a_last_frame_at_the_stated_end(tmp_path, fmt):
    """Times past the hour carry their hours (a film's captions); a video whose stated end is its
    last frame's time (or before it) still shows that frame's answer for a frame, not 1 ms."""
    sep = "," if fmt == "srt" else "."
    path = tmp_path / f"s.{fmt}"
    sink = SubtitleSink(path, fmt, frame_duration=0.5)
    sink.write(FrameResult("v", 0, 3725.0, "a red star", [], "stop", {}))
    sink.write(FrameResult("v", 1, 3726.0, "a blue star", [], "stop", {}))
    sink.close(end=3726.0)
    assert _parse_subs(path.read_text()) == [(f"01:02:05{sep}000", f"01:02:06{sep}000", "a red star"),
                                             (f"01:02:06{sep}000", f"01:02:06{sep}500", "a blue star")]


def test_cues_are_numbered_from_one_and_timed_to_the_nearest_millisecond(tmp_path):
    """SRT's cues count 1, 2, 3 (a blank answer, which has none, takes no number); times round
    to the millisecond (a frame at 17/30 s starts at ,567), none before 0, and a cue whose next
    frame shares its time still lasts a millisecond; a last cue of several frames lasts until a
    frame after the last of them."""
    path = tmp_path / "s.srt"
    sink = SubtitleSink(path, "srt", frame_duration=0.5)
    for i, (pts, text) in enumerate([(-0.04, "a"), (round(17 / 30, 6), "b"), (round(17 / 30, 6), ""),
                                     (1.0, "c"), (1.5, "c")]):
        sink.write(FrameResult("v", i, pts, text, [], "stop", {}))
    sink.close()
    assert path.read_text() == ("1\n00:00:00,000 --> 00:00:00,567\na\n\n"
                                "2\n00:00:00,567 --> 00:00:00,568\nb\n\n"
                                "3\n00:00:01,000 --> 00:00:02,000\nc\n\n")


@pytest.mark.parametrize("fmt", ["srt", "vtt"])
def test_cue_text_cannot_end_a_cue_or_read_as_markup(tmp_path, fmt):
    """Answers are the model's (or a constraint's) text: a blank line in one ended its cue early,
    a line of "a --> b" read as a timing line, and in WebVTT "<b>" was applied and a bare & is
    not allowed."""
    path = tmp_path / f"s.{fmt}"
    sink = SubtitleSink(path, fmt, frame_duration=0.5)
    for i, text in enumerate(["a\n\nb", "x: a --> b", "<b>x & y</b>", "\n \n", "00:00:05,000 ---> 00:00:09,000 go"]):
        sink.write(FrameResult("v", i, i * 0.5, text, [], "stop", {}))
    sink.close()
    cues = path.read_text().removeprefix("WEBVTT\n\n").split("\n\n")
    texts = [cue.split("\n", 2 if fmt == "srt" else 1)[-1] for cue in cues if cue.strip()]
    if fmt == "vtt":
        assert texts == ["a\nb", "x: a --&gt; b", "&lt;b&gt;x &amp; y&lt;/b&gt;", 
                         "00:00:05,000 ---&gt; 00:00:09,000 go"]
    else:
        assert texts == ["a\nb", "x: a -> b", "<b>x & y</b>", "00:00:05,000 -> 00:00:09,000 go"]
    assert all(line.count("-->") == 1 for line in path.read_text().splitlines() if "-->" in line)
    assert len(re.findall(" --> ", path.read_text())) == 4  # the blank answer has no cue


@pytest.mark.parametrize("fmt", ["srt", "vtt"])
def test_a_line_of_spaces_in_an_answer_is_dropped_as_a_blank_one(fmt):
    """A line of spaces or tabs reads as the blank line that ends a cue in most players: the
    answer's lines after it were lost."""
    from pipelines.sinks import cue_text

    assert cue_text("a red star\n \t\non a table", fmt) == "a red star\non a table"


def test_the_last_cue_ends_a_frame_after_its_frame_or_where_the_video_ends_if_sooner(tmp_path):
    """A video that goes on past its last frame processed (a run stopped early, a damaged end)
    shows the last answer for a frame's time, not until the video's end."""
    for end, stop in ((10.0, "00:00:00,500"), (0.2, "00:00:00,200"), (None, "00:00:00,500")):
        path = tmp_path / "s.srt"
        sink = SubtitleSink(path, "srt", frame_duration=0.5)
        sink.write(FrameResult("v", 0, 0.0, "a red star", [], "stop", {}))
        sink.close(end=end)
        assert _parse_subs(path.read_text()) == [("00:00:00,000", stop, "a red star")], end


def test_batch_in_order_and_resume(tmp_path, small_folder):
    path = write_video(tmp_path / "v.mp4", "libx264", n=20)
    out = tmp_path / "o.jsonl"
    params = SamplingParams(max_tokens=4)
    with Engine(EngineConfig(model=str(small_folder))) as eng:
        with FileSource(path) as src:
            sink = JsonlSink(out)
            summary = caption_file(eng, src, [sink], {"caption": "short"}, params, Sampling(every_n=2),
                                   max_inflight=3)
            sink.close()
        rows = [json.loads(line) for line in out.read_text().splitlines()]
        assert [r["index"] for r in rows] == list(range(0, 20, 2)) and summary.frames_captioned == 10
        # the video's 2 s (20 frames at 10 fps), though the last frame processed starts at 1.8 s
        assert summary.video_seconds == pytest.approx(2.0)
        assert all(set(r) >= {"source", "index", "pts", "text", "token_ids", "timings_ms"} for r in rows)
        # an interrupted run: keep the first 4 lines, resume the rest
        out.write_text("\n".join(out.read_text().splitlines()[:4]) + "\n{\"broken")
        done = done_frames(out)
        assert len(done) == 4
        with FileSource(path) as src:
            sink = JsonlSink(out)
            s2 = caption_file(eng, src, [sink], {"caption": "short"}, params, Sampling(every_n=2), done=done)
            sink.close()
        assert s2.frames_skipped == 4 and s2.frames_captioned == 6
    again = [json.loads(line) for line in out.read_text().splitlines() if line.endswith("}")]
    assert sorted(r["index"] for r in again) == list(range(0, 20, 2))
    assert {(r["index"], tuple(r["token_ids"])) for r in again} == {(r["index"], tuple(r["token_ids"])) for r in rows}


def test_resume_holds_each_source_model_and_prompt_of_its_answers_once(tmp_path):
    """A resumed run holds every answer of its JSONL: each line's own copy of the file's path, the
    model's and the prompt came to 2.3 KB a line (2.7 GB for a 10-hour video at 30 fps)."""
    import tracemalloc

    path = tmp_path / "out.jsonl"
    with open(path, "w") as f:
        for i in range(2000):
            for prompt in ({"caption": "normal"}, {"question": "Is the door open?"}):
                f.write(FrameResult("/videos/front-door/recording-0001.mp4", i, i / 30, "a red circle", [5, 6, 7],
                                    "stop", {"total": 12.5}, prompt, "/models/moondream2").to_json() + "\n")
    tracemalloc.start()
    try:
        done = done_frames(path)
        held = tracemalloc.get_traced_memory()[0] / len(done)
    finally:
        tracemalloc.stop()
    assert len(done) == 4000
    assert len({id(r.source) for r in done.values()}) == len({id(r.model) for r in done.values()}) == 1
    assert len({id(r.prompt) for r in done.values()}) == len({id(k[2]) for k in done}) == 2
    assert held < 1000, held  # bytes an answer: ~730 (~1200 with a copy of each in every line)


def test_resume_reads_what_a_killed_run_left_and_redoes_what_it_cut(tmp_path):
    """A whole last line without its newline counted as done, and the sink then dropped it: that
    answer was lost. A line cut inside a multi-byte character was a UnicodeDecodeError traceback,
    an index of 1e999 an OverflowError; lines that are no answer are now counted in a warning."""

    def line(i: int, text: str = "a red star") -> bytes:
        return json.dumps({"source": "v.mp4", "index": i, "pts": i / 10, "text": text, "caption": "short"},
                          ensure_ascii=False).encode() + b"\n"

    for tail in (line(4)[:-1], line(4, "un café")[:-4]):  # whole but no newline; cut inside the é
        out = tmp_path / "o.jsonl"
        out.write_bytes(line(0) + b"\n" + b"garbage\n" + line(1) + b'{"source": "v.mp4", "index": 1e999}\n'
                        + line(2, "un café") + tail)
        warnings: list[str] = []
        done = done_frames(out, warn=warnings.append)
        assert sorted(k[1] for k in done) == [0, 1, 2] and [r.text for r in done.values() if r.index == 2] == ["un café"]
        assert warnings == [f"{out}: 2 line(s) that are not answers skipped"]
        JsonlSink(out).close()  # what --resume opens: the cut tail goes, frame 4 is asked again
        assert out.read_bytes().endswith(line(2, "un café"))
    # a JSONL with nothing to skip is resumed without a word
    out.write_bytes(line(0) + line(1))
    warnings.clear()
    assert len(done_frames(out, warn=warnings.append)) == 2 and warnings == []


def test_a_cut_last_line_goes_however_long_and_wherever_it_starts(tmp_path):
    """What --resume opens: a killed run's JSONL whose only line was cut kept it, and the next
    run's first line was appended to it (one line that is no JSON); a cut line longer than the
    64 KB read at a time was kept where the block before it ended in a newline."""
    whole = b'{"source": "v.mp4", "index": 0, "pts": 0.0, "text": "a red star"}\n'
    cases = [(b'{"source": "v.mp4", "ind', b""), (whole + b'{"text": "' + b"x" * (65536 - 10), whole)]
    for data, kept in cases:
        out = tmp_path / "o.jsonl"
        out.write_bytes(data)
        sink = JsonlSink(out)
        sink.write(FrameResult("v.mp4", 1, 0.1, "a blue star", [], "stop", {}, {"caption": "short"}))
        sink.close()
        assert out.read_bytes().startswith(kept) and len(done_frames(out)) == 1 + bool(kept)


def test_each_answer_is_in_the_files_once_written_not_at_close(tmp_path):
    """A run killed (SIGKILL, out of memory, power lost) never closes its outputs: what it had
    answered must be in them already, for --resume to keep."""
    out, srt = tmp_path / "o.jsonl", tmp_path / "o.srt"
    sink, subs = JsonlSink(out), SubtitleSink(srt, "srt", frame_duration=0.5)
    try:
        for i, text in enumerate(["a red star", "a blue star"]):
            r = FrameResult("v.mp4", i, i * 0.5, text, [], "stop", {}, {"caption": "short"})
            sink.write(r)
            subs.write(r)
        assert out.read_text() == "".join(FrameResult("v.mp4", i, i * 0.5, t, [], "stop", {}, {"caption": "short"})
                                          .to_json() + "\n" for i, t in enumerate(["a red star", "a blue star"]))
        assert _parse_subs(srt.read_text()) == [("00:00:00,000", "00:00:00,500", "a red star")]  # the cue done
    finally:
        sink.close()
        subs.close()


def test_jsonl_lines_are_utf8_text_each_ending_in_a_bare_newline(tmp_path):
    """Answers are read by people and by line-based tools: an answer's accents and scripts are
    written as UTF-8, not \\u escapes, and each line ends in "\\n" alone (a "\\r" before it
    stays in the last field that `cut`, `awk` or a `split("\\n")` hands on)."""
    out = tmp_path / "o.jsonl"
    sink = JsonlSink(out)
    sink.write(FrameResult("café.mp4", 0, 0.0, "un café, 会議", [1], "stop", {}, {"caption": "short"}))
    sink.write(FrameResult("café.mp4", 1, 0.5, "a red star", [2], "stop", {}, {"caption": "short"}))
    sink.close()
    data = out.read_bytes()
    assert "un café, 会議".encode() in data and b"\\u" not in data and b"\r" not in data
    assert data.count(b"\n") == 2 and data.endswith(b"\n")
    assert [json.loads(x)["text"] for x in data.decode().split("\n")[:-1]] == ["un café, 会議", "a red star"]


def test_a_run_that_does_not_resume_leaves_none_of_the_old_files_lines(tmp_path):
    """Without --resume the outputs start afresh: a shorter new file had ended in the old one's
    last lines and cues."""
    old = FrameResult("v.mp4", 0, 0.0, "an old answer " * 20, [], "stop", {}, {"caption": "short"})
    out, srt = tmp_path / "o.jsonl", tmp_path / "o.srt"
    out.write_text((old.to_json() + "\n") * 5)
    srt.write_text("1\n00:00:00,000 --> 00:00:09,000\nan old cue\n\n" * 5)
    sink, subs = JsonlSink(out, append=False), SubtitleSink(srt, "srt", frame_duration=0.5)
    new = FrameResult("v.mp4", 0, 0.0, "new", [], "stop", {}, {"caption": "short"})
    sink.write(new)
    subs.write(new)
    sink.close()
    subs.close()
    assert out.read_text() == new.to_json() + "\n"
    assert srt.read_text() == "1\n00:00:00,000 --> 00:00:00,500\nnew\n\n"


def test_a_jsonl_of_the_answers_that_changed_cannot_be_resumed(tmp_path):
    """--changes writes only the answers that changed: resumed, every frame in between was asked
    again and appended after them, out of order."""
    from engine.errors import VlmstreamError

    out = tmp_path / "changes.jsonl"
    first = FrameResult("v.mp4", 0, 0.0, "a red star", [], "stop", {}, {"caption": "short"}).to_dict()
    changed = {**first, "index": 30, "pts": 1.0, "text": "a blue star", "previous": "a red star", "since": 0.0}
    out.write_text(json.dumps(first) + "\n" + json.dumps(changed) + "\n")
    with pytest.raises(VlmstreamError, match="--changes"):
        done_frames(out)
    out.write_text(json.dumps(first) + "\n")  # a line of every frame's JSONL is read
    assert len(done_frames(out)) == 1


def test_resume_finds_a_file_however_its_path_is_spelt(tmp_path, small_folder, capsys, monkeypatch):
    """Lines name their source as it was typed: resumed as ./v.mp4 (or with the absolute path),
    every frame was asked again and appended a second time."""
    write_video(tmp_path / "v.mp4", "libx264", n=12)
    monkeypatch.chdir(tmp_path)
    cmd = ["--model", str(small_folder), "--every-n", "3", "--max-tokens", "2", "-o", "o.jsonl"]
    assert main(["video", "v.mp4", *cmd]) == 0
    first = (tmp_path / "o.jsonl").read_text()
    for spelt in ("./v.mp4", str(tmp_path / "v.mp4")):
        capsys.readouterr()
        assert main(["video", spelt, *cmd, "--resume"]) == 0
        err = capsys.readouterr().err
        assert "4 skipped (resume)" in err and (tmp_path / "o.jsonl").read_text() == first
        assert "does not pick" not in err  # the same rate: every answer in the JSONL is this run's
    # resumed from another folder: the lines' source (clips/v.mp4) is found from the JSONL's folder
    (tmp_path / "clips").mkdir()
    write_video(tmp_path / "clips" / "v.mp4", "libx264", n=12)
    assert main(["video", "clips/v.mp4", *cmd[:-1], "c.jsonl"]) == 0
    lines = (tmp_path / "c.jsonl").read_text()
    monkeypatch.chdir(tmp_path / "clips")
    capsys.readouterr()
    assert main(["video", "v.mp4", *cmd[:-1], "../c.jsonl", "--resume"]) == 0
    assert "4 skipped (resume)" in capsys.readouterr().err and (tmp_path / "c.jsonl").read_text() == lines
    # the first run named it ../v.mp4 from clips/: its lines are found from the folder above too
    assert main(["video", "../v.mp4", *cmd[:-1], "up.jsonl"]) == 0
    lines = (tmp_path / "clips" / "up.jsonl").read_text()
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    assert main(["video", "v.mp4", *cmd[:-1], "clips/up.jsonl", "--resume"]) == 0
    assert "4 skipped (resume)" in capsys.readouterr().err and (tmp_path / "clips" / "up.jsonl").read_text() == lines
    # resumed with another rate: frames 0 and 6 are done, 3 and 9 are not this run's, and it says so
    assert main(["video", "v.mp4", *cmd[:2], "--every-n", "2", *cmd[4:], "--resume"]) == 0
    err = capsys.readouterr().err
    assert "2 skipped (resume)" in err and "the JSONL also holds answers for 2 frames this run does not pick" in err


def test_a_resume_that_cannot_find_its_videos_lines_says_so(tmp_path, small_folder, capsys, monkeypatch):
    """A first run from ~/work (`video clips/v.mp4 -o ~/out/o.jsonl`) resumed from elsewhere with
    the video's full path: the lines' clips/v.mp4 leads nowhere from here or from the JSONL's
    folder, so every frame is asked again and appended a second time, and nothing said so (a
    10-hour file: hours, and a JSONL holding it twice). A warning says it at the start. Another
    video resumed into the same JSONL, as a log of several, is no such case."""
    (tmp_path / "work" / "clips").mkdir(parents=True)
    (tmp_path / "out").mkdir()
    clip = write_video(tmp_path / "work" / "clips" / "v.mp4", "libx264", n=6)
    other = write_video(tmp_path / "work" / "w.mp4", "libx264", n=6)
    out = tmp_path / "out" / "o.jsonl"
    cmd = ["--model", str(small_folder), "--every-n", "3", "--max-tokens", "2", "-o", str(out), "--resume"]
    monkeypatch.chdir(tmp_path / "work")
    assert main(["video", "clips/v.mp4", *cmd]) == 0
    capsys.readouterr()
    assert main(["video", str(clip), *cmd]) == 0  # from where the first ran: found
    assert "warning" not in capsys.readouterr().err
    monkeypatch.chdir(tmp_path)
    assert main(["video", str(other), *cmd]) == 0  # another video into the same log
    assert "warning" not in capsys.readouterr().err
    assert main(["video", str(clip), *cmd]) == 0
    err = capsys.readouterr().err
    assert (f"vlmstream: warning: {out} holds answers for clips/v.mp4, not for {clip} (the same video under "
            "another path? a relative one is read from where the first run ran): its frames are asked again") in err


def test_folders_with_odd_links_and_outputs_are_said_before_the_run(tmp_path, capsys, monkeypatch):
    """Each was a traceback, a file destroyed, or a run that worked once and then never again."""
    root = tmp_path / "clips"
    root.mkdir()
    write_video(root / "a.avi", "mpeg4", n=3)
    (root / "loop1.mp4").symlink_to("loop2.mp4")  # a link loop: resolve() raised RuntimeError
    (root / "loop2.mp4").symlink_to("loop1.mp4")
    bad = ["--model", "/no/such/model"]  # every check comes before the model loads
    assert main(["video", str(root / "loop1.mp4"), *bad]) == 2
    assert "video not found" in capsys.readouterr().err
    # annotated videos put among the inputs were read as inputs by the next run (which refused)
    assert main(["video", str(root), *bad, "--annotate", f"{root}/"]) == 2
    assert f"--annotate {root} is an input folder" in capsys.readouterr().err
    # a hard link to the input is the input: it was overwritten by its annotated copy
    os.link(root / "a.avi", tmp_path / "hard.mp4")
    assert main(["video", str(root / "a.avi"), *bad, "--annotate", str(tmp_path / "hard.mp4")]) == 2
    assert "would overwrite the input" in capsys.readouterr().err
    # a video beside the input, named as its annotated copy would be: clip.mov's replaced clip.mp4
    (tmp_path / "beside").mkdir()
    write_video(tmp_path / "beside" / "clip.mov", "mpeg4", n=2)
    write_video(tmp_path / "beside" / "clip.mp4", "mpeg4", n=3)
    before = (tmp_path / "beside" / "clip.mp4").read_bytes()
    assert main(["video", str(tmp_path / "beside" / "clip.mov"), *bad, "--annotate", f"{tmp_path / 'beside'}/"]) == 2
    assert "is a video vlmstream did not write" in capsys.readouterr().err
    assert (tmp_path / "beside" / "clip.mp4").read_bytes() == before
    # our own annotated copy (a second run, a --resume) is written over, as is one a kill cut short
    from app.outputs import _someone_elses_video
    from pipelines.annotated import AnnotatedVideoSink

    ours = AnnotatedVideoSink(tmp_path / "ours.mp4", 64, 48)
    ours.write_image(np.zeros((48, 64, 3), np.uint8), "a red circle", "#0", 0.0)
    ours.close()
    (tmp_path / "cut.mp4").write_bytes(before[: len(before) // 2])
    assert [_someone_elses_video(tmp_path / n) for n in ("ours.mp4", "cut.mp4", "beside/clip.mp4")] == [False, False, True]
    # an output name longer than a file name may be: found when the file's outputs were opened
    long = root / ("x" * 251 + ".mp4")
    write_video(long, "mpeg4", n=2)
    (tmp_path / "out").mkdir()  # existing: asking it about the long name raised ENAMETOOLONG
    assert main(["video", str(long), *bad, "-o", f"{tmp_path / 'out'}/"]) == 2
    assert "its name is longer than 255 bytes" in capsys.readouterr().err
    long.unlink()
    # --snapshots the same path as -o: its folder was made, then -o failed on it
    assert main(["video", str(root / "a.avi"), *bad, "--changes", "--snapshots", str(tmp_path / "o.jsonl"),
                 "-o", str(tmp_path / "o.jsonl")]) == 2
    assert "-o's file" in capsys.readouterr().err and not (tmp_path / "o.jsonl").exists()


def test_snapshots_of_a_file_above_are_not_hidden(tmp_path, small_folder, monkeypatch):
    """../g2.mp4's snapshots were named .._g2_0000000.jpg: hidden, `ls` showed none."""
    write_video(tmp_path / "v.mp4", "libx264", n=6)
    (tmp_path / "run").mkdir()
    monkeypatch.chdir(tmp_path / "run")
    assert main(["video", "../v.mp4", "--model", str(small_folder), "--max-tokens", "2", "--every-n", "3",
                 "--changes", "--snapshots", "shots", "-o", "o.jsonl"]) == 0
    names = [p.name for p in (tmp_path / "run" / "shots").iterdir()]
    assert names and all(n.startswith("v.mp4_") for n in names), names


def test_a_sampled_frames_cue_lasts_until_the_next_sample_or_the_end(tmp_path, small_folder):
    """Every 5th frame of a 1.5 s clip at 10 fps: the last answer (1.0 s) stands until the
    clip ends at 1.5 s; its cue ended a frame after it (1.1 s), and one sampled every 0.5 s of a
    16 s clip at 15.53 s. A cue never runs past the video."""
    path = write_video(tmp_path / "v.mp4", "libx264", n=15)
    for args, last_end in ((["--every-n", "5"], "00:00:01,500"), (["--fps", "4"], "00:00:01,500"),
                           (["--every-n", "1"], "00:00:01,500")):
        srt = tmp_path / "o.srt"
        assert main(["video", str(path), "--model", str(small_folder), *args, "--max-tokens", "2",
                     "-o", str(srt)]) == 0
        cues = _parse_subs(srt.read_text())
        assert cues[-1][1] == last_end and all(a < b for a, b, _ in cues), (args, cues)
    assert Sampling(fps=4).period(10) == 0.25 and Sampling(fps=50).period(10) == 0.1
    assert Sampling(every_n=5).period(10) == 0.5 and Sampling().period(None) == 1 / 30


def test_video_cli(tmp_path, small_folder, capsys):
    path = write_video(tmp_path / "v.mp4", "libx264", n=15)
    srt, mp4 = tmp_path / "o.srt", tmp_path / "o.mp4"
    rc = main(["video", str(path), "--model", str(small_folder), "--every-n", "5", "-o", str(srt),
               "--annotate", str(mp4), "--max-tokens", "3"])
    assert rc == 0
    assert len(_parse_subs(srt.read_text())) >= 1
    import av

    with av.open(str(mp4)) as c:
        s = c.streams.video[0]
        assert s.codec_context.name == "h264" and s.codec_context.pix_fmt == "yuv420p"
        assert sum(1 for _ in c.decode(s)) == 3
        # as long as the video (15 frames at 10 fps): the last sample shows until its end (it
        # lasted a millisecond, so the copy was 1.001 s long)
        assert c.duration / 1e6 == pytest.approx(1.5, abs=0.002)
    assert main(["video", str(tmp_path / "missing.mp4")]) == 2
    assert main(["video", str(path), "-o", str(tmp_path / "x.txt")]) == 2
    assert "error" in capsys.readouterr().err


def test_answers_on_the_terminal_say_their_file_time_and_prompt(tmp_path, small_folder, capsys):
    """Without -o the answers are printed as they come: each line says its file (when there are
    several), its frame's time and (with several prompts) which prompt it answers."""
    a = write_video(tmp_path / "a.mp4", "libx264", n=3)
    b = write_video(tmp_path / "b.mkv", "mpeg4", n=3)
    assert main(["video", str(a), str(b), "--model", str(small_folder), "--max-tokens", "2", "--every-n", "2",
                 "--caption", "short", "--question", "Is there a star?"]) == 0
    lines = capsys.readouterr().out.splitlines()
    said = sorted(re.match(r"^(a\.mp4|b\.mkv)  +(\d+\.\d{3})  (short caption|Is there a star\?): ", line).groups()
                  for line in lines)
    assert said == sorted((name, pts, prompt) for name in ("a.mp4", "b.mkv") for pts in ("0.000", "0.200")
                          for prompt in ("short caption", "Is there a star?"))
    assert main(["video", str(a), "--model", str(small_folder), "--max-tokens", "2", "--every-n", "2"]) == 0
    assert [line[:11] for line in capsys.readouterr().out.splitlines()] == ["    0.000  ", "    0.200  "]


def test_answers_on_the_terminal_tell_files_of_one_name_apart(tmp_path, small_folder, capsys):
    """Cameras name their files alike in dated folders (DCIM/100/clip.mp4, DCIM/101/clip.mp4): the
    lines of both said "clip.mp4", so which answer was whose could not be told. A name two files
    share is shown as the path given, as `live` does; a name of its own stays short."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = write_video(tmp_path / "a" / "clip.mp4", "libx264", n=3)
    b = write_video(tmp_path / "b" / "clip.mp4", "libx264", n=3)
    c = write_video(tmp_path / "c.mp4", "libx264", n=3)
    assert main(["video", str(a), str(b), str(c), "--model", str(small_folder), "--max-tokens", "2",
                 "--every-n", "3"]) == 0
    names = sorted(re.match(r"^(.*?)  +0\.000  ", line)[1] for line in capsys.readouterr().out.splitlines())
    assert names == sorted([str(a), str(b), "c.mp4"])
    assert main(["video", str(a), str(b), str(c), "--detect", "star", "--model", str(small_folder),
                 "--every-n", "3"]) == 0  # --detect's lines too
    names = sorted(re.match(r"^(.*?)  +0\.000  star: ", line)[1] for line in capsys.readouterr().out.splitlines())
    assert names == sorted([str(a), str(b), "c.mp4"])


def test_a_video_the_annotating_encoder_refuses_fails_alone(tmp_path, small_folder, capsys):
    """A frame wider than x264 takes (17000 px: a stitched panorama) made opening the annotated
    MP4's encoder fail with av.ExternalError, which no one caught: a traceback, the run ended,
    the other videos' in-flight answers lost. As a full disk is, it is that video's outputs that
    fail, said in a line, while the others finish (exit 1)."""
    folder = tmp_path / "in"
    folder.mkdir()
    write_video(folder / "a.mp4", "libx264", n=6)
    write_video(folder / "wide.mkv", "ffv1", n=2, size=(17000, 16), pix_fmt="yuv420p")
    out, ann = tmp_path / "out", tmp_path / "ann"
    assert main(["video", str(folder), "--model", str(small_folder), "--max-tokens", "2", "-o", f"{out}/",
                 "--annotate", f"{ann}/"]) == 1
    err = capsys.readouterr().err
    assert f"{folder / 'wide.mkv'}: cannot write {ann / 'wide.mp4'}: the H.264 encoder" in err, err[-600:]
    assert len((out / "a.jsonl").read_text().splitlines()) == 6


def test_video_json_lines_on_standard_output(tmp_path, small_folder, capsys):
    path = write_video(tmp_path / "v.mp4", "libx264", n=9)
    cmd = ["video", str(path), "--model", str(small_folder), "--every-n", "3", "--max-tokens", "3", "-o", "-"]
    assert main(cmd) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]  # nothing else on stdout
    assert [r["index"] for r in rows] == [0, 3, 6] and all(r["caption"] == "short" for r in rows)
    assert main(cmd + ["--resume"]) == 2
    assert "not -o -" in capsys.readouterr().err


def test_sigint_keeps_results_and_resume_finishes(tmp_path, small_folder):
    import os
    import signal
    import subprocess
    import sys
    import time

    # Long enough (~9 s here) that a slowed test process still interrupts the run midway: with 400
    # frames (~4.5 s), twice under coverage the run had finished before the Ctrl-C came (exit 0).
    n = 800
    path = write_video(tmp_path / "long.mp4", "libx264", n=n)
    out = tmp_path / "o.jsonl"
    exe = Path(sys.executable).with_name("vlmstream")
    cmd = [str(exe), "video", str(path), "--model", str(small_folder), "-o", str(out), "--max-tokens", "24"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while time.time() < deadline and (not out.exists() or len(out.read_text().splitlines()) < 10):
        time.sleep(0.05)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 130 and "interrupted" in err and "Traceback" not in err
    kept = [json.loads(line) for line in out.read_text().splitlines()]
    assert 10 <= len(kept) < n and [r["index"] for r in kept] == list(range(len(kept)))
    assert f"vlmstream: {len(kept)} frames captioned, 0 skipped (resume), 1 file(s)" in err  # what was written
    done = subprocess.run(cmd + ["--resume"], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["index"] for r in rows) == list(range(n))


def test_several_files_at_once_into_one_jsonl(tmp_path, small_folder):
    a = write_video(tmp_path / "a.mp4", "libx264", n=18)
    b = write_video(tmp_path / "b.mkv", "mpeg4", n=12)
    out = tmp_path / "both.jsonl"
    assert main(["video", str(a), str(b), "--model", str(small_folder), "--every-n", "2", "-o", str(out),
                 "--max-tokens", "3"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    by_source = {}
    for r in rows:
        by_source.setdefault(Path(r["source"]).name, []).append(r["index"])
    assert by_source == {"a.mp4": list(range(0, 18, 2)), "b.mkv": list(range(0, 12, 2))}
    assert main(["video", str(a), str(a)]) == 2


def test_videos_whose_container_gives_no_frame_count(tmp_path, small_folder, capsys):
    """A raw H.264 stream (an IP camera's export) announces no frame count, so its progress bar
    has no total: asking such a bar for its truth value raised TypeError in tqdm after the first
    answer, alone or in a folder of more files than run side by side (one bar over all)."""
    raw = write_video(tmp_path / "cam.h264", "libx264", n=5)
    from pipelines.sources import FileSource

    with FileSource(raw) as src:
        assert src.frame_count is None
    out = tmp_path / "one.jsonl"
    assert main(["video", str(raw), "--model", str(small_folder), "--max-tokens", "2", "-o", str(out)]) == 0
    assert [json.loads(line)["index"] for line in out.read_text().splitlines()] == list(range(5))
    for i in range(4):
        write_video(tmp_path / f"clip{i}.mp4", "libx264", n=3)
    out = tmp_path / "all.jsonl"
    assert main(["video", str(tmp_path), "--model", str(small_folder), "--max-tokens", "2", "-o", str(out)]) == 0
    assert len(out.read_text().splitlines()) == 5 + 4 * 3  # the folder scan picks .h264 files up too
    err = capsys.readouterr().err
    assert "Traceback" not in err
    # the folder's bar keeps a total (the files that say theirs) and ends at every frame read:
    # one file without a count had taken the total, and the ETA, off the whole folder's bar
    assert re.search(r"5 files:\s+0%.*\b0/12\b", err) and re.search(r"5 files: 100%.*\b17/17\b", err), err


def test_a_folder_is_every_video_under_it(tmp_path, small_folder, capsys):
    root = tmp_path / "clips"
    (root / "day2").mkdir(parents=True)
    (root / ".cache").mkdir()
    write_video(root / "a.mp4", "libx264", n=6)
    write_video(root / "day2" / "b.MKV", "mpeg4", n=4)
    write_video(root / ".cache" / "c.mp4", "libx264", n=3)  # hidden folder: not the user's videos
    (root / "notes.txt").write_text("not a video")
    (root / "day2" / "broken.mp4").write_bytes(b"not a video either")
    out = tmp_path / "all.jsonl"
    cmd = ["video", str(root), str(root / "a.mp4"), "--model", str(small_folder), "-o", str(out), "--max-tokens", "2"]
    assert main(cmd) == 1  # the rest is done and written, but not everything: a script sees it
    err = capsys.readouterr().err
    assert "warning: skipped: " in err and "broken.mp4" in err and "Traceback" not in err
    assert "1 unreadable skipped" in err
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    by_source = {}
    for r in rows:
        by_source.setdefault(r["source"], []).append(r["index"])
    # a.mp4 named and found in the folder is captioned once
    assert by_source == {str(root / "a.mp4"): list(range(6)), str(root / "day2" / "b.MKV"): list(range(4))}
    assert main(cmd + ["--resume"]) == 1
    assert len(out.read_text().splitlines()) == len(rows)
    assert "10 skipped (resume)" in capsys.readouterr().err
    # a clip cut off (a copy still running, a camera's power lost): what it holds is captioned,
    # and the run says it is not all (exit 1), as for the unreadable one
    data = (root / "a.mp4").read_bytes()
    whole = write_video(tmp_path / "b40.mkv", "mpeg4", n=40).read_bytes()
    (root / "day2" / "b.MKV").write_bytes(whole[: len(whole) * 2 // 3])
    cut = tmp_path / "cut.jsonl"
    assert main(["video", str(root / "a.mp4"), str(root / "day2" / "b.MKV"), "--model", str(small_folder),
                 "-o", str(cut), "--max-tokens", "2"]) == 1
    assert re.search(r"b.MKV: decoding ended at \d\.\d s of the 4\.0 s its container announces", capsys.readouterr().err)
    assert 6 + 20 < len(cut.read_text().splitlines()) < 6 + 40 and (root / "a.mp4").read_bytes() == data
    # the broken file named on its own is the user's mistake, not a skip
    assert main(["video", str(root / "day2" / "broken.mp4"), "--model", str(small_folder)]) == 2
    (tmp_path / "none").mkdir()
    (tmp_path / "none" / "readme.txt").write_text("")
    assert main(["video", str(tmp_path / "none")]) == 2
    err = capsys.readouterr().err
    assert "no video files in" in err and err.count("\n") == 2  # the broken file's line, this one


def test_a_folder_of_dvd_tape_and_broadcast_videos(tmp_path):
    """A DVD's .VOB, a tape's .dv capture, a broadcast camera's .mxf, an old camera's .asf were
    not video extensions: a folder of them was "no video files"."""
    import subprocess

    from pipelines.sources import video_files

    for name, codec, size in [("VTS_01_1.VOB", "mpeg2video", "64x48"), ("tape.dv", "dvvideo", "720x576"),
                              ("cam.mxf", "mpeg2video", "64x48"), ("old.asf", "wmv2", "64x48")]:
        subprocess.run(["ffmpeg", "-loglevel", "error", "-f", "lavfi", "-i", f"testsrc=size={size}:rate=25",
                        "-frames:v", "5", "-c:v", codec, "-pix_fmt", "yuv420p", str(tmp_path / name)],
                       check=True, timeout=60)
    found = video_files(tmp_path)
    assert sorted(p.name for p in found) == ["VTS_01_1.VOB", "cam.mxf", "old.asf", "tape.dv"]
    for path in found:
        with FileSource(path) as src:
            assert sum(1 for _ in src.frames(need_rgb=lambda i: False)) == 5 and src.error is None, path


def test_a_subfolder_that_cannot_be_listed_is_said_not_left_out(tmp_path, small_folder, capsys, locked_folders):
    """Its videos had been left out without a word and the run exited 0; the folder named itself
    said 'no video files in' it."""
    root = tmp_path / "clips"
    (root / "locked").mkdir(parents=True)
    write_video(root / "a.mp4", "libx264", n=3)
    write_video(root / "locked" / "b.mp4", "libx264", n=3)
    out = tmp_path / "out.jsonl"
    assert main(["video", str(root), "--model", str(small_folder), "-o", str(out), "--max-tokens", "2"]) == 1
    err = capsys.readouterr().err
    assert f"warning: skipped: cannot read the folder {root / 'locked'}: Permission denied" in err
    assert "1 unreadable skipped" in err and len(out.read_text().splitlines()) == 3
    assert main(["video", str(root / "locked"), "--model", "/no/such/model"]) == 2
    assert capsys.readouterr().err == f"vlmstream: error: cannot read the folder {root / 'locked'}: Permission denied\n"


def test_a_second_run_into_the_same_outputs_is_refused_not_spliced_in(tmp_path, small_folder, capsys):
    """Two runs into one JSONL (or folder) each cut it at its start and wrote over the other's
    lines: lines lost, others spliced into lines that were no JSON, and both said done (exit 0)."""
    import fcntl

    def writing(path: Path):  # another run, writing it
        f = open(path, "a")
        fcntl.flock(f, fcntl.LOCK_EX)
        return f

    clip = write_video(tmp_path / "clip.mp4", "libx264", n=3)
    out = tmp_path / "out.jsonl"
    out.write_text('{"kept": 1}\n')
    bad = ["--model", "/no/such/model"]  # said before the model loads
    other = writing(out)
    try:
        assert main(["video", str(clip), "-o", str(out), *bad]) == 2
        assert capsys.readouterr().err == (f"vlmstream: error: {out} is being written by another vlmstream run: "
                                           "wait for it to end, or write elsewhere\n")
        with pytest.raises(OSError, match="being written by another"):  # one started at the same moment: as it opens
            JsonlSink(out, append=False)
        assert out.read_text() == '{"kept": 1}\n'
        srt = tmp_path / "subs" / "clip.srt"
        srt.parent.mkdir()
        with writing(srt):
            assert main(["video", str(clip), "-o", f"{srt.parent}/", "--format", "srt", *bad]) == 2
            assert f"{srt} is being written by another vlmstream run" in capsys.readouterr().err
    finally:
        other.close()
    assert main(["video", str(clip), "-o", str(out), "--model", str(small_folder), "--max-tokens", "2"]) == 0
    assert len(out.read_text().splitlines()) == 3


def test_more_files_than_run_at_once_share_one_bar(tmp_path, small_folder, capsys):
    from app.video import CONCURRENT_FILES

    n = CONCURRENT_FILES + 2
    for i in range(n):
        write_video(tmp_path / f"v{i}.mp4", "libx264", n=3)
    out = tmp_path / "o.jsonl"
    assert main(["video", str(tmp_path), "--model", str(small_folder), "-o", str(out), "--max-tokens", "2"]) == 0
    err = capsys.readouterr().err
    assert f"{n} files" in err and f"files_done={n}" in err and "v0.mp4:" not in err
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted((Path(r["source"]).name, r["index"]) for r in rows) == [(f"v{i}.mp4", j) for i in range(n) for j in range(3)]


def test_short_files_at_a_low_fps_run_more_side_by_side():
    """Sticky answers at a low --fps: a short file holds a frame or two in flight, and four of them
    left the engine's batches a quarter full; long files, every frame or --sticky 0 keep four."""
    from app.video_run import CONCURRENT_FILES, MAX_FILES_SIDE_BY_SIDE, files_side_by_side

    short, long_ = [60, 90, None], [60, 9000]
    assert files_side_by_side(Sampling(fps=1), SamplingParams(sticky=2), short) == MAX_FILES_SIDE_BY_SIDE
    assert CONCURRENT_FILES < files_side_by_side(Sampling(fps=15), SamplingParams(sticky=2), short) < MAX_FILES_SIDE_BY_SIDE
    for sampling, sticky, counts in ((Sampling(fps=1), 2, long_), (Sampling(fps=1), 0, short), (Sampling(), 2, short),
                                     (Sampling(every_n=30), 2, short), (Sampling(fps=30), 2, short),
                                     (Sampling(fps=1), 2, [None])):
        assert files_side_by_side(sampling, SamplingParams(sticky=sticky), counts) == CONCURRENT_FILES


def test_a_run_waits_for_its_files_on_one_event():
    """The main thread's poll: set once every file's future is done, however it ended."""
    from concurrent.futures import Future

    from app.video_run import _AllDone

    assert _AllDone([]).is_set()
    futures = [Future() for _ in range(3)]
    done = _AllDone(futures)
    futures[0].set_result(1)
    futures[1].set_exception(ValueError("broken"))
    assert not done.wait(timeout=0)
    assert futures[2].cancel()
    assert done.wait(timeout=0)


def test_short_files_at_a_low_fps_are_captioned_side_by_side(tmp_path, small_folder, monkeypatch):
    """More than CONCURRENT_FILES short clips at --fps 1 all run at once, with the answers of one
    file at a time."""
    import threading

    from app.video_run import CONCURRENT_FILES, VideoRun

    n = CONCURRENT_FILES + 2
    clips = tmp_path / "clips"
    clips.mkdir()
    for i in range(n):
        write_video(clips / f"v{i}.mp4", "libx264", n=12, fps=10)
    for i in range(n):
        assert main(["video", str(clips / f"v{i}.mp4"), "--model", str(small_folder), "--fps", "1",
                     "--max-tokens", "4", "-o", str(tmp_path / f"{i}.jsonl")]) == 0
    together = threading.Barrier(n, timeout=20)
    met: list[bool] = []
    process = VideoRun.process

    def meeting(self, i, path):
        try:
            together.wait()
            met.append(True)
        except threading.BrokenBarrierError:  # fewer workers than files: the first ones waited alone
            met.append(False)
        return process(self, i, path)

    monkeypatch.setattr(VideoRun, "process", meeting)
    out = tmp_path / "o.jsonl"
    assert main(["video", str(clips), "--model", str(small_folder), "--fps", "1", "--max-tokens", "4",
                 "-o", str(out)]) == 0
    assert met == [True] * n

    def answers(path):
        return sorted((Path(r["source"]).name, r["index"], r["token_ids"])
                      for r in map(json.loads, path.read_text().splitlines()))

    assert answers(out) == sorted(a for i in range(n) for a in answers(tmp_path / f"{i}.jsonl"))


def _frames_in(path: Path) -> int:
    import av

    with av.open(str(path)) as c:
        return sum(1 for _ in c.decode(c.streams.video[0]))


def test_a_folder_gives_each_video_its_own_outputs(tmp_path, small_folder, capsys):
    root = tmp_path / "clips"
    (root / "day2").mkdir(parents=True)
    write_video(root / "a.mp4", "libx264", n=6)
    write_video(root / "day2" / "b.mkv", "mpeg4", n=4)
    out, ann = tmp_path / "subs", tmp_path / "ann"
    cmd = ["video", str(root), "--model", str(small_folder), "--max-tokens", "2", "-o", f"{out}/",
           "--format", "srt,jsonl", "--annotate", f"{ann}/"]
    assert main(cmd) == 0
    assert "outputs in" in capsys.readouterr().err
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*.*")) == [
        "a.jsonl", "a.srt", "day2/b.jsonl", "day2/b.srt"]
    for name, n in (("a", 6), ("day2/b", 4)):
        rows = [json.loads(line) for line in (out / f"{name}.jsonl").read_text().splitlines()]
        assert [r["index"] for r in rows] == list(range(n))
        assert {r["source"] for r in rows} == {str(next(root.glob(name + ".*")))}
        assert _parse_subs((out / f"{name}.srt").read_text())
        assert _frames_in(ann / f"{name}.mp4") == n
    def answers(name):
        return [(r["index"], r["token_ids"]) for r in map(json.loads, (out / name).read_text().splitlines())]

    first = answers("a.jsonl")
    assert main(cmd) == 0  # a second run without --resume writes afresh, not twice
    assert len((out / "a.jsonl").read_text().splitlines()) == 6
    # -o the input folder: subtitles beside their videos, where players look for them
    assert main(["video", str(root), "--model", str(small_folder), "--max-tokens", "2", "-o", str(root),
                 "--format", "vtt"]) == 0
    assert (root / "a.vtt").read_text().startswith("WEBVTT") and (root / "day2" / "b.vtt").exists()
    capsys.readouterr()
    # an annotated folder inside the input folder is not read back as input
    assert main(["video", str(root), "--model", str(small_folder), "--max-tokens", "2", "-o", f"{out}/",
                 "--annotate", f"{root}/annotated/"]) == 0
    assert main(["video", str(root), "--model", str(small_folder), "--max-tokens", "2", "-o", f"{out}/",
                 "--annotate", f"{root}/annotated/"]) == 0
    assert "2 file(s)" in capsys.readouterr().err and answers("a.jsonl") == first
    # an output that cannot be written fails its file, with a line saying why; the others go on
    blocked = tmp_path / "blocked"
    blocked.mkdir()
    (blocked / "day2").write_text("a file where b's subfolder would go")
    assert main(["video", str(root), "--model", str(small_folder), "--max-tokens", "2", "-o", f"{blocked}/"]) == 1
    err = capsys.readouterr().err
    assert f"b.mkv: cannot write {blocked / 'day2'}: " in err and "Traceback" not in err
    assert len((blocked / "a.jsonl").read_text().splitlines()) == 6
    # mistakes, each one line and exit 2 before the model loads
    write_video(root / "a.mkv", "mpeg4", n=2)  # a.mp4's outputs' names
    for bad, says in [
        (["-o", f"{out}/"], "both write"),
        (["--annotate", str(root)], "is an input folder"),
        (["-o", str(tmp_path / "one.srt")], "-o FOLDER/ --format srt"),
        (["--annotate", str(tmp_path / "one.mp4")], "--annotate FOLDER/"),
        (["-o", f"{out}/", "--format", "srt,mp3"], "--format takes"),
        (["-o", str(tmp_path / "one.jsonl"), "--format", "srt"], "--format goes with -o FOLDER/"),
        (["-o", f"{out}/", "--format", "srt", "--resume"], "--resume needs"),
        (["-o", str(tmp_path / "missing" / "one.jsonl")], "no folder"),
        (["-o", f"{out}/", "--annotate", str(tmp_path / "one")], "--annotate must end in .mp4"),
        (["-o", f"{tmp_path / 'dirs'}/"], "it is a folder"),  # dirs/a.jsonl/ exists: exit 1 after the run
    ]:
        (tmp_path / "dirs" / "a.jsonl").mkdir(parents=True, exist_ok=True)
        assert main(["video", str(root), "--model", "/no/such/model", *bad]) == 2, bad
        err = capsys.readouterr().err
        assert says in err and err.count("\n") == 1, (bad, err)


def test_resume_rebuilds_subtitles_and_annotation_from_the_jsonl(tmp_path, small_folder, capsys):
    path = write_video(tmp_path / "v.mp4", "libx264", n=12)
    out = tmp_path / "out"
    cmd = ["video", str(path), "--model", str(small_folder), "--max-tokens", "3", "-o", f"{out}/",
           "--format", "jsonl,srt", "--annotate", f"{out}/"]
    assert main(cmd) == 0
    def answers(path):
        return [(r["index"], r["pts"], r["token_ids"]) for r in map(json.loads, path.read_text().splitlines())]

    whole_srt, lines = (out / "v.srt").read_text(), (out / "v.jsonl").read_text().splitlines()
    first = answers(out / "v.jsonl")
    (out / "v.jsonl").write_text("\n".join(lines[:5]) + "\n")  # as an interrupted run leaves it
    (out / "v.srt").write_text("")
    (out / "v.mp4").unlink()
    assert main(cmd + ["--resume"]) == 0
    assert "7 frames captioned, 5 skipped (resume)" in capsys.readouterr().err
    assert answers(out / "v.jsonl") == first and (out / "v.jsonl").read_text().splitlines()[:5] == lines[:5]
    assert (out / "v.srt").read_text() == whole_srt
    assert _frames_in(out / "v.mp4") == 12
    # the same with one JSONL and one annotated file
    one, mp4 = tmp_path / "one.jsonl", tmp_path / "one.mp4"
    one.write_text("\n".join(lines[:3]) + "\n")
    assert main(["video", str(path), "--model", str(small_folder), "--max-tokens", "3", "-o", str(one),
                 "--annotate", str(mp4), "--resume"]) == 0
    assert _frames_in(mp4) == 12 and answers(one) == first


def test_several_prompts_per_frame_share_its_image_and_resume_answer_by_answer(tmp_path, small_folder, capsys):
    path = write_video(tmp_path / "v.mp4", "libx264", n=8)
    base = ["video", str(path), "--model", str(small_folder), "--max-tokens", "3", "--every-n", "2"]
    prompts = [("caption", "normal"), ("question", "How many shapes are there?"), ("question", "Is there a star?")]

    def answers(jsonl: Path) -> dict:
        return {(r["index"], next(k for k in ("caption", "question") if k in r), r.get("caption") or r["question"]):
                r["token_ids"] for r in map(json.loads, jsonl.read_text().splitlines())}

    # each prompt on its own: the reference the shared runs must equal
    alone = {}
    for i, (key, value) in enumerate(prompts):
        one = tmp_path / f"alone-{i}.jsonl"
        assert main(base + [f"--{key}", value, "-o", str(one)]) == 0
        alone.update(answers(one))
    out = tmp_path / "out"
    cmd = base + ["--caption", "normal", "--question", prompts[1][1], "--question", prompts[2][1],
                  "-o", f"{out}/", "--format", "jsonl,srt", "--annotate", f"{out}/"]
    assert main(cmd) == 0
    lines = (out / "v.jsonl").read_text().splitlines()
    assert len(lines) == 4 * 3 and answers(out / "v.jsonl") == alone  # every answer, as if asked alone
    cues = [c for c in (out / "v.srt").read_text().split("\n\n") if c.strip()]
    assert cues and all(len(c.splitlines()) == 2 + 3 for c in cues)  # number, times, one line per prompt
    assert "normal caption: " in cues[0] and "Is there a star?: " in cues[0]
    assert _frames_in(out / "v.mp4") == 4
    whole_srt = (out / "v.srt").read_text()
    # interrupted in the middle of a frame: only the missing answers are asked again
    (out / "v.jsonl").write_text("\n".join(lines[:4]) + "\n")
    capsys.readouterr()
    assert main(cmd + ["--resume"]) == 0
    assert "3 frames captioned, 1 skipped (resume)" in capsys.readouterr().err
    assert answers(out / "v.jsonl") == alone and len((out / "v.jsonl").read_text().splitlines()) == 12
    assert (out / "v.srt").read_text() == whole_srt
    # a JSONL from before lines named their prompt resumes as the run's one prompt
    old = tmp_path / "old.jsonl"
    old.write_text("".join(json.dumps({k: v for k, v in json.loads(line).items() if k != "question"}) + "\n"
                           for line in (tmp_path / "alone-1.jsonl").read_text().splitlines()))
    assert main(base + ["--question", prompts[1][1], "-o", str(old), "--resume"]) == 0
    assert "0 frames captioned, 4 skipped (resume)" in capsys.readouterr().err
    for bad in (["--question", " "], ["--question", "Why?", "--question", "Why?"]):
        assert main(base + bad) == 2


def test_resume_converts_only_the_frames_it_still_asks_about(tmp_path, small_folder, monkeypatch, capsys):
    import av

    path = write_video(tmp_path / "v.mp4", "libx264", n=12)
    out = tmp_path / "o.jsonl"
    # (sticky answers look for scene cuts in every frame, so they convert every frame)
    cmd = ["video", str(path), "--model", str(small_folder), "--max-tokens", "3", "-o", str(out), "--sticky", "0"]
    assert main(cmd) == 0
    lines = out.read_text().splitlines()
    out.write_text("\n".join(lines[:5]) + "\n")
    converted = []
    real = av.VideoFrame.to_ndarray
    monkeypatch.setattr(av.VideoFrame, "to_ndarray", lambda self, **kw: converted.append(1) or real(self, **kw))
    assert main(cmd + ["--resume"]) == 0
    assert len(converted) == 7  # the five answered frames are replayed without their pixels
    assert [json.loads(x)["token_ids"] for x in out.read_text().splitlines()] == \
        [json.loads(x)["token_ids"] for x in lines]
    assert "7 frames captioned, 5 skipped (resume)" in capsys.readouterr().err


def test_zero_frame_video_is_an_error(tmp_path, small_folder, capsys):
    import av

    path = tmp_path / "empty.mkv"
    c = av.open(str(path), "w")
    s = c.add_stream("mpeg4", rate=10)
    s.width, s.height, s.pix_fmt = 64, 48, "yuv420p"
    c.start_encoding()  # header, no frame
    c.close()
    assert main(["video", str(path), "--model", str(small_folder)]) == 2
    err = capsys.readouterr().err
    assert "empty.mkv" in err and err.count("\n") == 1 and "Traceback" not in err


def test_a_read_that_fails_mid_file_keeps_its_frames_and_says_where(tmp_path, small_folder, capsys, monkeypatch):
    """The disk (or the demuxer) fails after 5 frames: those 5 are captioned, the warning says
    after how many frames decoding stopped, and the run says it is not all done (exit 1). One that
    fails at the first frame says why, not only that no frame could be decoded."""
    import pipelines.file_source

    real, fail_at = pipelines.file_source.decoded, [5]

    def decoded(*args, **kwargs):
        for i, frame in enumerate(real(*args, **kwargs)):
            if i == fail_at[0]:
                raise OSError(5, "Input/output error")
            yield frame

    monkeypatch.setattr(pipelines.file_source, "decoded", decoded)
    path = write_video(tmp_path / "v.mp4", "libx264", n=12)
    with FileSource(path) as src:
        assert [f.index for f in src.frames()] == list(range(5))
    assert src.incomplete and src.error.startswith(f"{path}: decoding stopped after 5 frames: ")
    out = tmp_path / "o.jsonl"
    cmd = ["video", str(path), "--model", str(small_folder), "--max-tokens", "2", "-o", str(out)]
    assert main(cmd) == 1
    err = capsys.readouterr().err
    assert f"warning: {path}: decoding stopped after 5 frames: " in err and "5 frames captioned" in err
    assert [json.loads(line)["index"] for line in out.read_text().splitlines()] == list(range(5))
    fail_at[0] = 0
    assert main(cmd) == 2
    assert f"error: {path}: decoding stopped after 0 frames: " in capsys.readouterr().err


def test_a_file_gone_before_its_turn_is_said_and_the_run_is_not_all_done(tmp_path, small_folder, capsys, monkeypatch):
    """A file removed (or replaced by junk) after the run checked it and before it is read: the
    other files are captioned, the lost one is said, and the exit code says the work is not all done."""
    from app.video_run import VideoRun

    a = write_video(tmp_path / "a.mp4", "libx264", n=3)
    gone = write_video(tmp_path / "b.mp4", "libx264", n=3)
    out = tmp_path / "o.jsonl"
    real = VideoRun.caption

    def caption(self, engine):
        gone.unlink()  # after the files were probed
        return real(self, engine)

    monkeypatch.setattr(VideoRun, "caption", caption)
    assert main(["video", str(a), str(gone), "--model", str(small_folder), "--max-tokens", "2", "-o", str(out)]) == 1
    err = capsys.readouterr().err
    assert "warning: video not found: " in err and "b.mp4" in err and "3 frames captioned" in err
    assert [json.loads(line)["index"] for line in out.read_text().splitlines()] == [0, 1, 2]


def test_a_frame_half_answered_is_read_again_for_its_missing_answers(tmp_path, small_folder, capsys):
    """Several prompts, a JSONL only (no output that needs every frame's pixels) cut inside a
    frame's answers: that frame is decoded again for the answers it lacks, and the run gives a
    full run's lines."""
    path = write_video(tmp_path / "v.mp4", "libx264", n=6)
    out = tmp_path / "o.jsonl"
    for sticky in ([], ["--sticky", "0"]):
        cmd = ["video", str(path), "--model", str(small_folder), "--max-tokens", "2", "--every-n", "2",
               "--caption", "short", "--question", "Is there a star?", "-o", str(out), *sticky]
        assert main(cmd) == 0
        lines = out.read_text().splitlines()
        assert len(lines) == 3 * 2
        out.write_text("\n".join(lines[:3]) + "\n")  # frame 0's two answers, frame 2's first
        capsys.readouterr()
        assert main(cmd + ["--resume"]) == 0
        assert "2 frames captioned, 1 skipped (resume)" in capsys.readouterr().err
        assert sorted(map(_answer, out.read_text().splitlines())) == sorted(map(_answer, lines))


def _answer(line: str) -> tuple:
    r = json.loads(line)
    return r["index"], r["pts"], r.get("caption") or r["question"], r["text"], r["token_ids"]


@pytest.mark.parametrize("degrees", [90, 180, 270])
def test_rotation_metadata_is_applied_as_ffmpeg_does(tmp_path, degrees):
    """Media rotated by the ffmpeg tool (Debian's, installed by .ci/run) decode upright."""
    import shutil
    import subprocess

    from PIL import Image

    ffmpeg = shutil.which("ffmpeg")
    assert ffmpeg, "ffmpeg is missing: the README's test command installs it"
    src = write_video(tmp_path / "in.mp4", "libx264", n=4, size=(64, 48))
    rotated, png = tmp_path / f"r{degrees}.mp4", tmp_path / "first.png"
    subprocess.run([ffmpeg, "-y", "-loglevel", "error", "-i", str(src), "-c", "copy",
                    "-metadata:s:v:0", f"rotate={degrees}", str(rotated)], check=True)
    subprocess.run([ffmpeg, "-y", "-loglevel", "error", "-i", str(rotated), "-frames:v", "1", str(png)], check=True)
    with FileSource(rotated) as s:
        first = next(s.frames()).rgb
    upright = np.asarray(Image.open(png).convert("RGB"))
    assert first.shape == upright.shape == ((64, 48, 3) if degrees % 180 else (48, 64, 3))
    assert np.abs(first.astype(int) - upright.astype(int)).mean() < 1.0


def _anamorphic(tmp_path: Path, scene_seed: int, stored: tuple[int, int], sar: str) -> tuple[Path, np.ndarray]:
    """A world scene drawn at 640x360, squeezed by ffmpeg to `stored` pixels that a player shows
    at 640x360 again (sample aspect ratio `sar`), and the scene as drawn."""
    import shutil
    import subprocess

    from tinyvlm.world import render, sample_scene

    ffmpeg = shutil.which("ffmpeg")
    assert ffmpeg, "ffmpeg is missing: the README's test command installs it"
    drawn = render(sample_scene(np.random.default_rng([77, scene_seed]), 640, 360))
    raw, out = tmp_path / "drawn.rgb", tmp_path / f"anamorphic_{stored[0]}x{stored[1]}.mp4"
    raw.write_bytes(drawn.tobytes())
    subprocess.run([ffmpeg, "-y", "-loglevel", "error", "-f", "rawvideo", "-pix_fmt", "rgb24", "-s", "640x360",
                    "-i", str(raw), "-vf", f"scale={stored[0]}:{stored[1]},setsar={sar}", "-c:v", "libx264",
                    "-crf", "12", "-pix_fmt", "yuv444p", str(out)], check=True)
    return out, drawn


@pytest.mark.parametrize("stored, sar", [((320, 360), "2/1"), ((640, 180), "1/2")])
def test_non_square_pixels_are_shown_at_the_display_shape(tmp_path, stored, sar):
    """DVD, DV and broadcast video store non-square pixels: a frame read as stored squeezed every
    shape (circles became ellipses) and moved nothing into the right third where a player shows it."""
    path, drawn = _anamorphic(tmp_path, 3, stored, sar)
    with FileSource(path) as s:
        first = next(s.frames()).rgb
    assert first.shape == drawn.shape == (360, 640, 3)
    # the scene as drawn, up to what the squeeze (half the pixels along one axis) and the codec lost
    assert np.abs(first.astype(int) - drawn.astype(int)).mean() < 4.0


def test_non_square_pixels_the_container_states_are_shown_too(tmp_path):
    """VP9 (and VP8, AV1) carries no pixel aspect of its own: a WebM's comes from its display
    size, and `ffmpeg -aspect 16:9 -c copy` writes only the container's. Players show it; its
    frames came as stored, squeezed."""
    import subprocess

    vp9 = write_video(tmp_path / "v.webm", "libvpx-vp9", n=3, size=(64, 48))
    # 16:9 at 48 high, to an even width: WebM keeps a whole display width (85), Matroska the ratio
    for name, width in (("wide.webm", 84), ("wide.mkv", 86)):
        subprocess.run(["ffmpeg", "-loglevel", "error", "-i", str(vp9), "-c", "copy", "-aspect", "16:9",
                        str(tmp_path / name)], check=True, timeout=60)
        with FileSource(tmp_path / name) as s:
            assert [f.rgb.shape for f in s.frames()] == [(48, width, 3)] * 3, name


def test_the_film_is_read_not_a_cover_picture_before_it(tmp_path):
    """A Matroska file may hold a cover picture (one JPEG frame) as its first video stream."""
    import av

    film = write_video(tmp_path / "film.mp4", "libx264", n=12, size=(64, 48))
    path = tmp_path / "with_cover.mkv"
    with av.open(str(film)) as src, av.open(str(path), "w") as out:
        cover = out.add_stream("mjpeg", rate=1)
        cover.width, cover.height, cover.pix_fmt = 32, 32, "yuvj420p"
        video = out.add_stream_from_template(src.streams.video[0])
        for packet in cover.encode(av.VideoFrame.from_ndarray(np.full((32, 32, 3), 200, np.uint8), format="rgb24")):
            out.mux(packet)
        for packet in cover.encode():
            out.mux(packet)
        for packet in src.demux(src.streams.video[0]):
            if packet.dts is not None:
                packet.stream = video
                out.mux(packet)
    with av.open(str(path)) as c:
        assert [s.codec_context.name for s in c.streams.video] == ["mjpeg", "h264"]
    with FileSource(path) as s:
        frames = list(s.frames())
        assert (s.fps, s.frame_count) == (10.0, 12)
    assert len(frames) == 12 and frames[0].rgb.shape == (48, 64, 3) and s.error is None


def test_a_damaged_stretch_costs_its_own_frames_not_the_rest_of_the_file(tmp_path, small_folder, capsys):
    """A bad sector, a broken SD card: the decoder rejects the damaged packets. Decoding used to
    stop at the first one (180 of the 329 frames FFmpeg's own tools decode here)."""
    clip = Path(__file__).resolve().parents[1] / "sample_videos" / "cuts_640x360_30fps.mp4"
    data = bytearray(clip.read_bytes())
    middle = len(data) // 2
    data[middle: middle + 20_000] = np.random.default_rng(0).integers(0, 256, 20_000, dtype=np.uint8).tobytes()
    path = tmp_path / "damaged.mp4"
    path.write_bytes(bytes(data))
    with FileSource(path) as s:
        frames = list(s.frames())
        assert s.damaged > 0 and "damaged packets skipped" in s.error
    assert len(frames) > 300 and [f.index for f in frames] == list(range(len(frames)))
    out = tmp_path / "out.jsonl"
    assert main(["video", str(path), "--model", str(small_folder), "--max-tokens", "2", "--every-n", "10",
                 "-o", str(out)]) == 0
    assert len(out.read_text().splitlines()) == (len(frames) + 9) // 10
    assert "damaged packets skipped" in capsys.readouterr().err


def test_a_recording_whose_clock_starts_late_or_jumps_is_timed_from_its_start(tmp_path, small_folder, capsys):
    """An MPEG-TS recording's clock starts where the camera's or the broadcast's was (an hour in,
    here): its subtitles came an hour late, and `live` waited an hour for its first frame. Two
    recordings joined end to end jump in time where they meet: `live` stopped there for the
    length of the jump."""
    import subprocess

    clip = Path(__file__).resolve().parents[1] / "sample_videos" / "cuts_640x360_30fps.mp4"
    late, second = tmp_path / "late.ts", tmp_path / "second.ts"
    for out, extra in [(late, ["-output_ts_offset", "3600"]), (second, ["-t", "1"])]:
        subprocess.run(["ffmpeg", "-loglevel", "error", "-i", str(clip), "-c", "copy", *extra, str(out)],
                       check=True, timeout=60)
    joined = tmp_path / "joined.ts"  # a second of it at its start, then the clip an hour on
    joined.write_bytes(second.read_bytes() + late.read_bytes())
    with FileSource(second) as src:
        head = sum(1 for _ in src.frames(need_rgb=lambda i: False))  # about 30: a copy cuts at a packet
    for path, n in [(late, 480), (joined, head + 480)]:
        src = FileSource(path)
        pts = [f.pts for f in src.frames(need_rgb=lambda i: False)]
        src.close()
        assert pts == pytest.approx([i / 30 for i in range(n)], abs=1e-3) and pts[0] == 0.0
        assert src.seconds == pytest.approx(n / 30, abs=1e-3)
        assert src.error is None  # the join restarts the continuity counters: no data lost there
    assert main(["video", str(late), "--every-n", "240", "-o", str(tmp_path / "late.srt"), "--model", str(small_folder),
                 "--max-tokens", "2"]) == 0
    assert (tmp_path / "late.srt").read_text().splitlines()[1] == "00:00:00,000 --> 00:00:08,000"
    for path, frames in [(late, 5), (joined, 45)]:  # the joined file's jump comes after 1 s
        assert main(["live", str(path), "--duration", "2", "--json", "--model", str(small_folder),
                     "--max-tokens", "2"]) == 0
        stats = json.loads(capsys.readouterr().out)
        # the frames the source gave in 2 s, captioned or not (on a loaded machine the feed takes fewer)
        assert stats["frames_in"] + stats["overwritten_at_grab"] + stats["above_fps"] > frames


def test_a_recording_whose_clock_jumps_is_not_said_to_be_cut_short(tmp_path):
    """A camera's clock jumping 10 minutes mid-recording stretches the container's duration
    (602 s for 2 s of frames): the jump is taken out of the times, and the duration is not read
    as a file cut short (a false "truncated" warning, and exit 1)."""
    import subprocess

    path = tmp_path / "jump.ts"
    subprocess.run(["ffmpeg", "-loglevel", "error", "-f", "lavfi", "-i", "testsrc=size=64x48:rate=30", "-frames:v", "60",
                    "-vf", "setpts='PTS+if(gte(N,30),600/TB,0)'", "-fps_mode", "passthrough", "-c:v", "libx264",
                    "-preset", "ultrafast", str(path)], check=True, timeout=60)
    with FileSource(path) as src:
        pts = [f.pts for f in src.frames(need_rgb=lambda i: False)]
    assert pts == pytest.approx([i / 30 for i in range(60)], abs=1e-3)
    assert src.error is None and not src.incomplete


def test_answers_cut_short_by_the_engine_closing_are_not_written(tmp_path, small_folder):
    """The engine closed (cancelling) under caption_file: cut-off answers ("a red star, a green
    triangle, a red ") were written as the frames' own, and --resume counted them done."""
    from engine import EngineClosedError

    path = write_video(tmp_path / "v.mp4", "libx264", n=12)
    out = tmp_path / "o.jsonl"
    eng = Engine(EngineConfig(model=str(small_folder)))
    sink = JsonlSink(out)
    closed = []

    def close_once(r):
        if not closed:
            closed.append(True)
            eng.close(cancel=True)

    with FileSource(path) as src, pytest.raises(EngineClosedError, match="was cancelled"):
        caption_file(eng, src, [sink], {"caption": "long"}, SamplingParams(max_tokens=200, ignore_eos=True),
                     Sampling(), on_frame=close_once)
    sink.close()
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows and all(r["finish_reason"] == "length" for r in rows)


def test_odd_arguments_to_the_pipeline_pieces_are_errors(tmp_path):
    from pipelines.changes import AnswerChanges
    from pipelines.annotated import AnnotatedVideoSink
    from pipelines.sources import open_live

    with pytest.raises(ValueError, match="not both"):  # every_n picked the frames, fps timed their cues
        Sampling(fps=2, every_n=3)
    for hold in (float("nan"), float("inf"), 1.5, 0, True):
        with pytest.raises(ValueError, match="hold must be an integer >= 1"):
            AnswerChanges(hold)
    for source in ("", "  "):
        with pytest.raises(SourceError, match="no source given"):  # it had said ". is a folder"
            open_live(source)
    subs = SubtitleSink(tmp_path / "a.srt", "srt", 0.5)
    subs.write(FrameResult("v", 0, 0.0, "a red star", [], "stop", {}))
    subs.close()
    with pytest.raises(ValueError, match="closed"):  # the first write after close was lost silently
        subs.write(FrameResult("v", 1, 0.5, "a blue star", [], "stop", {}))
    video = AnnotatedVideoSink(tmp_path / "a.mp4", 64, 48)
    video.write_image(np.zeros((48, 64, 3), np.uint8), "x", "y", 0.0)
    video.close(0.5)
    video.close(0.5)  # the second had raised EOFError
    assert _frames_in(tmp_path / "a.mp4") == 1


def test_a_video_run_stopped_cancels_the_frames_it_has_in_flight():
    """A stop (Ctrl-C, the web UI's Stop) ends a run at its next frame: the frames it had in
    flight are cancelled in the engine, not left to decode for nobody."""
    import threading

    from engine.types import RequestOutput
    from pipelines.batch import Sampling, caption_file
    from pipelines.sources import FileSource

    class Handle:
        def __init__(self):
            self.cancelled = 0

        def wait(self, stall=600.0):
            return RequestOutput("a red circle", [1], "stop")

        def cancel(self):
            self.cancelled += 1

    class HeldEngine:
        def __init__(self):
            self.handles = []

        def submit(self, rgb, params=None, draft=None, priority=0, **task):
            self.handles.append(Handle())
            return self.handles[-1]

    engine, stop = HeldEngine(), threading.Event()
    clip = Path(__file__).resolve().parents[1] / "sample_videos" / "cuts_640x360_30fps.mp4"
    with FileSource(str(clip)) as src, pytest.raises(KeyboardInterrupt):
        caption_file(engine, src, [], {"caption": "short"}, SamplingParams(max_tokens=4), Sampling(every_n=10),
                     max_inflight=4, on_frame=lambda r: stop.set(), stop=stop)
    # frame 0 answered (the stop comes with it), frames 1-3 in flight when the next frame is read
    assert [h.cancelled for h in engine.handles] == [0, 1, 1, 1]


def test_a_sticky_video_run_gives_back_every_page_it_took(small_folder):
    """With sticky answers a group's images are encoded ahead: each encoding is released once its
    frames are asked, or its pages stayed held after the run (the engine, shared by the web UI's
    runs, lost them for good)."""
    from pipelines.batch import Sampling, caption_file
    from pipelines.sources import FileSource

    clip = Path(__file__).resolve().parents[1] / "sample_videos" / "cuts_640x360_30fps.mp4"
    with Engine(EngineConfig(model=str(small_folder))) as eng:
        with FileSource(str(clip)) as src:
            summary = caption_file(eng, src, [], {"caption": "short"}, SamplingParams(max_tokens=4, sticky=2.0),
                                   Sampling(fps=4))
        assert summary.frames_captioned >= 16
        end = time.time() + 10
        while eng.stats().kv_pages_in_use and time.time() < end:
            time.sleep(0.01)
        assert eng.stats().kv_pages_in_use == 0


def test_a_rate_above_the_videos_groups_sticky_frames_as_every_frame_does():
    """`video --fps 120` of a 30 fps clip takes every frame, and asks them in the same groups as
    a run without --fps (a quarter second: 8 frames), so its sticky answers are the same."""
    from pipelines.batch import sticky_group

    assert sticky_group(Sampling(fps=120), 30.0, 32) == sticky_group(Sampling(), 30.0, 32) == 8


def test_the_summary_says_how_many_times_faster_than_real_time_the_run_went(tmp_path, small_folder, capsys):
    """The closing line's speed is video time over wall time: 16 s of video captioned in a few
    seconds is several times real time (inverted, it said 0.1x)."""
    clip = Path(__file__).resolve().parents[1] / "sample_videos" / "cuts_640x360_30fps.mp4"  # 16 s
    t0 = time.perf_counter()
    assert main(["video", str(clip), "--every-n", "240", "--max-tokens", "1", "-o", str(tmp_path / "a.jsonl"),
                 "--model", str(small_folder)]) == 0
    wall = time.perf_counter() - t0
    speed = float(re.search(r", ([0-9.]+)x real time", capsys.readouterr().err).group(1))
    assert 16.0 / wall - 0.1 <= speed  # the run inside main() took less than the whole call


def test_frames_the_decoder_patched_over_damage_are_a_warning(tmp_path, small_folder, capsys):
    """Damage the decoder does not reject but conceals (a few KB of a bad sector inside one
    packet): FFmpeg says "error while decoding MB", the frame comes out patched and flagged
    corrupt, and its answer may describe the damage. `video` used to say nothing at all (exit 0,
    no warning), where a rejected packet gets a warning."""
    import subprocess

    clip = Path(__file__).resolve().parents[1] / "sample_videos" / "shapes_640x360_60fps.mp4"
    path = tmp_path / "patched.mp4"
    subprocess.run(["ffmpeg", "-v", "error", "-y", "-i", str(clip), "-t", "4", "-r", "10", "-c:v", "libx264",
                    "-g", "10", "-an", str(path)], check=True)
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle: middle + 3000] = np.random.default_rng(0).integers(0, 256, 3000, dtype=np.uint8).tobytes()
    path.write_bytes(bytes(data))
    with FileSource(path) as s:
        frames = list(s.frames())
        assert s.concealed > 0 and not s.incomplete and "decoded with damage" in s.error
    assert len(frames) == 40
    out = tmp_path / "out.jsonl"
    assert main(["video", str(path), "--model", str(small_folder), "--max-tokens", "2", "--every-n", "10",
                 "-o", str(out)]) == 0
    assert len(out.read_text().splitlines()) == 4
    assert "decoded with damage" in capsys.readouterr().err


@pytest.mark.parametrize("film_first", [True, False])
def test_of_two_video_streams_the_film_is_read_whichever_comes_first(tmp_path, film_first):
    """A file may carry a second, small video stream (a camera's low-resolution proxy, a preview
    clip): a player shows the film, whatever the order of the streams."""
    import subprocess

    import av

    film = write_video(tmp_path / "film.mp4", "libx264", n=12, size=(64, 48))
    preview = write_video(tmp_path / "preview.mp4", "libx264", n=2, size=(32, 24))
    path = tmp_path / "two.mkv"
    first, second = (film, preview) if film_first else (preview, film)
    subprocess.run(["ffmpeg", "-loglevel", "error", "-y", "-i", str(first), "-i", str(second), "-map", "0:v",
                    "-map", "1:v", "-c", "copy", str(path)], check=True, timeout=60)
    with av.open(str(path)) as c:
        assert [s.codec_context.width for s in c.streams.video] == ([64, 32] if film_first else [32, 64])
    with FileSource(path) as s:
        frames = list(s.frames())
    assert len(frames) == 12 and {f.rgb.shape for f in frames} == {(48, 64, 3)}


def test_caption_file_refuses_a_malformed_task_before_reading_a_frame():
    """A task given as "short" had been a TypeError from inside Engine.submit at the first frame
    picked, after the file was opened and decoded up to it."""
    from engine import RequestError
    from pipelines.batch import Sampling, caption_file

    with pytest.raises(RequestError, match="a task is a dict such as"):
        caption_file(None, None, [], "short", SamplingParams(), Sampling(fps=1))
    with pytest.raises(RequestError, match="unknown task key 'draft'"):
        caption_file(None, None, [], [{"caption": "short", "draft": [1]}], SamplingParams(), Sampling(fps=1))


def test_the_video_summary_gives_a_slow_runs_speed_to_two_figures():
    """Moondream 2 on a CPU at --fps 0.5 ran at 0.066x real time, said "0.1x"; 0.04x was "0.0x"."""
    from app.video import speed_text

    assert [speed_text(s) for s in (0.066, 0.04, 0.5, 0.000123, 1.0, 12.34, 0.0)] == [
        "0.066", "0.040", "0.50", "0.00012", "1.0", "12.3", "0.0"]
