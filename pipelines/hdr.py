"""HDR video (PQ or HLG transfer, BT.2020 primaries: phones record HLG by default, HDR10 and
Dolby Vision releases are PQ) to the SDR BT.709 pixels the model reads and a page shows.

Read as SDR (the plain RGB conversion applies the BT.2020 matrix but not the transfer or the
gamut), an HLG red came out brown-orange and the whole frame washed out: mean error 11 levels
against the SDR source of the same scene, the colour the captions name most often changed. FFmpeg's
scale filter (8.x colour management: transfer, primaries, gamut mapping) converts it, at 4.3.
One filter graph per frame shape, kept for the process: its first frame builds the tables
(~2 s), later frames cost ~4x a plain conversion (BENCHMARKS.md).

The colour work costs per pixel it is done on, so a frame larger than 1080p (a phone's 4K HLG) is
first scaled down, plainly in YUV, to fit 1920x1080 (area), and comes out that size: 80-90 ms a 4K
frame instead of 200 on two cores. The model reads no more of a frame than that (Moondream 2: at
most 12 crops of 378 px, ~1.7 Mpx).
"""

from __future__ import annotations

import functools
import sys
import threading
from fractions import Fraction

import numpy as np

# AVColorTransferCharacteristic: SMPTE ST 2084 (PQ) and ARIB STD-B67 (HLG).
HDR_TRANSFERS = frozenset({16, 18})
MAX_PIXELS = 1920 * 1080  # larger HDR frames are tone-mapped (and come out) scaled down to this area
_warned: list[str] = []  # the error of an FFmpeg that cannot tone-map, once said


def is_hdr(frame) -> bool:
    return getattr(frame, "color_trc", None) in HDR_TRANSFERS


def sdr_size(width: int, height: int) -> tuple[int, int]:
    """The size an HDR frame shown at width x height comes out: the same, or scaled down to
    MAX_PIXELS (even sides, its shape kept)."""
    if width * height <= MAX_PIXELS:
        return width, height
    f = (MAX_PIXELS / (width * height)) ** 0.5
    return max(2, int(width * f) // 2 * 2), max(2, int(height * f) // 2 * 2)


def to_sdr(frame, width: int, height: int) -> np.ndarray:
    """The HDR frame in BT.709 as uint8 RGB, its pixels scaled to width x height, or down to
    `sdr_size` of it. With an FFmpeg older than 8 (no colour management in its scale filter),
    read as SDR, with a warning once."""
    import av

    width, height = sdr_size(width, height)
    if _warned:  # an FFmpeg that failed once fails again: no graph is tried for each frame
        return frame.to_ndarray(format="rgb24", width=width, height=height)
    try:
        graph, sink, lock = _graph(frame.width, frame.height, frame.format.name, width, height)
    except (av.FFmpegError, ValueError) as e:  # an option this FFmpeg does not have
        _warned.append(str(e))
        print(f"vlmstream: warning: HDR video is read as SDR (washed-out colours): this FFmpeg cannot "
              f"tone-map it ({e})", file=sys.stderr)
        return frame.to_ndarray(format="rgb24", width=width, height=height)
    with lock:  # a graph takes one frame at a time; frames convert on whichever thread loads them
        graph.push(frame)
        return sink.pull().to_ndarray()


@functools.lru_cache(maxsize=8)
def _graph(in_w: int, in_h: int, pix_fmt: str, out_w: int, out_h: int):
    from av.filter import Graph

    g = Graph()
    src = g.add_buffer(width=in_w, height=in_h, format=pix_fmt, time_base=Fraction(1, 90000))
    # Scaled down first, in YUV without colour work (cheap): the tone-mapping then runs on the
    # pixels that come out. In one scale filter it ran at the input's size (150 ms from 4K to
    # 1080p; 90 ms in two).
    head = g.add("scale", f"w={out_w}:h={out_h}") if out_w * out_h < in_w * in_h else src
    if head is not src:
        src.link_to(head)
    scale = g.add("scale", f"w={out_w}:h={out_h}:out_transfer=bt709:out_primaries=bt709:"
                           "out_color_matrix=bt709:out_range=pc")
    rgb = g.add("format", "rgb24")
    sink = g.add("buffersink")
    head.link_to(scale)
    scale.link_to(rgb)
    rgb.link_to(sink)
    g.configure()
    return g, sink, threading.Lock()
