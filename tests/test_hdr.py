"""HDR video (HLG as phones record it, PQ as HDR10 releases are) is tone-mapped to the SDR BT.709
pixels the model was trained on (pipelines/hdr.py): read as SDR, its reds came out orange-brown."""

import subprocess
from pathlib import Path

import av
import numpy as np
import pytest

from pipelines.sources import FileSource

SAMPLE = Path(__file__).resolve().parents[1] / "sample_videos" / "cuts_640x360_30fps.mp4"
# Debian's ffmpeg has zimg (zscale), which makes HDR from SDR; PyAV's own FFmpeg, which reads it, has not.
TO_HDR = "zscale=tin=bt709:t={trc}:pin=bt709:p=bt2020:min=bt709:m=bt2020nc:rin=tv:r=tv:npl=203,format=yuv420p10le"


def _has_zscale() -> bool:
    try:
        out = subprocess.run(["ffmpeg", "-hide_banner", "-filters"], capture_output=True, text=True, timeout=30).stdout
    except OSError:
        return False
    return " zscale " in out


@pytest.fixture(scope="module")
def clips(tmp_path_factory) -> dict[str, Path]:
    if not _has_zscale():
        pytest.skip("ffmpeg without zscale cannot make HDR test media")
    d = tmp_path_factory.mktemp("hdr")
    base = ["ffmpeg", "-loglevel", "error", "-y", "-i", str(SAMPLE), "-t", "0.5"]
    subprocess.run([*base, "-vf", "scale=320:180", "-c:v", "libx264", "-crf", "10", str(d / "sdr.mp4")],
                   check=True, timeout=60)
    for name, trc in (("hlg", "arib-std-b67"), ("pq", "smpte2084")):
        subprocess.run([*base, "-vf", "scale=320:180," + TO_HDR.format(trc=trc), "-c:v", "libx265", "-crf", "10",
                        "-x265-params", f"log-level=error:colorprim=bt2020:transfer={trc}:colormatrix=bt2020nc",
                        "-color_primaries", "bt2020", "-color_trc", trc, "-colorspace", "bt2020nc", str(d / f"{name}.mp4")],
                       check=True, timeout=60)
    # a frame larger than 1080p (2560x1440 here; a phone's HLG is 4K): the colour work on fewer pixels
    subprocess.run([*base, "-frames:v", "2", "-vf", "scale=2560:1440," + TO_HDR.format(trc="arib-std-b67"),
                    "-c:v", "libx265", "-preset", "ultrafast", "-x265-params",
                    "log-level=error:colorprim=bt2020:transfer=arib-std-b67:colormatrix=bt2020nc",
                    "-color_primaries", "bt2020", "-color_trc", "arib-std-b67", "-colorspace", "bt2020nc",
                    str(d / "hlg_large.mp4")], check=True, timeout=60)
    # a phone's HLG clip held upright: its pictures stored landscape, a display rotation to show them
    subprocess.run(["ffmpeg", "-loglevel", "error", "-y", "-i", str(d / "hlg.mp4"), "-c", "copy",
                    "-metadata:s:v:0", "rotate=90", str(d / "hlg_rotated.mp4")], check=True, timeout=60)
    # HLG stored at half its width with pixels twice as wide (sample aspect ratio 2:1)
    subprocess.run([*base, "-vf", "scale=160:180,setsar=2," + TO_HDR.format(trc="arib-std-b67"), "-c:v", "libx265",
                    "-crf", "10", "-x265-params", "log-level=error:colorprim=bt2020:transfer=arib-std-b67:"
                    "colormatrix=bt2020nc:sar=2\\:1", "-color_primaries", "bt2020", "-color_trc", "arib-std-b67",
                    "-colorspace", "bt2020nc", str(d / "hlg_anamorphic.mp4")], check=True, timeout=60)
    return {p.stem: p for p in d.iterdir()}


