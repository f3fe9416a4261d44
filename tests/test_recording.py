"""`live --annotate`: a recording of the completed frames with their answers drawn; and the
annotated frames themselves (drawn once per distinct caption)."""

import json
from pathlib import Path

import av
import numpy as np
import pytest

from app.cli import main
from pipelines.annotated import _font, annotate

CLIP = Path(__file__).resolve().parents[1] / "sample_videos" / "cuts_640x360_30fps.mp4"


def _decoded(path: Path) -> tuple[list[float], list[np.ndarray]]:
    with av.open(str(path)) as c:
        frames = list(c.decode(video=0))
    return [float(f.time) for f in frames], [f.to_ndarray(format="rgb24") for f in frames]


def test_live_recording_has_every_completed_frame_at_its_capture_time(tmp_path, capsys):
    rec = tmp_path / "rec.mp4"
    assert main(["live", str(CLIP), "--duration", "3", "--question", "How many shapes are there?",
                 "--choices", "one,two,three,four", "--annotate", str(rec), "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    r = stats["recording"]
    assert r["path"] == str(rec) and r["frames"] + r["skipped"] == stats["completed"] > 20 and r["frames"] > 0
    times, frames = _decoded(rec)
    assert len(times) == r["frames"] and times == sorted(times) and times[0] == 0.0
    # the frames' capture times: about the clip's 30 fps over the 3 s (less what was dropped)
    assert 2.0 < times[-1] < 3.5 and frames[0].shape == (360, 640, 3)
    # the answer band: black with white text, and the clip's first answer ("four") drawn in it
    band = frames[0][360 - 2 * 25:360 - 25]
    assert (band < 40).mean() > 0.8 and (band > 200).any()
    assert (frames[0][:300] > 40).mean() > 0.5  # the picture itself above it


def test_live_recordings_of_several_sources_go_to_a_folder(tmp_path, capsys):
    other = tmp_path / "other clip.mp4"
    other.write_bytes(CLIP.read_bytes())
    out = tmp_path / "recordings"
    assert main(["live", str(CLIP), str(other), "--duration", "2", "--annotate", f"{out}/", "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    files = sorted(out.iterdir())
    # named by the time the run began (UTC) and the file's name
    assert sorted(f.name.split("_", 1)[1] for f in files) == ["cuts_640x360_30fps.mp4", "other_clip.mp4"]
    assert all(f.name[:8].isdigit() and f.name[8] == "T" and f.name[15] == "Z" for f in files)
    assert sorted(s["recording"]["path"] for s in stats["sources"].values()) == [str(f) for f in files]
    for s in stats["sources"].values():
        assert len(_decoded(Path(s["recording"]["path"]))[0]) == s["recording"]["frames"] > 0


def _first_seconds(path: Path, seconds: float) -> Path:
    """The clip's first seconds, as a file of their own."""
    with av.open(str(CLIP)) as src, av.open(str(path), "w") as out:
        s = out.add_stream("libx264", rate=30)
        s.width, s.height, s.pix_fmt = 640, 360, "yuv420p"
        for f in src.decode(video=0):
            if f.time >= seconds:
                break
            for p in s.encode(f.reformat(format="yuv420p")):
                out.mux(p)
        for p in s.encode():
            out.mux(p)
    return path


def test_the_recording_of_a_source_that_ended_before_the_run_ends_with_it(tmp_path, capsys):
    """Its last frame had been held to the run's end: a 1 s clip beside a 3 s one was recorded
    3 s long, two of them one frozen frame (a camera given up: hours of it)."""
    short, long = _first_seconds(tmp_path / "short.mp4", 1), _first_seconds(tmp_path / "long.mp4", 3)
    out = tmp_path / "recordings"
    assert main(["live", str(short), str(long), "--annotate", f"{out}/", "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)["sources"]
    with av.open(stats[str(short)]["recording"]["path"]) as c:
        assert float(c.duration / av.time_base) < 1.5
    with av.open(stats[str(long)]["recording"]["path"]) as c:  # one that played to the end: as long as it
        assert float(c.duration / av.time_base) > 2.5


def test_live_recording_mistakes_and_a_full_disk(tmp_path, capsys, monkeypatch):
    for args, message in [(["--annotate", str(tmp_path / "rec.avi")], "--annotate must end in .mp4"),
                          ([str(tmp_path / "x.mp4"), "--annotate", str(tmp_path / "rec.mp4")], None),
                          (["--annotate", str(tmp_path / "nowhere" / "rec.mp4")], "no folder")]:
        assert main(["live", str(CLIP), *args]) == 2
        if message:
            assert message in capsys.readouterr().err
    other = tmp_path / "x.mp4"
    other.write_bytes(CLIP.read_bytes())
    assert main(["live", str(CLIP), str(other), "--annotate", str(tmp_path / "rec.mp4")]) == 2
    assert "several sources need a folder for their recordings" in capsys.readouterr().err

    import pipelines.annotated

    def disk_full(self, *a):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(pipelines.annotated.AnnotatedVideoSink, "write_image", disk_full)
    log = tmp_path / "log.jsonl"
    assert main(["live", str(CLIP), "--duration", "20", "--annotate", str(tmp_path / "rec.mp4"), "-o", str(log)]) == 1
    assert f"error: cannot write {tmp_path / 'rec.mp4'}: No space left on device\n" in capsys.readouterr().err
    assert log.read_text().count("\n") >= 1  # the run stopped soon, its captions kept


def test_a_recording_that_replaces_an_earlier_one_says_so(tmp_path, capsys):
    """A restarted camera job continues its -o log, and its --annotate OUT.mp4 started afresh
    without a word: the earlier run's recording was lost unsaid."""
    rec = tmp_path / "rec.mp4"
    assert main(["live", str(CLIP), "--duration", "1", "--annotate", str(rec)]) == 0
    assert "warning" not in capsys.readouterr().err  # a new file: nothing to say
    assert main(["live", str(CLIP), "--duration", "1", "--annotate", str(rec)]) == 0
    assert (f"vlmstream: warning: {rec} exists and is replaced by this run's recording "
            "(--annotate FOLDER/ keeps each run's)\n") in capsys.readouterr().err


def test_a_recording_another_run_writes_is_refused_before_the_run(tmp_path, capsys):
    """As a busy log is: the second run had loaded the model, logged and saved snapshots, then
    failed at its first frame (exit 1), which a supervisor restarts for ever."""
    import fcntl

    rec, log, shots = tmp_path / "rec.mp4", tmp_path / "log.jsonl", tmp_path / "shots"
    with open(rec, "ab") as other:  # another `live` recording there now
        fcntl.flock(other, fcntl.LOCK_EX)
        assert main(["live", str(CLIP), "--duration", "3", "--annotate", str(rec), "-o", str(log),
                     "--changes", "--snapshots", str(shots)]) == 2
    assert capsys.readouterr().err == (f"vlmstream: error: {rec} is being written by another vlmstream run: "
                                       "wait for it to end, or write elsewhere\n")
    assert not log.exists() or log.read_text() == ""  # nothing ran
    assert not shots.exists() or not any(shots.iterdir())


def test_a_full_disk_ends_a_recording_with_its_error_not_the_process(tmp_path):
    """On a real full disk (/dev/full) the MP4 writer's close muxed again after the failed write
    and the process died (SIGSEGV), the web UI with every viewer's feed; PyAV also kept the
    file's descriptor. (The test above fails write_image in Python, before the muxer.)"""
    import os
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import os, sys, time, numpy as np
        from engine.types import RequestOutput
        from pipelines.frame import Frame
        from pipelines.live import LiveResult
        from pipelines.recorder import Recorder
        from pipelines.annotated import AnnotatedVideoSink
        rgb = np.random.default_rng(0).integers(0, 255, (360, 640, 3), dtype=np.uint8)
        r = Recorder(sys.argv[1])
        for k in range(60):
            r.add(LiveResult(Frame("cam", k, k / 30, rgb), [RequestOutput("a circle", [1], "stop")], 5.0,
                             [{"caption": "short"}]))
            time.sleep(0.01)
        r.close()
        print(repr(r.error), flush=True)
        for fragmented in (False, True):  # a video job's annotated MP4, and a recording's
            s = AnnotatedVideoSink(sys.argv[1], 640, 360, fragmented)
            try:
                for k in range(200):
                    s.write_image(rgb, "a circle", "#1", k / 30)
            except OSError as e:
                print("write:", e.errno, flush=True)
                try:  # a caller that goes on: told again, the encoder not fed (that was a SIGSEGV)
                    s.write_image(rgb, "a circle", "#1", 10.0)
                except OSError as again:
                    print("again:", again is e, flush=True)
            s.close()
        print("open:", sum(os.path.realpath(f"/proc/self/fd/{f}") == "/dev/full" for f in os.listdir("/proc/self/fd")))
    """)
    link = tmp_path / "rec.mp4"
    link.symlink_to("/dev/full")
    p = subprocess.run([sys.executable, "-c", code, str(link)], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0 and "Traceback" not in p.stderr, (p.returncode, p.stderr[-2000:])
    lines = p.stdout.splitlines()
    assert "No space left on device" in lines[0] and lines[1:] == ["write: 28", "again: True"] * 2 + ["open: 0"], lines


def test_every_output_is_closed_when_one_fails_to(tmp_path):
    """The web UI's video job closed its outputs one after the other: a JSONL whose close failed
    (a full disk) left the annotated MP4 after it unfinished, without its index, and its file
    held open."""
    from pipelines.annotated import AnnotatedVideoSink
    from pipelines.sinks import close_all

    class DiskFull:
        def close(self, end=None):
            raise OSError(28, "No space left on device")

    video = AnnotatedVideoSink(tmp_path / "a.mp4", 64, 48)
    video.write_image(np.zeros((48, 64, 3), np.uint8), "a circle", "#0", 0.0)
    class Gone:
        def close(self, end=None):
            raise OSError(5, "Input/output error")

    # the first failure is the one said (the one the others' failures follow from, as a rule)
    with pytest.raises(OSError, match="No space left"):
        close_all([DiskFull(), None, Gone(), video], 2.0)
    times, frames = _decoded(tmp_path / "a.mp4")
    assert times == [0.0] and len(frames) == 1


def test_a_recording_nobody_closed_is_finished_at_exit(tmp_path):
    """A Ctrl-C while `live` closed its outputs skipped the recorder's close: its daemon thread
    died with the process, and the recording lost its last second (570 of 600 frames)."""
    import os
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import sys, time, numpy as np
        from engine.types import RequestOutput
        from pipelines.frame import Frame
        from pipelines.live import LiveResult
        from pipelines.recorder import Recorder
        r = Recorder(sys.argv[1])
        for k in range(45):
            rgb = np.full((48, 64, 3), 5 * k, np.uint8)
            frame = Frame("cam", k, k / 30, rgb, captured_at=k / 30)
            r.add(LiveResult(frame, [RequestOutput("a circle", [1], "stop")], 5.0, [{"caption": "short"}]))
        time.sleep(0.5)  # queued and encoding; the process ends without close()
    """)
    path = tmp_path / "rec.mp4"
    subprocess.run([sys.executable, "-c", code, str(path)], check=True, timeout=120,
                   env={**os.environ, "OMP_NUM_THREADS": "1"})
    times, _ = _decoded(path)
    assert len(times) == 45


def _annotate_reference(rgb, text, info):
    """annotate() as first written: everything drawn with PIL onto the frame."""
    from PIL import Image, ImageDraw

    img = Image.fromarray(np.ascontiguousarray(rgb))
    draw = ImageDraw.Draw(img)
    w, h = img.size
    band = max(1, min(max(18, min(h // 14, w // 24)), h // 2))  # at most half a small frame
    font = _font(max(1, int(band * 0.7)))
    lines = []
    for answer in text.strip().splitlines() or [""]:  # words added while the line fits
        words = answer.split()
        while words:
            n = 1
            while n < len(words) and font.getlength(" ".join(words[: n + 1])) <= w - 12:
                n += 1
            lines.append(" ".join(words[:n]))
            words = words[n:]
        if not answer.split():
            lines.append("")
    lines = lines[: max(1, h // (2 * band))]
    top = h - (len(lines) + 1) * band
    draw.rectangle((0, top, w, h), fill=(0, 0, 0))
    for i, line in enumerate(lines):
        draw.text((6, top + i * band + 2), line, fill=(255, 255, 255), font=font)
    draw.text((6, h - band + 2), info, fill=(255, 220, 0), font=font)
    return np.asarray(img)


LONG = ("a large green circle in the top left, a small red star in the bottom right, a large purple square in "
        "the center and a small white triangle in the middle left, on a noisy grey background, four shapes")


@pytest.mark.parametrize("size", [(360, 640), (120, 160), (1080, 1920), (1920, 1080), (20, 30), (16, 16), (35, 48)])
def test_annotated_frames_are_drawn_as_before_with_cached_captions(size):
    rng = np.random.default_rng(size[0])
    texts = ["a red circle and a small blue star", "", "one\ntwo\nthree\n" + "x" * 300,
             "\n".join(f"question {i}: yes" for i in range(40)), LONG, "yes\n\n" + LONG]
    for _ in range(2):  # the second time from the cache
        for i, text in enumerate(texts):
            rgb = rng.integers(0, 256, (*size, 3), dtype=np.uint8)
            rgb.flags.writeable = False  # frames from PyAV may be read-only
            out = annotate(rgb, text, f"#{i} 0.500s  45 ms")
            assert out.shape == rgb.shape and np.array_equal(out, _annotate_reference(rgb, text, f"#{i} 0.500s  45 ms"))


@pytest.mark.parametrize("size", [(360, 640), (1920, 1080), (720, 1280)])
def test_a_long_caption_is_wrapped_whole_inside_the_frame(size):
    """A long caption ran off the frame's right edge ("... in the bottom ri"), and a portrait
    phone video's letters were 96 px high, 20 to the line: the rest of every caption was lost."""
    from pipelines.annotated import _wrapped

    h, w = size
    out = annotate(np.zeros((h, w, 3), np.uint8), LONG, "#1 0.033s  40 ms")
    band = max(18, min(h // 14, w // 24))
    lines = _wrapped(LONG, w, band)
    font = _font(int(band * 0.7))
    assert " ".join(lines).split() == LONG.split()  # every word, in order
    assert all(font.getlength(line) <= w - 12 for line in lines)
    assert len(lines) + 1 <= h // (2 * band)  # all shown, in at most half the frame
    assert out[h - (len(lines) + 1) * band: h - band].any()  # drawn there
    assert w > h or band <= 46  # portrait 1080 wide: about 60 characters to the line, not 20
    assert _wrapped("x" * 5000, w, band) == ("x" * 200,)  # a "word" that long is cut, as lines were


def test_a_frames_info_line_gives_its_slowest_answers_latency(tmp_path, monkeypatch):
    """A frame of several prompts is ready when its last answer is: the info line drawn on it says
    that answer's time, not the first prompt's."""
    from pipelines.annotated import AnnotatedVideoSink
    from pipelines.sinks import FrameResult

    sink = AnnotatedVideoSink(tmp_path / "a.mp4", 64, 48)
    drawn = []
    monkeypatch.setattr(sink, "write_image", lambda rgb, text, info, seconds: drawn.append((text, info, seconds)))
    answers = [FrameResult("v.mp4", 7, 0.25, text, [], "stop", {"total": ms}, {"question": q})
               for text, ms, q in (("yes", 12.4, "Is the door open?"), ("two", 48.6, "How many people?"))]
    sink.write_frame(answers, np.zeros((48, 64, 3), np.uint8))
    sink.write_frame(answers, None)  # no picture (a replayed answer): nothing to draw
    sink.close()
    assert [info for _, info, _ in drawn] == ["#7 0.250s  49 ms"] and drawn[0][2] == 0.25


def test_an_annotated_video_has_its_index_first_and_a_recording_is_fragmented(tmp_path):
    """A finished annotated MP4 starts playing in a browser before it is all downloaded only if its
    index (moov) comes before the frames; a recording is cut in fragments instead (it plays up to
    its last second however the process ends)."""
    from pipelines.annotated import AnnotatedVideoSink

    for fragmented in (False, True):
        path = tmp_path / f"{fragmented}.mp4"
        sink = AnnotatedVideoSink(path, 64, 48, fragmented)
        for i in range(3):
            sink.write_image(np.full((48, 64, 3), 60 * i, np.uint8), "a red dot", "", i / 10)
        sink.close()
        data = path.read_bytes()
        assert data.find(b"moov") < data.find(b"mdat") and (b"moof" in data) == fragmented
        assert _decoded(path)[0] == [0.0, 0.1, 0.2]


def test_a_recording_keeps_its_first_max_seconds_and_ignores_frames_after_close(tmp_path):
    from engine.types import RequestOutput
    from pipelines.live import LiveResult
    from pipelines.recorder import Recorder
    from pipelines.sources import Frame

    rgb = np.full((120, 160, 3), 90, np.uint8)
    rec = Recorder(tmp_path / "r.mp4", max_seconds=1.0)
    for i in range(40):  # 10 frames a second of capture time
        rec.add(LiveResult(Frame("cam", i, i / 10, rgb, captured_at=100.0 + i / 10), [RequestOutput("yes", [], "stop")],
                           20.0, [{"question": "Is the door open?"}]))
    rec.close()
    rec.add(LiveResult(Frame("cam", 99, 9.9, rgb, captured_at=100.5), [RequestOutput("no", [], "stop")], 20.0, []))
    times, _ = _decoded(tmp_path / "r.mp4")
    assert rec.full and rec.written == len(times) == 11 and rec.skipped == 29
    assert times == [round(i / 10, 3) for i in range(11)]


_KILLED_RECORDER = """
import sys, time
import numpy as np
from engine.types import RequestOutput
from pipelines.live import LiveResult
from pipelines.recorder import Recorder
from pipelines.sources import Frame

rec = Recorder(sys.argv[1])
for i in range(int(sys.argv[2])):  # 20 frames a second of capture time
    rgb = np.full((120, 160, 3), (i * 7) % 256, np.uint8)
    rec.add(LiveResult(Frame("cam", i, i / 20, rgb, captured_at=100.0 + i / 20), [RequestOutput("yes", [], "stop")],
                       20.0, [{"caption": "short"}]))
while rec.written < int(sys.argv[2]):
    time.sleep(0.01)
time.sleep(0.5)  # the muxer has had its chance to write what it had
print("written", flush=True)
time.sleep(60)  # killed here, before close(): a crash, the OOM killer, a power cut
"""


def test_a_recording_whose_process_was_killed_still_plays(tmp_path):
    """`live --annotate` runs for hours; a process killed before it closed its recording (SIGKILL,
    the OOM killer, a power cut) used to leave an MP4 without its index: nothing of it played."""
    import os
    import subprocess
    import sys

    path = tmp_path / "rec.mp4"
    p = subprocess.Popen([sys.executable, "-c", _KILLED_RECORDER, str(path), "100"], stdout=subprocess.PIPE,
                         text=True, cwd=Path(__file__).resolve().parents[1], env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        assert p.stdout.readline().strip() == "written"
    finally:
        p.kill()
        p.wait(30)
    times, frames = _decoded(path)
    # all but the fragment still open (a second of capture time, and what the encoder held back)
    assert 60 <= len(times) < 100 and times == [round(i / 20, 3) for i in range(len(times))]
    assert abs(int(frames[50][10, 10, 0]) - (50 * 7) % 256) < 8  # each frame is its own picture


def test_frames_of_another_size_are_fitted_whole_not_cropped(tmp_path):
    """A stream that changes resolution on the way (an HLS rendition, a camera switching streams):
    later frames were cropped to the first one's size (a quarter of a doubled frame shown)."""
    from pipelines.annotated import AnnotatedVideoSink

    sink = AnnotatedVideoSink(tmp_path / "a.mp4", 160, 120)
    first = np.full((120, 160, 3), 60, np.uint8)
    doubled = np.zeros((240, 320, 3), np.uint8)
    doubled[:120, 160:] = 250  # its top right quarter: outside a crop to the first frame's size
    wide = np.full((120, 320, 3), 200, np.uint8)  # another shape: scaled to fit, bars above and below
    for i, rgb in enumerate([first, doubled, wide]):
        sink.write_image(rgb, "", "", float(i))
    sink.close()
    _, frames = _decoded(tmp_path / "a.mp4")
    assert [f.shape for f in frames] == [(120, 160, 3)] * 3
    assert frames[1][10:50, 100:150].mean() > 200 and frames[1][10:50, 10:60].mean() < 30  # the whole frame, halved
    assert frames[2][5:25, 40:120].mean() < 30 and frames[2][40:55, 40:120].mean() > 170  # 160x60 between bars


def test_an_annotated_hd_video_says_its_colours_are_bt709_and_is_converted_so(tmp_path):
    """An annotated 1280x720 copy opened in mpv or a browser had its colours off the original's
    (a red turned orange, up to 78 of 255 off): its RGB was converted to YUV with BT.601 and the
    file named no matrix, so players took it for BT.709, their guess for HD. It is converted with
    BT.709 and says so; decoded as it says (and as BT.709), its colours are those drawn."""
    from pipelines.annotated import AnnotatedVideoSink

    rgb = np.zeros((720, 1280, 3), np.uint8)
    rgb[:, :640] = (220, 30, 30)  # a red and a green: where the two matrices differ most
    rgb[:, 640:] = (30, 200, 60)
    sink = AnnotatedVideoSink(tmp_path / "a.mp4", 1280, 720)
    sink.write_image(rgb, "", "", 0.0)
    sink.close()
    with av.open(str(tmp_path / "a.mp4")) as c:
        cc = c.streams.video[0].codec_context
        frame = next(c.decode(video=0))
        assert (cc.colorspace, cc.color_primaries, cc.color_trc) == (1, 1, 1)  # AVCOL_*_BT709
        bt709 = frame.to_ndarray(format="rgb24", src_colorspace=av.video.reformatter.Colorspace.ITU709)
    for got in (_decoded(tmp_path / "a.mp4")[1][0], bt709):
        assert np.abs(got[100:300, 100:500].astype(int) - (220, 30, 30)).max() <= 6
        assert np.abs(got[100:300, 800:1200].astype(int) - (30, 200, 60)).max() <= 6


def test_a_one_pixel_video_is_annotated_at_two_by_two(tmp_path):
    """yuv420p wants even sizes: a 1x1 video's frames were 0 wide, the encoder refused them, and
    `video --annotate` stopped every output after the first frame with a traceback."""
    from pipelines.annotated import AnnotatedVideoSink

    for w, h, shape in ((1, 1, (2, 2, 3)), (65, 49, (48, 64, 3))):  # and an odd size: its last column and row go
        sink = AnnotatedVideoSink(tmp_path / "a.mp4", w, h)
        for i in range(3):
            sink.write_image(np.full((h, w, 3), 200, np.uint8), "a red dot", "", i / 10)
        sink.close()
        _, frames = _decoded(tmp_path / "a.mp4")
        assert [f.shape for f in frames] == [shape] * 3


def test_frames_sharing_a_time_are_each_kept_and_a_second_close_changes_nothing(tmp_path):
    """Two frames of one time (a stream's clock that stands still, a timestamp repeated) are both
    in the annotated copy, a millisecond apart, not a muxer error; a sink closed twice (by a run's
    end and by its cleanup) leaves the finished file as it was."""
    from pipelines.annotated import AnnotatedVideoSink

    sink = AnnotatedVideoSink(tmp_path / "a.mp4", 64, 48)
    for i, t in enumerate((0.0, 0.5, 0.5, 1.0)):
        sink.write_image(np.full((48, 64, 3), 60 * i, np.uint8), "a red dot", "", t)
    sink.close(end=1.5)
    written = (tmp_path / "a.mp4").read_bytes()
    sink.close(end=1.5)
    assert (tmp_path / "a.mp4").read_bytes() == written
    times, _ = _decoded(tmp_path / "a.mp4")
    assert times == pytest.approx([0.0, 0.5, 0.501, 1.0])


def test_frames_the_encoder_could_not_take_are_counted_skipped(tmp_path, monkeypatch):
    """A slow disk or a 4K stream: frames that find the encoder's queue full are left out of the
    recording and counted (`live --json`'s "recording": every completed frame is written or
    skipped)."""
    import threading

    from engine.types import RequestOutput
    from pipelines import recorder as recorder_module
    from pipelines.annotated import AnnotatedVideoSink
    from pipelines.live import LiveResult
    from pipelines.sources import Frame

    go = threading.Event()
    write = AnnotatedVideoSink.write_image
    monkeypatch.setattr(AnnotatedVideoSink, "write_image", lambda self, *a: go.wait(10) and write(self, *a))
    rec = recorder_module.Recorder(tmp_path / "r.mp4", queue_frames=2)
    rgb = np.full((120, 160, 3), 90, np.uint8)
    for i in range(10):
        rec.add(LiveResult(Frame("cam", i, i / 10, rgb, captured_at=100.0 + i / 10), [RequestOutput("yes", [], "stop")],
                           20.0, [{"caption": "short"}]))
    go.set()
    rec.close()
    times, _ = _decoded(tmp_path / "r.mp4")
    assert rec.written == len(times) and 1 <= rec.written <= 3 and rec.written + rec.skipped == 10


def test_a_recording_is_timed_by_capture_from_its_first_frame_whatever_the_sources_clock(tmp_path):
    """A camera's MPEG-TS clock an hour in (pts 3600 s): the recording starts at 0 and each frame
    comes when it was captured after the first, not at its presentation time."""
    from engine.types import RequestOutput
    from pipelines.live import LiveResult
    from pipelines.recorder import Recorder
    from pipelines.sources import Frame

    rgb = np.full((120, 160, 3), 90, np.uint8)
    rec = Recorder(tmp_path / "r.mp4")
    for i in range(5):
        rec.add(LiveResult(Frame("cam", i, 3600 + i / 30, rgb, captured_at=100.0 + i / 10),
                           [RequestOutput("yes", [], "stop")], 20.0, [{"caption": "short"}]))
    rec.close()
    times, _ = _decoded(tmp_path / "r.mp4")
    assert times == [round(i / 10, 3) for i in range(5)]


def test_a_recordings_last_frame_lasts_until_the_recording_ended(tmp_path):
    """`live --annotate` of a slow model (Moondream 2 on a CPU: a frame every few seconds): the
    last answer of the session was on screen in the recording for 1 ms, never seen, and a
    recording of one frame was 0.001 s long. It lasts until the recording was closed."""
    import time

    from engine.types import RequestOutput
    from pipelines.live import LiveResult
    from pipelines.recorder import Recorder
    from pipelines.sources import Frame

    rgb = np.full((48, 64, 3), 90, np.uint8)
    now = time.perf_counter()
    rec = Recorder(tmp_path / "r.mp4")
    for i, ago in enumerate((1.0, 0.7)):  # captured 1.0 and 0.7 s before the session ends
        rec.add(LiveResult(Frame("cam", i, i / 10, rgb, captured_at=now - ago), [RequestOutput("yes", [], "stop")],
                           20.0, [{"caption": "short"}]))
    rec.close()
    times, _ = _decoded(tmp_path / "r.mp4")
    with av.open(str(tmp_path / "r.mp4")) as c:
        seconds = c.duration / 1_000_000
    assert times == [0.0, 0.3] and rec.error is None
    assert 1.0 <= seconds < 1.0 + 30  # to the close, not to 0.301 s

    # a browser camera's (hold_to_close=False): closed at its download, maybe minutes after the
    # camera stopped, its last frame lasts until its answer came, not until the download
    cam = Recorder(tmp_path / "cam.mp4", hold_to_close=False)
    for i, ago in enumerate((1.0, 0.7)):
        cam.add(LiveResult(Frame("cam", i, i / 10, rgb, captured_at=time.perf_counter() - ago),
                           [RequestOutput("yes", [], "stop")], 20.0, [{"caption": "short"}]))
    time.sleep(1.5)
    cam.close()
    with av.open(str(tmp_path / "cam.mp4")) as c:
        assert 0.3 < c.duration / 1_000_000 < 1.0 + 1.0  # to the answer (~1.0 s), not the close (~2.5 s)

    one = Recorder(tmp_path / "one.mp4", max_seconds=0.5)  # a capped recording ends at its cap
    one.add(LiveResult(Frame("cam", 0, 0.0, rgb, captured_at=time.perf_counter() - 2.0),
                       [RequestOutput("yes", [], "stop")], 20.0, [{"caption": "short"}]))
    one.close()
    with av.open(str(tmp_path / "one.mp4")) as c:
        assert c.duration / 1_000_000 == pytest.approx(0.5, abs=0.01)


def test_an_annotated_videos_last_frame_lasts_one_frames_time_as_its_last_cue(tmp_path):
    """A sampled video stopped partway (Ctrl-C, the UI's Cancel): its annotated copy held the last
    frame to where decoding had got to (~1 s past it at --fps 1, decoding reads ahead), while its
    subtitles' last cue ended a frame's time after it. Both end there now; a whole run's end (the
    video's) still caps it, and without a frame's time the end is as given."""
    from pipelines.annotated import AnnotatedVideoSink

    rgb = np.zeros((48, 64, 3), np.uint8)

    def seconds(name: str, end: float | None, frame_duration: float | None) -> float:
        sink = AnnotatedVideoSink(tmp_path / name, 64, 48, frame_duration=frame_duration)
        for pts in (0.0, 0.5, 1.0):
            sink.write_image(rgb, "a circle", "#0", pts)
        sink.close(end)
        with av.open(str(tmp_path / name)) as c:
            return c.duration / 1_000_000

    assert seconds("stopped.mp4", 2.3, 0.5) == pytest.approx(1.5, abs=0.01)  # decoding had reached 2.3 s
    assert seconds("whole.mp4", 1.2, 0.5) == pytest.approx(1.2, abs=0.01)  # the video ended there
    assert seconds("no_end.mp4", None, 0.5) == pytest.approx(1.5, abs=0.01)
    assert seconds("as_given.mp4", 2.3, None) == pytest.approx(2.3, abs=0.01)  # a live recording's close


def test_a_recorded_frame_is_drawn_with_its_answer_index_and_latency(tmp_path, monkeypatch):
    """What a viewer of the recording reads on each frame: the answer, the frame's number and how
    long it took from capture to answer."""
    from engine.types import RequestOutput
    from pipelines.annotated import AnnotatedVideoSink
    from pipelines.live import LiveResult
    from pipelines.recorder import Recorder
    from pipelines.sources import Frame

    drawn = []
    write = AnnotatedVideoSink.write_image
    monkeypatch.setattr(AnnotatedVideoSink, "write_image", lambda self, *a: drawn.append(a[1:]) or write(self, *a))
    rec = Recorder(tmp_path / "r.mp4")
    rgb = np.full((48, 64, 3), 90, np.uint8)
    rec.add(LiveResult(Frame("cam", 4, 0.4, rgb, captured_at=50.4), [RequestOutput("a red car", [], "stop")], 87.6,
                       [{"caption": "short"}]))
    rec.add(LiveResult(Frame("cam", 9, 0.9, rgb, captured_at=50.9),  # two questions: both answers drawn
                       [RequestOutput("yes", [], "stop"), RequestOutput("two", [], "stop")], 1234.2,
                       [{"question": "Is the door open?"}, {"question": "How many people?"}]))
    rec.close()
    assert rec.error is None
    assert drawn == [("a red car", "#4  88 ms", 0.0, None),  # no note: no outage
                     ("Is the door open?: yes\nHow many people?: two", "#9  1234 ms", pytest.approx(0.5), None)]
