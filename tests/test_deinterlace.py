"""Interlaced video comes whole (pipelines/deinterlace.py): no comb teeth where things move, no
frame lost or added, progressive video untouched."""

import subprocess
from pathlib import Path

import av
import numpy as np
import pytest

from pipelines.sources import FileSource


def _ffmpeg(*args: str) -> None:
    subprocess.run(["ffmpeg", "-loglevel", "error", "-y", *args], check=True, timeout=60)


@pytest.fixture(scope="module")
def clips(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("interlaced")
    # A progressive 50 fps original (lossless) and the same woven into 25 interlaced frames a
    # second, top field first, as a broadcast camera shoots: each field a moment of its own.
    _ffmpeg("-f", "lavfi", "-i", "testsrc2=size=320x240:rate=50", "-t", "0.6", "-pix_fmt", "yuv420p",
            "-c:v", "libx264", "-qp", "0", "-preset", "ultrafast", str(d / "progressive.mp4"))
    _ffmpeg("-i", str(d / "progressive.mp4"), "-vf", "tinterlace=interleave_top,setfield=tff",
            "-flags", "+ildct+ilme", "-x264opts", "tff=1", "-c:v", "libx264", "-qp", "0", "-preset", "ultrafast",
            str(d / "interlaced.mp4"))
    # a phone's portrait clip says so in side data, which the filter must carry over
    _ffmpeg("-i", str(d / "interlaced.mp4"), "-c", "copy", "-metadata:s:v:0", "rotate=90", str(d / "rotated.mp4"))
    # A broadcast that changes resolution (another programme): two interlaced pieces, one stream
    for name, size in [("a", "320x240"), ("b", "256x192")]:
        _ffmpeg("-f", "lavfi", "-i", f"testsrc2=size={size}:rate=50", "-t", "0.4", "-vf",
                "tinterlace=interleave_top,setfield=tff", "-flags", "+ildct+ilme", "-x264opts", "tff=1",
                "-c:v", "libx264", "-preset", "ultrafast", "-f", "mpegts", str(d / f"{name}.ts"))
    (d / "switch.ts").write_bytes((d / "a.ts").read_bytes() + (d / "b.ts").read_bytes())
    # A broadcast switching from an interlaced programme to a progressive one of the same size
    _ffmpeg("-f", "lavfi", "-i", "testsrc2=size=320x240:rate=25", "-t", "0.4", "-c:v", "libx264", "-preset",
            "ultrafast", "-pix_fmt", "yuv420p", "-f", "mpegts", str(d / "p.ts"))
    (d / "mixed.ts").write_bytes((d / "a.ts").read_bytes() + (d / "p.ts").read_bytes())
    return {p.stem: p for p in d.iterdir()}


def _comb(rgb: np.ndarray) -> float:
    """Vertical second difference: large where lines alternate between two moments."""
    x = rgb.astype(np.float32)
    return float(np.abs(2 * x[1:-1] - x[:-2] - x[2:]).mean())


def test_interlaced_frames_come_whole_one_for_one(clips):
    truth = [f.to_ndarray(format="rgb24").astype(np.int16) for f in av.open(str(clips["progressive"])).decode(video=0)]
    woven = [f.to_ndarray(format="rgb24").astype(np.int16) for f in av.open(str(clips["interlaced"])).decode(video=0)]
    src = FileSource(clips["interlaced"])
    frames = list(src.frames())
    src.close()
    assert len(truth) == 30 and len(woven) == len(frames) == 15  # the frame held back is flushed at the end
    assert [round(f.pts, 3) for f in frames] == [round(i * 0.04, 3) for i in range(15)]
    assert src.seconds == pytest.approx(0.6)
    # each frame is the moment of its top field: far nearer it than the woven frame is, and as
    # free of comb teeth as the progressive original
    error = np.mean([np.abs(f.rgb - truth[2 * k]).mean() for k, f in enumerate(frames)])
    woven_error = np.mean([np.abs(w - truth[2 * k]).mean() for k, w in enumerate(woven)])
    assert error < 0.7 * woven_error
    comb = [_comb(f.rgb) / _comb(truth[2 * k]) for k, f in enumerate(frames)]
    woven_comb = [_comb(w) / _comb(truth[2 * k]) for k, w in enumerate(woven)]
    assert max(comb) < 1.15 and np.mean(woven_comb) > 1.6


def test_a_deinterlaced_frame_keeps_its_display_rotation(clips):
    src = FileSource(clips["rotated"])
    assert [f.rgb.shape for f in src.frames()] == [(320, 240, 3)] * 15
    src.close()


def test_progressive_video_is_untouched(clips):
    plain = [f.to_ndarray(format="rgb24") for f in av.open(str(clips["progressive"])).decode(video=0)]
    src = FileSource(clips["progressive"])
    frames = [f.rgb for f in src.frames()]
    src.close()
    assert len(frames) == len(plain) and all(np.array_equal(a, b) for a, b in zip(frames, plain))


def test_a_change_of_resolution_loses_no_frame(clips):
    src = FileSource(clips["switch"])
    frames = list(src.frames())
    src.close()
    assert [f.rgb.shape for f in frames] == [(240, 320, 3)] * 10 + [(192, 256, 3)] * 10
    for piece in (frames[:10], frames[10:]):  # each piece's own timestamps, in order
        assert all(b.pts > a.pts for a, b in zip(piece, piece[1:]))


def test_no_deinterlace_reads_the_frames_as_stored(clips):
    """`--no-deinterlace` (a progressive film flagged interlaced): the frames as decoded, fields
    woven, none held back, through files and live sources alike."""
    from pipelines.frame import Reading
    from pipelines.sources import open_live

    woven = [f.to_ndarray(format="rgb24") for f in av.open(str(clips["interlaced"])).decode(video=0)]
    src = FileSource(clips["interlaced"], reading=Reading(deinterlace=False))
    frames = list(src.frames())
    src.close()
    assert len(frames) == len(woven) == 15 and all(np.array_equal(a, f.rgb) for a, f in zip(woven, frames))
    assert [round(f.pts, 3) for f in frames] == [round(i * 0.04, 3) for i in range(15)]
    live = open_live(str(clips["interlaced"]), reading=Reading(deinterlace=False))
    assert all(np.array_equal(a, f.load().rgb) for a, f in zip(woven, live.frames()))
    shown = next(open_live(str(clips["interlaced"])).frames()).load().rgb  # the default: made whole
    assert _comb(shown) < 0.8 * _comb(woven[0])


def test_progressive_frames_within_an_interlaced_video_pass_unchanged(clips):
    """Once the filter is built for an interlaced programme, a progressive one after it keeps its
    full vertical detail: only frames flagged interlaced are made whole."""
    decoded = [(f.interlaced_frame, f.to_ndarray(format="rgb24")) for f in av.open(str(clips["mixed"])).decode(video=0)]
    assert [flag for flag, _ in decoded] == [True] * 10 + [False] * 10  # the clip is what it claims
    src = FileSource(clips["mixed"])
    frames = [f.rgb for f in src.frames()]
    src.close()
    assert len(frames) == 20
    assert not any(np.array_equal(rgb, f) for (_, rgb), f in zip(decoded[:10], frames[:10]))  # made whole
    assert all(np.array_equal(rgb, f) for (_, rgb), f in zip(decoded[10:], frames[10:]))


def test_a_progressive_frame_is_given_at_once_not_a_frame_late(clips):
    """A live progressive camera's frame is shown as it is decoded: the filter holds one frame
    back, which only interlaced video pays for."""
    from pipelines.deinterlace import Deinterlacer

    deinterlacer = Deinterlacer()
    with av.open(str(clips["progressive"])) as c:
        for frame in c.decode(video=0):
            assert deinterlacer.push(frame) == [frame]
    assert deinterlacer.flush() == []