@pytest.mark.parametrize("name", ["hlg", "pq"])
def test_hdr_video_is_seen_in_the_colours_of_its_sdr_source(clips, name):
    with av.open(str(clips[name])) as c:
        assert next(c.decode(video=0)).color_trc in (16, 18)  # the clip is what it claims
    sdr = [f.rgb.astype(np.float32) for f in FileSource(str(clips["sdr"])).frames()]
    hdr = [f.rgb.astype(np.float32) for f in FileSource(str(clips[name])).frames()]
    assert len(hdr) == len(sdr) == 15 and hdr[0].shape == (180, 320, 3)
    error = float(np.mean([np.abs(a - b).mean() for a, b in zip(sdr, hdr)]))
    plain = float(np.mean([np.abs(a - f.to_ndarray(format="rgb24").astype(np.float32)).mean()
                           for a, f in zip(sdr, av.open(str(clips[name])).decode(video=0))]))
    assert error < 6.0 < 9.0 < plain, (error, plain)  # here: 4.3-4.8 against 10-11 read as SDR
    # the red things stay red: where the source is saturated red, green stays far below red
    red = (sdr[7][..., 0] > 180) & (sdr[7][..., 1] < 60)
    assert red.sum() > 50
    r, g = hdr[7][red][:, 0].mean(), hdr[7][red][:, 1].mean()
    assert r > 2.5 * g, (r, g)


def test_hdr_frames_larger_than_1080p_are_tone_mapped_at_1080p_in_their_shape(clips):
    """The tone mapping costs per pixel it works on (200 ms a 4K frame, 90 scaled down first)."""
    from pipelines.hdr import MAX_PIXELS, sdr_size

    assert sdr_size(3840, 2160) == (1920, 1080) and sdr_size(1920, 1080) == (1920, 1080)
    assert sdr_size(4096, 1716) == (2224, 932) and sdr_size(2560, 1440) == (1920, 1080)
    w, h = sdr_size(2160, 3840)  # portrait, as phones hold it
    assert (w, h) == (1080, 1920) and sdr_size(321, 180) == (321, 180)
    frame = next(FileSource(str(clips["hlg_large"])).frames())
    assert frame.rgb.shape == (1080, 1920, 3) and 1920 * 1080 <= MAX_PIXELS
    small = next(FileSource(str(clips["hlg"])).frames()).rgb.astype(np.float32)  # the same scene, 320x180
    import cv2

    error = np.abs(cv2.resize(frame.rgb, (320, 180), interpolation=cv2.INTER_AREA).astype(np.float32) - small).mean()
    assert error < 4.0, error  # the colours of the scene tone-mapped at its own size


def test_sdr_video_is_converted_as_before(clips):
    """The tone mapping touches HDR frames only (BT.709 SDR: the plain conversion)."""
    with av.open(str(clips["sdr"])) as c:
        plain = [f.to_ndarray(format="rgb24") for f in c.decode(video=0)]
    assert all(np.array_equal(a, f.rgb) for a, f in zip(plain, FileSource(str(clips["sdr"])).frames()))


def test_no_tonemap_reads_hdr_as_if_sdr(clips):
    """`--no-tonemap` (SDR video tagged HDR by a wrong export): the plain conversion, at the
    frame's own size, through files and live sources alike."""
    from pipelines.frame import Reading
    from pipelines.sources import open_live

    as_stored = Reading(tonemap=False)
    with av.open(str(clips["hlg"])) as c:
        plain = [f.to_ndarray(format="rgb24") for f in c.decode(video=0)]
    frames = [f.rgb for f in FileSource(str(clips["hlg"]), reading=as_stored).frames()]
    assert len(frames) == 15 and all(np.array_equal(a, b) for a, b in zip(plain, frames))
    assert next(FileSource(str(clips["hlg_large"]), reading=as_stored).frames()).rgb.shape == (1440, 2560, 3)
    live = open_live(str(clips["hlg"]), reading=as_stored)
    assert np.array_equal(next(live.frames()).load().rgb, plain[0])


