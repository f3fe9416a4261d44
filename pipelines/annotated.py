"""The annotated MP4: each processed frame with its answers and an info line drawn in a band at
the bottom (`annotate`), and a note where one is given in a red band at the top (a live
recording's outage), encoded as H.264 at the frames' own times (`AnnotatedVideoSink`, one of the
sinks of `pipelines.sinks`; `live --annotate` records through it too).

Drawing a frame's caption is most of the cost of annotating it, and a video's caption repeats for
many frames: the caption band is cached, the info line (new every frame) is not.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np

from .output_file import open_output
from .sinks import FrameResult, frame_text


NOTE_COLOURS = ((255, 255, 255), (170, 0, 0))  # a note's text and band: unlike any caption's


def annotate(rgb: np.ndarray, text: str, info: str, note: str | None = None) -> np.ndarray:
    """A copy of the frame with its caption (each answer from a new line, wrapped to the frame's
    width, at most half the frame's height) and a line of info drawn in a band at the bottom;
    `note`, wrapped likewise (at most a quarter of the height), in a red band at the top."""
    h, w = rgb.shape[:2]
    # Sized by the height, and by the width for portrait frames: a phone's 1080x1920 video had
    # 96-px letters, 20 to the line. At most half the frame: a band taller than a small frame
    # (under 36 rows) left no room for the caption and the drawing failed (a 16x16 video).
    # Text that small is unreadable, but the frame is still written.
    band = max(1, min(max(18, min(h // 14, w // 24)), h // 2))
    lines = _wrapped(text, w, band)[: max(1, h // (2 * band))]
    top = h - (len(lines) + 1) * band
    img = np.array(rgb)  # a writable copy
    img[max(top, 0):h - band] = _caption_band(lines, w, band, (255, 255, 255))[max(-top, 0):]
    img[h - band:] = _band((info,), w, band, (255, 220, 0))  # new every frame: not cached
    if note:
        shown = _wrapped(note, w, band)[: max(1, h // (4 * band))]
        img[: min(h, len(shown) * band)] = _caption_band(shown, w, band, *NOTE_COLOURS)[:h]
    return img


MAX_WORD = 200  # characters of one word drawn (a 5000-character "word" took 119 ms to lay out)


@functools.lru_cache(maxsize=64)
def _wrapped(text: str, width: int, band: int) -> tuple[str, ...]:
    """The text's lines broken between words to fit `width` pixels in the band's font (a long
    caption ran off the frame's right edge, its end lost). A word wider than that keeps a line.
    Each word is measured once (`_word_px`, cached: captions reuse their words), and a line's
    width is the sum of its words' and spaces'."""
    size, room = max(1, int(band * 0.7)), width - 12
    space = _word_px(" ", size)
    out: list[str] = []
    for answer in text.strip().splitlines():
        line, used = [], 0.0
        for word in answer.split():
            word = word[:MAX_WORD]
            px = _word_px(word, size)
            if line and used + space + px > room:
                out.append(" ".join(line))
                line, used = [], 0.0
            used += (space if line else 0.0) + px
            line.append(word)
        out.append(" ".join(line))
    return tuple(out) or ("",)


@functools.lru_cache(maxsize=4096)
def _word_px(word: str, size: int) -> float:
    return _font(size).getlength(word)


def _band(lines: tuple[str, ...], width: int, band: int, colour: tuple[int, int, int],
          background: tuple[int, int, int] = (0, 0, 0)) -> np.ndarray:
    """Lines of text on `background` (black), `band` pixels a line."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (width, band * len(lines)), background)
    draw, font = ImageDraw.Draw(img), _font(max(1, int(band * 0.7)))
    for i, line in enumerate(lines):
        draw.text((6, i * band + 2), line, fill=colour, font=font)
    out = np.asarray(img)
    out.flags.writeable = False
    return out


# A video's caption repeats for many frames, and drawing it is most of the cost of annotating one
# (~1 ms of ~2.4 at 640x360).
_caption_band = functools.lru_cache(maxsize=64)(_band)


@functools.lru_cache(maxsize=8)
def _font(size: int):
    from PIL import ImageFont

    return ImageFont.load_default(size=size)  # Pillow's embedded scalable font: no system fonts needed


ANNOTATED_COMMENT = "annotated by vlmstream"


class AnnotatedVideoSink:
    """H.264 yuv420p MP4 of the processed frames, caption and latency drawn, original timing."""

    needs_rgb = True  # it draws on the frames (the other sinks write text only)

    def __init__(self, path: str | Path, width: int, height: int, fragmented: bool = False,
                 frame_duration: float | None = None):
        """fragmented: an MP4 that plays up to its last second or so however the process ends
        (killed, out of memory, power lost), for open-ended recordings; otherwise the index goes
        first (it is written at the end), which players and browsers start from soonest.
        frame_duration: what one frame processed stands for (a sampled video's period), as
        SubtitleSink's: the last frame lasts no longer, `close(end)` or not."""
        import av

        self._av = av
        self.frame_duration = frame_duration
        # yuv420p wants even sizes, 2x2 at least (a 1x1 video's came out 0 wide: the encoder refused it)
        self.width, self.height = max(2, width - width % 2), max(2, height - height % 2)
        self.path = Path(path)
        # A fragment a second, keyframe or not (decoding starts from the first one anyway), each
        # handed to the OS as it is cut.
        options = ({"movflags": "+empty_moov+default_base_moof", "frag_duration": "1000000", "flush_packets": "1"}
                   if fragmented else {"movflags": "+faststart"})
        # The file is ours to close: PyAV kept the descriptor of a file it had opened itself once
        # writing it failed (a full disk), one a failed recording, for the life of the server.
        self._file = open_output(path, "w+b")  # +: the index moved to the front is read back
        try:
            self._container = av.open(self._file, mode="w", options=options)
        except BaseException:
            self._file.close()
            raise
        # What tells our output from someone's video of the same name (app/outputs.py: a run
        # writes over the one, not the other)
        self._container.metadata["comment"] = ANNOTATED_COMMENT
        self._failed: BaseException | None = None  # the first write that failed
        self._stream = self._container.add_stream("libx264", rate=1000)
        self._stream.width, self._stream.height, self._stream.pix_fmt = self.width, self.height, "yuv420p"
        self._stream.time_base = __import__("fractions").Fraction(1, 1000)
        # One encoder thread: x264's own threads cost more CPU in all (3.6 against 2.2 ms a 640x360
        # frame here), taken from the engine's cores, beside which this sink always runs.
        self._stream.options = {"crf": "23", "preset": "veryfast", "threads": "1"}
        # No B-frames: a fragmented file has no edit list to start reordered frames at 0 s, and
        # without reordering the last packet is the last frame, which close(end) lengthens.
        self._stream.options["bf"] = "0"
        # BT.709, said in the stream: the RGB was converted with swscale's default (BT.601) and the
        # file said nothing, so players took an HD copy for BT.709 (mpv, browsers: the guess for
        # HD), its colours off the original's (reds orange, up to 78 of 255 off). Converted with
        # BT.709 (write_image) and tagged so, it shows as the frames were read, at any size.
        self._stream.options["x264-params"] = "colorprim=bt709:transfer=bt709:colormatrix=bt709"
        self._last_pts = -1
        self._held = None  # the newest packet (see _mux)
        self._closed = False

    def write(self, r: FrameResult, rgb: np.ndarray | None = None) -> None:
        self.write_frame([r], rgb)

    def write_frame(self, results: list[FrameResult], rgb: np.ndarray | None = None) -> None:
        if rgb is None:
            return
        r = results[0]
        info = f"#{r.index} {r.pts:.3f}s  {max(x.timings_ms.get('total', 0) for x in results):.0f} ms"
        self.write_image(rgb, frame_text(results), info, r.pts)

    def write_image(self, rgb: np.ndarray, text: str, info: str, seconds: float, note: str | None = None) -> None:
        """One frame with `text`, `info` and `note` drawn (`annotate`), shown from `seconds` on
        (until the next one)."""
        if self._failed is not None:  # the file is lost: a caller that goes on is told again
            raise self._failed
        img = annotate(self._fit(rgb), text, info, note)
        frame = self._av.VideoFrame.from_ndarray(img, format="rgb24").reformat(
            format="yuv420p", dst_colorspace=self._av.video.reformatter.Colorspace.ITU709)  # as tagged (above)
        pts = max(int(round(seconds * 1000)), self._last_pts + 1)  # strictly increasing
        frame.pts, self._last_pts = pts, pts
        try:
            self._mux(self._stream.encode(frame))
        except KeyboardInterrupt:
            # Ctrl-C or SIGTERM, raised between two bytecodes, is no failed write: close() still
            # flushes the encoder (skipped, the frames it held were lost: ~13 at 640x360).
            raise
        except BaseException as e:
            if isinstance(e, self._av.FFmpegError) and not isinstance(e, OSError):
                # The encoder refused it (x264 opens no 17000 px wide video): this output cannot be
                # written, as on a full disk, where av.ExternalError had ended the whole run
                self._failed = OSError(e.errno or 0, f"the H.264 encoder cannot take this {self.width}x{self.height} "
                                       f"video ({e.strerror or e})", str(self.path))
                raise self._failed from None
            self._failed = e
            raise

    def _fit(self, rgb: np.ndarray) -> np.ndarray:
        """The frame at the video's size: a stream can change resolution on the way (an HLS
        rendition, a camera switching streams), and such frames were cropped to the first one's
        size. Scaled whole to fit, with black bars where the shape differs."""
        h, w = rgb.shape[:2]
        if h - h % 2 == self.height and w - w % 2 == self.width:
            return rgb[: self.height, : self.width]
        import cv2

        scale = min(self.width / w, self.height / h)
        fw, fh = max(1, round(w * scale)), max(1, round(h * scale))
        out = np.zeros((self.height, self.width, 3), np.uint8)
        top, left = (self.height - fh) // 2, (self.width - fw) // 2
        out[top: top + fh, left: left + fw] = cv2.resize(rgb, (fw, fh), interpolation=cv2.INTER_AREA)
        return out

    def close(self, end: float | None = None) -> None:
        """end: where the video ends, if known: the last frame is shown until then, as the last
        cue of the subtitles is (it lasted a millisecond, so a sampled video's annotated copy was
        shorter than the video, and a one-frame video's lasted 0.001 s)."""
        if self._closed:  # a second close: the file is whole already (it raised EOFError)
            return
        self._closed = True
        try:
            if self._failed is None:  # after a failed write, muxing again crashed the process (SIGSEGV)
                self._mux(self._stream.encode())
                last, self._held = self._held, None
                if last is not None:
                    # As the subtitles' last cue: an interrupted `video --annotate` held its last
                    # frame to where decoding had got to, ~1 s past it at --fps 1.
                    if self.frame_duration is not None:
                        own = self._last_pts / 1000 + self.frame_duration
                        end = own if end is None or end <= self._last_pts / 1000 else min(own, end)
                    if end is not None:
                        last.duration = max(last.duration or 0, round(end * 1000) - self._last_pts)
                    self._container.mux(last)
        finally:
            try:
                self._container.close()
            except Exception:
                if self._failed is None:
                    raise
            finally:
                try:
                    self._file.close()
                except OSError:  # what was left to flush: the failure was said already
                    if self._failed is None:
                        raise

    def _mux(self, packets) -> None:
        """Mux all but the newest packet, which is held: close() may lengthen it."""
        for packet in packets:
            held, self._held = self._held, packet  # first: an interrupt never has one muxed twice
            if held is not None:
                self._container.mux(held)