def test_the_reading_switches_reach_video_live_and_the_ui(clips, small_folder, tmp_path, monkeypatch):
    """`video`, `live` and `ui` take --no-tonemap / --no-deinterlace to every source they open."""
    import pipelines.frame as frame_module
    import pipelines.sources as sources_module
    from app.cli import main, reading_arg
    from app.parser import build_parser
    from app.service import Service, UIError
    from pipelines.frame import Reading

    calls = []
    real = frame_module.to_sdr
    monkeypatch.setattr(frame_module, "to_sdr", lambda *a: calls.append(1) or real(*a))
    model = ["--model", str(small_folder), "--max-tokens", "2"]
    for flags, tone_mapped in (([], True), (["--no-tonemap"], False)):
        calls.clear()
        assert main(["video", str(clips["hlg"]), "--every-n", "5", "-o", str(tmp_path / "a.jsonl"), *flags,
                     *model]) == 0
        assert bool(calls) == tone_mapped
    calls.clear()
    assert main(["live", str(clips["hlg"]), "--duration", "1.5", "--no-tonemap", "-o", str(tmp_path / "b.jsonl"),
                 *model]) == 0
    assert (tmp_path / "b.jsonl").read_text() and not calls
    args = build_parser().parse_args(["ui", "--no-deinterlace", "--no-tonemap"])
    assert reading_arg(args) == Reading(deinterlace=False, tonemap=False)
    assert reading_arg(build_parser().parse_args(["ui"])) == Reading()
    seen = []

    def opened(source, reading=Reading(), name=None):
        seen.append(reading)
        raise UIError("stop here")

    monkeypatch.setattr(sources_module, "open_live", opened)
    with pytest.raises(UIError):
        Service(reading=Reading(tonemap=False)).start_live("s", str(clips["hlg"]), {"caption": "short"})
    assert seen == [Reading(tonemap=False)]


def test_hdr_video_is_shown_upright_and_at_its_display_shape(clips):
    """A phone records HLG, often held upright, and HDR broadcast may store non-square pixels: the
    tone-mapped frame is rotated and stretched as a player shows it, as an SDR one is."""
    sdr = [f.rgb.astype(np.float32) for f in FileSource(str(clips["sdr"])).frames()]
    rotated = [f.rgb.astype(np.float32) for f in FileSource(str(clips["hlg_rotated"])).frames()]
    assert len(rotated) == 15 and rotated[0].shape == (320, 180, 3)
    # "rotate=90" is counter-clockwise, as ffmpeg shows it
    assert np.mean([np.abs(np.rot90(a) - b).mean() for a, b in zip(sdr, rotated)]) < 6.0
    wide = [f.rgb.astype(np.float32) for f in FileSource(str(clips["hlg_anamorphic"])).frames()]
    assert len(wide) == 15 and wide[0].shape == (180, 320, 3)
    assert np.mean([np.abs(a - b).mean() for a, b in zip(sdr, wide)]) < 8.0


def test_an_ffmpeg_that_cannot_tone_map_says_so_once_and_keeps_the_frames_shape(clips, monkeypatch, capsys):
    """An FFmpeg older than 8 has no colour management in its scale filter: frames are read as SDR,
    at the size a tone-mapped one would have, with one warning for the whole run, not one a frame."""
    import pipelines.hdr as hdr

    def no_tone_mapping(*args):
        raise ValueError("Option 'out_transfer' not found")

    monkeypatch.setattr(hdr, "_graph", no_tone_mapping)
    monkeypatch.setattr(hdr, "_warned", [])
    shapes = [f.rgb.shape for f in FileSource(str(clips["hlg_large"])).frames()]
    shapes += [f.rgb.shape for f in FileSource(str(clips["hlg_anamorphic"])).frames()]
    assert shapes == [(1080, 1920, 3)] * 2 + [(180, 320, 3)] * 15
    assert capsys.readouterr().err.count("HDR video is read as SDR") == 1


def test_hdr_frames_scaled_down_keep_even_sides():
    """Even sides, as 4:2:0 video needs: a 2.35:1 HDR film would otherwise come out 2207x939."""
    from pipelines.hdr import MAX_PIXELS, sdr_size

    w, h = sdr_size(3840, 1634)
    assert w % 2 == h % 2 == 0 and w * h <= MAX_PIXELS and abs(w / h - 3840 / 1634) < 0.01
